"""Multi-LoRA speed: decode and offline throughput with rank-16 adapters spread over the batch,
against the same engine without --enable-lora (the reference, same run), and batch 1 with one
adapter against the batch-1 roofline (weight + adapter + KV bytes per token / measured copy
bandwidth). Random weights of a model shape; adapters random too (speed does not depend on them).
Where the time goes: each decode step's time (1 / tok/s) beside the replay of its CUDA graph with
and without the LoRA kernels (the same engine: the rest is the host's), and with ``--kernels`` the
shrink and expand of each projection at batch 1 and ``--batch``, replayed from a graph, against
the base projection and the time their bytes take at copy bandwidth.

    python bench/lora.py [--shape llama3-8b] [--adapters 8] [--rank 16] [--batch 32] [--kernels]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    SHAPES,
    _time_cuda,
    header,
    kv_bytes_per_token,
    measure_ceilings,
    table,
    weight_bytes_per_token,
    write_shape_folder,
)
from kvship.kernels import lora as lora_kernels
from kvship.kernels.gemv import GEMV_SHAPES, act_mul_linear, gemv_triton, linear, linear_and_shrink
from kvship.kernels.lora import lora_expand, lora_shrink
from kvship.kernels.lora_segments import DECODE_BLOCK_M, RowGroups, group_rows, num_blocks
from kvship.llm import LLM
from kvship.lora_request import LoRARequest
from kvship.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, shape: str, rank: int, seed: int) -> int:
    """A PEFT adapter on every projection of every layer; its bytes (bf16)."""
    c = SHAPES[shape]
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for name, (i, o) in dims.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, i, generator=g) * 0.01).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(o, rank, generator=g) * 0.01).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGETS)}))
    return sum(t.numel() * 2 for t in tensors.values())


def tokens_per_second(llm, prompts, out_len: int, loras) -> float:
    # warm-up on the case itself: every adapter it uses read and copied into its slot (once per
    # adapter, not per step) and the prefill's kernels run at its size
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lora_request=loras)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.monotonic() - t0)


def one_token(llm, prompts: list[list[int]], lora: LoRARequest | None) -> float:
    """Median seconds of a request for one token (its prompt's prefill, eager) on ``lora``
    (None: the base model), one prompt after another; new prompts, so no prefix hit."""
    times = []
    for prompt in prompts:
        t0 = time.monotonic()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), lora_request=lora)
        times.append(time.monotonic() - t0)
    return sorted(times)[len(times) // 2]


def run(folder: str, args, adapters: list[LoRARequest] | None, fresh: LoRARequest | None = None
        ) -> dict[str, float]:
    """tok/s of each case; with ``adapters`` each request takes one (batch 1: the first), and
    ``fresh``'s first use is timed at the end."""
    lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank) if adapters else {}
    cap = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=args.prompt + args.output + 16,
              **lora, **cap)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(2, vocab, (args.prompt,), generator=g).tolist() for _ in range(n)]

    def spread(n):
        return [adapters[i % len(adapters)] for i in range(n)] if adapters else None

    out = {"batch 1 decode": tokens_per_second(llm, prompts(1), args.output, adapters[0] if adapters else None),
           f"batch {args.batch} decode": tokens_per_second(llm, prompts(args.batch), args.output, spread(args.batch)),
           f"offline ({args.offline} requests)": tokens_per_second(llm, prompts(args.offline), args.output,
                                                                  spread(args.offline))}
    out["weight bytes"] = weight_bytes_per_token(llm.engine.runner.model)
    out["replays"] = graph_replays(llm, [1, args.batch], len(adapters or ()))
    out["one token"] = one_token(llm, prompts(5), adapters[0] if adapters else None)
    if fresh is not None:  # read from disk, laid out, copied into the least recent slot
        out["first use"] = one_token(llm, prompts(1), fresh)
    llm.shutdown()
    return out


def run_child(args, folder: str, adapter_folders: list[str], out: Path, fresh: str | None = None) -> dict:
    """``run`` in a process of its own: each engine starts on a GPU nothing else has touched."""
    cmd = [sys.executable, __file__, "--engine-json", str(out), "--folder", folder, "--adapter-folders",
           *adapter_folders, "--shape", args.shape, "--rank", str(args.rank), "--batch", str(args.batch),
           "--offline", str(args.offline), "--prompt", str(args.prompt), "--output", str(args.output)]
    if fresh:
        cmd += ["--fresh-adapter", fresh]
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def graph_replays(llm, sizes: list[int], num_adapters: int) -> dict[str, tuple[float, float | None]]:
    """Seconds of one replay of the decode graph of each batch size, (without, with) the LoRA
    kernels (None for an engine without them), the rows spread over the adapters' slots (the last
    step's other inputs kept)."""
    runner = llm.engine.runner
    graphs = runner.graphs
    out = {}
    for n in sizes:
        bs = next(s for s in graphs.sizes if s >= n)
        lora = None
        if runner.lora is not None:
            runner.lora.write_slots([i % num_adapters for i in range(bs)], prefill=False)
            lora = _time_cuda(graphs.lora_graphs[bs].replay, iters=50)
        out[str(n)] = (_time_cuda(graphs.graphs[bs].replay, iters=50), lora)
    return out


def _graph_time(fn, reps: int = 20) -> float:
    """Seconds of one ``fn`` replayed from a CUDA graph of ``reps`` calls (as in the decode graphs)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return _time_cuda(g.replay, iters=20) / reps


def kernel_table(args, bw: float) -> str:
    """Shrink and expand of each projection of one layer, at batch 1 (per row; and the shrink as
    more programs of the base GEMV where the engine's GEMV takes the shape, the time they add),
    ``--batch`` and four times it (per row and grouped: the engine chooses by GROUPED_MIN_ROWS
    and grouped_shrink_from), rows spread over the adapters, against the base projection and the
    bytes limit (A or B of the adapters the rows use, x / y / partial sums) at copy bandwidth.
    Per step: times the layers."""
    c = SHAPES[args.shape]
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    modules = {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]), "down": (inter, [h])}
    dev, bf16, r = "cuda", torch.bfloat16, args.rank
    rows, grouped_from = [], (lora_kernels.GROUPED_MIN_ROWS, lora_kernels.GROUPED_SHRINK_MIN_ROWS)
    for batch, form in [(1, "per row"), (1, "shrink in the GEMV"), (args.batch, "per row"), (args.batch, "grouped"),
                        (4 * args.batch, "per row"), (4 * args.batch, "grouped")]:
        lora_kernels.GROUPED_MIN_ROWS = lora_kernels.GROUPED_SHRINK_MIN_ROWS = 1 if form == "grouped" else 1 << 30
        total = [0.0] * 4
        slots = (torch.arange(batch, device=dev) % args.adapters).to(torch.int32)
        used = min(batch, args.adapters)
        capacity = num_blocks(batch, args.adapters, DECODE_BLOCK_M)
        order, blocks = group_rows(slots.tolist(), DECODE_BLOCK_M, capacity)
        groups = RowGroups(torch.from_numpy(order).to(dev), torch.from_numpy(blocks).to(dev), DECODE_BLOCK_M)
        for name, (k, parts) in modules.items():
            n = sum(parts)
            act = "silu" if name == "down" else None  # its input the gate/up output, activated as read
            x = torch.randn(batch, 2 * k if act else k, device=dev, dtype=bf16)
            w = torch.randn(n, k, device=dev, dtype=bf16) * 0.01
            a = torch.randn(args.adapters, len(parts) * r, k, device=dev, dtype=bf16) * 0.01
            b = torch.randn(args.adapters, n, r, device=dev, dtype=bf16) * 0.01
            y = torch.zeros(batch, n, device=dev, dtype=bf16)
            t_base = _graph_time(lambda: act_mul_linear(x, w, act) if act else linear(x, w))
            # where the engine's GEMV takes the shrink (a shape it lists): what its A rows add to it
            in_gemv = form == "shrink in the GEMV" and (n, k) in GEMV_SHAPES
            if in_gemv:
                h_part = gemv_triton(x, w, None, GEMV_SHAPES[(n, k)], act=act, lora=(a, slots))[1]
                t_shrink = _graph_time(lambda: linear_and_shrink(x, w, None, act, a, slots)) - t_base
            else:
                h_part = lora_shrink(x, a, slots, groups, act)
                t_shrink = _graph_time(lambda: lora_shrink(x, a, slots, groups, act))
            t_expand = _graph_time(lambda: lora_expand(y, h_part, b, slots, parts, groups))
            shrink_bytes = used * a[0].numel() * 2 + x.numel() * 2 + h_part.numel() * 4
            expand_bytes = used * b[0].numel() * 2 + 2 * y.numel() * 2 + h_part.numel() * 4
            limit = (shrink_bytes + expand_bytes) / bw
            for i, t in enumerate((t_base, t_shrink, t_expand, limit)):
                total[i] += t
            rows.append([f"{batch} ({form})", name + (" (GEMV)" if in_gemv else ""), f"{t_base * 1e6:.1f}",
                         f"{t_shrink * 1e6:.1f}", f"{t_expand * 1e6:.1f}", f"{limit * 1e6:.2f}", f"{h_part.shape[0]}"])
        layers = c["num_hidden_layers"]
        rows.append([f"{batch} ({form})", f"per step ({layers} layers), ms",
                     *(f"{t * layers * 1e3:.2f}" for t in total), ""])
    lora_kernels.GROUPED_MIN_ROWS, lora_kernels.GROUPED_SHRINK_MIN_ROWS = grouped_from
    return table(rows, ["batch", "projection", "base µs", "shrink µs", "expand µs", "LoRA bytes limit µs",
                        "shrink splits"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--offline", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--kernels", action="store_true", help="also time each projection's shrink and expand")
    ap.add_argument("--max-num-seqs", type=int, help="each engine's batch cap (default: its own; fewer graphs "
                    "to capture, a shorter run)")
    ap.add_argument("--engine-json", help=argparse.SUPPRESS)  # a child: run one engine, write its figures
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--adapter-folders", nargs="*", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--fresh-adapter", help=argparse.SUPPRESS)  # one more, first used at the end
    args = ap.parse_args()
    if args.engine_json:
        adapters = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(args.adapter_folders)]
        fresh = LoRARequest("fresh", len(adapters) + 1, args.fresh_adapter) if args.fresh_adapter else None
        Path(args.engine_json).write_text(json.dumps(run(args.folder, args, adapters or None, fresh)))
        return
    bw, _ = measure_ceilings()
    if args.kernels:
        print(header(f"LoRA kernels: {args.shape}, {args.adapters} adapters of rank {args.rank}, one layer"))
        print(kernel_table(args, bw) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, Path(tmp) / "model")
        adapter_bytes = 0
        folders = []
        for i in range(args.adapters + 1):  # the last one first used once the cases ran
            adapter_bytes = write_adapter(Path(tmp) / f"a{i}", args.shape, args.rank, i)
            folders.append(str(Path(tmp) / f"a{i}"))
        fresh = folders.pop()
        # the base engine before and after the LoRA one, its faster run kept: the first engine of a
        # device call has run up to twice slower at batch 1, whichever it was
        first = run_child(args, folder, [], Path(tmp) / "base.json")
        with_lora = run_child(args, folder, folders, Path(tmp) / "lora.json", fresh)
        second = run_child(args, folder, [], Path(tmp) / "base.json")
        print(f"base engine before / after the LoRA one, batch 1: {first['batch 1 decode']:,.0f} / "
              f"{second['batch 1 decode']:,.0f} tok/s; batch {args.batch}: {first[f'batch {args.batch} decode']:,.0f} / "
              f"{second[f'batch {args.batch} decode']:,.0f}", file=sys.stderr)
        base = max(first, second, key=lambda r: r["batch 1 decode"])
    kv = kv_bytes_per_token(args.shape) * (args.prompt + args.output // 2)
    roof_base = bw / (base["weight bytes"] + kv)
    roof_lora = bw / (base["weight bytes"] + adapter_bytes + kv)
    targets = {"batch 1 decode": 0.90}
    rows = []
    for case in [k for k in base if k not in ("weight bytes", "replays", "one token", "first use")]:
        ratio = with_lora[case] / base[case]
        target = targets.get(case, 0.80)
        rows.append([case, f"{base[case]:,.0f}", f"{with_lora[case]:,.0f}", f"{ratio:.0%}", f">= {target:.0%}",
                     "ok" if ratio >= target else "below"])
    print(header(f"Multi-LoRA: {args.shape}, {args.adapters} adapters of rank {args.rank} (bf16)"))
    print(table(rows, ["case", "base tok/s (no --enable-lora)", "LoRA tok/s", "LoRA / base", "target", ""]))
    print(f"\na one-token request ({args.prompt}-token prompt): base engine {base['one token'] * 1e3:.1f} ms; "
          f"LoRA engine, adapter held {with_lora['one token'] * 1e3:.1f} ms, adapter not yet held (read, copied "
          f"into a slot) {with_lora['first use'] * 1e3:.1f} ms")
    print(f"batch-1 roofline: base {roof_base:,.0f} tok/s, with one adapter's {adapter_bytes / 2**20:.0f} MiB "
          f"{roof_lora:,.0f} tok/s (copy bandwidth {bw / 1e12:.2f} TB/s); batch-1 LoRA at "
          f"{with_lora['batch 1 decode'] / roof_lora:.0%} of it")
    rows = []
    for n, (plain, lora) in with_lora["replays"].items():
        step, base_step = (int(n) / engine[f"batch {n} decode"] for engine in (with_lora, base))
        rows.append([n, f"{base_step * 1e3:.2f}", f"{base['replays'][n][0] * 1e3:.2f}", f"{step * 1e3:.2f}",
                     f"{plain * 1e3:.2f}", f"{lora * 1e3:.2f}", f"{(step - lora) * 1e3:.2f}"])
    print("\nWhere a decode step's time goes (ms; a step: 1 / tok/s, prefills included; each engine in a "
          "process of its own):")
    print(table(rows, ["batch", "step, base engine", "its graph", "step, LoRA engine", "its graph without LoRA "
                       "kernels", "with them", "rest (host, prefill)"]))


if __name__ == "__main__":
    main()
