"""The CPU's intra-op thread count, chosen by measurement at start-up.

torch starts one thread per core. A batch-1 decode step is a chain of small products, each a
parallel region whose threads meet at a barrier: on a machine whose cores are also taken by
the server's event loop or by other processes, a thread that is descheduled holds up every
region, and two threads ran a step several times slower than one. So each candidate count
runs the real decode step a few times and the fastest is kept.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# A count above the smallest must beat it by this much: each extra thread also takes a core
# from the server's event loop, which the measurement at start-up does not see.
MARGIN = 0.10


def time_step(step: Callable[[], object], threads: int, reps: int) -> float:
    """Best seconds of ``reps`` runs of ``step`` with ``threads`` intra-op threads, after one warm-up."""
    torch.set_num_threads(threads)
    step()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def choose_cpu_threads(step: Callable[[], object], most: int, reps: int = 3) -> tuple[int, dict[int, float]]:
    """Time ``step`` (one decode step) with 1, 2, 4, ... up to ``most`` threads, set the count
    that is fastest by more than MARGIN over fewer threads, and return it with the timings."""
    counts = sorted({min(most, 1 << i) for i in range(most.bit_length() + 1)})
    timings = {n: time_step(step, n, reps) for n in counts}
    best = counts[0]
    for n in counts[1:]:
        if timings[n] < timings[best] * (1 - MARGIN):
            best = n
    torch.set_num_threads(best)
    return best, timings


def set_cpu_threads(threads: int | None, step: Callable[[], object]) -> str:
    """Set the intra-op threads (``threads``, or chosen by choose_cpu_threads) and return how
    they were chosen, for the start-up line."""
    if threads is not None:
        torch.set_num_threads(threads)
        return f"threads {threads} (--cpu-threads)"
    cores = torch.get_num_threads()
    chosen, timings = choose_cpu_threads(step, cores)
    measured = ", ".join(f"{s * 1e3:.0f} ms with {n}" for n, s in timings.items())
    return f"threads {chosen} of {cores} (a decode step took {measured})"


def weight_format(model: torch.nn.Module) -> str:
    """What the weights are stored as, largest share first: "float32 538 MB" or "int8 107 MB,
    float32 115 MB" (a quantized model's codes, its norms and embedding). Tensors a kernel object
    keeps outside the module's parameters (int8 codes and scales) count too."""
    seen: dict[int, torch.Tensor] = {}
    labels: dict[int, str] = {}  # packed int4 codes are uint8 tensors: named by their kernel's kind
    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            seen[t.data_ptr()] = t
        for value in vars(module).values():
            if not isinstance(value, (torch.Tensor, torch.nn.Module)) and hasattr(value, "__dict__"):
                for name, t in vars(value).items():
                    if isinstance(t, torch.Tensor):
                        seen[t.data_ptr()] = t
                        if name == "codes" and getattr(value, "kind", None) == "int4":
                            labels[t.data_ptr()] = "int4"
    sizes: dict[str, int] = {}
    for ptr, t in seen.items():
        name = labels.get(ptr) or str(t.dtype).removeprefix("torch.")
        sizes[name] = sizes.get(name, 0) + t.numel() * t.element_size()
    return ", ".join(f"{name} {n / 1e6:.0f} MB" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n >= 1e6)
