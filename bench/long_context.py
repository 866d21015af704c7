"""Batch-1 decode at long context (bench/latency.py --context): a hybrid shape (qwen3.6-27b: a
KV cache on one layer of four, a fixed-size recurrent state on the others) beside a dense
transformer of about its size (qwen3-32b) at the same context, each against its roofline: copy
bandwidth / (the weight bytes a decode step reads as loaded + the KV of its attention layers at
that context + the recurrent state it reads and writes).

One engine a shape and weight format, sized for the longest context; at each context a request
of that many random tokens is prefilled (its time: the prefill column), then --output tokens
are decoded, one run a point (a long prefill dominates the time). A configuration whose weights
and KV do not fit the device is reported as such and the others still run.

    python bench/latency.py --shape qwen3.6-27b --context 32768 131072 [--dense qwen3-32b]
                            [--quantization none fp8] [--output 128] [--device cpu]
"""
from __future__ import annotations

import gc
import tempfile

import torch

from common import (
    bytes_per_token,
    header,
    insitu_method,
    kv_bytes_per_token,
    measure_batch1,
    measure_ceilings,
    start_engine,
    table,
    write_shape_folder,
)

HEAD = ["model", "context", "weights GB/token", "KV GB/token", "state MB/token", "roofline tok/s", "decode tok/s",
        "of roofline", "prefill s"]
WARMUP_PROMPT = 64  # the warm-up request's prompt: compiles and captures without a long prefill


def shape_rows(shape: str, fmt: str, contexts: list[int], out_len: int, device: str, bw: float | None,
               root: str) -> list[list[str]]:
    """One row per context for ``shape`` in weight format ``fmt``, from one engine."""
    name = f"{shape} {'bf16' if fmt == 'none' else fmt}"
    try:
        llm = start_engine(write_shape_folder(shape, root), max(contexts) + out_len + 16, eager=device == "cpu",
                           quantization=insitu_method(fmt), device=device)
    except (RuntimeError, ValueError) as e:  # e.g. weights + KV at the longest context exceed the device
        return [not_run(name, "-", e)]
    weights, state = bytes_per_token(llm)
    rows = []
    for ctx in contexts:
        try:
            ttft, rate = measure_batch1(llm, ctx, out_len, runs=1, warmup_len=min(WARMUP_PROMPT, ctx))
        except RuntimeError as e:  # out of memory in the prefill
            rows.append(not_run(name, str(ctx), e))
            continue
        kv = (ctx + out_len / 2) * kv_bytes_per_token(shape)
        roof = bw / (weights + kv + state) if bw else None
        rows.append([name, str(ctx), f"{weights / 1e9:.2f}", f"{kv / 1e9:.2f}", f"{state / 1e6:.0f}",
                     f"{roof:.1f}" if roof else "-", f"{rate:.1f}", f"{100 * rate / roof:.0f}%" if roof else "-",
                     f"{ttft:.2f}"])
    del llm
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return rows


def not_run(name: str, ctx: str, error: Exception) -> list[str]:
    return [name, ctx, "-", "-", "-", "-", "-", "-", f"not run: {str(error).splitlines()[0][:120]}"]


def compare_contexts(args) -> None:
    """Rows print as they are measured: a time limit cutting the run short keeps the ones done."""
    bw = measure_ceilings()[0] if args.device != "cpu" else None
    shapes = [args.shape] + ([args.dense] if args.dense not in ("none", args.shape) else [])
    print(header(f"Batch-1 decode at long context, {' vs '.join(shapes)}, output {args.output}"))
    ceiling = f"copy bandwidth {bw / 1e12:.2f} TB/s; " if bw else "no bandwidth measured on this device; "
    print(ceiling + "roofline = copy bandwidth / (weight bytes read per token + KV at the context + recurrent "
          "state read and written)\n")
    print(table([], HEAD), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            for fmt in args.quantization or ["none"]:
                for row in shape_rows(shape, fmt, sorted(args.context), args.output, args.device, bw, tmp):
                    print(table([row], HEAD).splitlines()[-1], flush=True)
