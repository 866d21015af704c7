"""Guarded Triton import.

Triton is optional at run time: the engine must import (and run its torch paths) without it.
Kernel modules do ``from kvship.kernels._triton import HAS_TRITON, triton, tl`` and define
their ``@triton.jit`` kernels unconditionally; without Triton, ``triton.jit`` is a no-op
decorator and ``tl`` answers any attribute, so the module still imports, and the dispatch
functions never reach the kernels.

Kernels run in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` is set before the first
import of triton (the tests do that when no GPU is present).
"""
from __future__ import annotations

import functools
import os

import torch

try:  # pragma: no cover - which branch runs depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install
    HAS_TRITON = False

    class _AnyAttr:
        """Stands in for ``triton.language``: annotations such as ``tl.constexpr`` resolve."""

        def __getattr__(self, name: str) -> "_AnyAttr":
            return self

        def __call__(self, *args, **kwargs) -> "_AnyAttr":
            return self

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **kwargs):
            if fn is None:
                return lambda f: f
            return fn

        @staticmethod
        def constexpr_function(fn):
            return fn

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

        language = _AnyAttr()

    triton = _TritonStub()  # type: ignore[assignment]
    tl = _AnyAttr()  # type: ignore[assignment]


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the dispatch functions should take the Triton path for tensor ``t``."""
    return HAS_TRITON and t.is_cuda


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of ``t``'s device; a fixed small number off the GPU."""
    if t.is_cuda:
        return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t`` launch with programmatic dependent launch: a GPU of
    compute capability 9 or more (griddepcontrol is sm_90 PTX), not the interpreter.
    A kernel so launched may start while the one before it is finishing and run what does not
    depend on it; a batch-1 decode step is hundreds of short kernels, whose ramps this overlaps."""
    if not (HAS_TRITON and t.is_cuda) or INTERPRET:
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """A PDL-aware kernel's launch options: its PDL constexpr and the launch attribute, which
    must agree (a kernel launched early that never waits would race the one before)."""
    on = pdl(t)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The rule for a kernel launched with ``launch_pdl``: before it reads anything an earlier
    kernel writes, and before any store of its own, it waits here for the previous kernel to
    finish (which, as that kernel waited too, means every earlier one). Only data no kernel
    writes may be read before: weights, and the step's metadata that the host copies in before
    the step's first kernel (paged_attention's decode kernel reads its sequence bounds so).
    Then it lets the next kernel launch: that one starts once all of this kernel's programs are
    past this point, one kernel ahead at most."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_compile_watchers: list = []
_variants: dict[str, list[dict[str, str]]] = {}  # kernel name -> the variants compiled in this process


def _variant(compile: dict) -> dict[str, str]:
    """Each argument's share of a compile's key: its type, what Triton specialized it on (an
    integer's 1 or divisibility by 16, a pointer's alignment), a constexpr's value."""
    attrs, constants = (compile.get("configs") or [{}])[0], compile.get("constants", {})

    def described(i: int, ty: str) -> str:
        attr = "".join(f" {a.removeprefix('tt.')} {v}" for a, v in attrs.get((i,), []))
        return ty + attr + (f" = {constants[(i,)]}" if (i,) in constants else "")

    return {name: described(i, ty) for i, (name, ty) in enumerate(compile.get("signature", {}).items())}


def _what_is_new(name: str, variant: dict[str, str]) -> str:
    """The arguments that made ``variant`` new: where it differs from the closest variant of the
    kernel compiled before it in this process ("" for the first)."""
    earlier = _variants.setdefault(name, [])
    if variant in earlier:
        return ""
    closest = min(earlier, key=lambda v: sum(v.get(k) != t for k, t in variant.items()), default=None)
    earlier.append(variant)
    if closest is None:
        return ""
    return ", ".join(f"{k} {closest.get(k)} -> {t}" for k, t in variant.items() if closest.get(k) != t)


def track_compiles() -> None:
    """From now on, remember each kernel variant Triton compiles (or reads from its disk cache),
    so that a later compile can say which arguments were new (``watch_compiles``)."""
    if not HAS_TRITON:
        return
    import time

    from triton import knobs

    if getattr(knobs.runtime.jit_post_compile_hook, "__module__", None) == __name__:
        return
    started: dict[str, float] = {}

    def before(*, key, **_) -> bool:
        started[str(key)] = time.perf_counter()
        return False  # compile it

    def after(*, key, fn, compile=None, **_) -> None:
        now = time.perf_counter()
        seconds = now - started.pop(str(key), now)
        try:
            new = _what_is_new(fn.name, _variant(compile or {}))
        except Exception:  # a Triton whose hook arguments differ: the compile itself goes on
            new = ""
        for watcher in _compile_watchers:
            watcher(fn.name, seconds, new)

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after


def watch_compiles(on_compile) -> None:
    """From now on, ``on_compile(kernel name, seconds, what was new)`` after each Triton compile in
    this process: a kernel launched with arguments it has not seen (an integer's value 1 or
    divisibility by 16, a pointer's alignment, a constexpr), the arguments named as "name old ->
    new" against the closest variant compiled since ``track_compiles``. Read from Triton's disk
    cache, one takes milliseconds; compiled, about a second, while every request of the step waits."""
    if not HAS_TRITON or on_compile in _compile_watchers:  # a second engine in the process: once
        return
    _compile_watchers.append(on_compile)
    track_compiles()
