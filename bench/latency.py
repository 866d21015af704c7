"""Batch-1 latency: decode tok/s and time to first token for a model shape (random weights),
next to the roofline (weight + KV bytes per token / measured copy bandwidth) and HF
transformers' eager generate on the same shape. With --quantization, each weight format in the
same run (in-situ quantized from the same random weights), each beside its own roofline: the
bytes its layers really hold (codes, scales, offsets) plus the 16-bit output projection and KV.

gpt-oss shapes (gpt-oss-20b, gpt-oss-120b) hold their experts in MXFP4 as OpenAI ships them;
their roofline counts the bytes the loaded model reads per token (codes, scales and biases of
the k experts a token picks, the 16-bit rest), HF is left out (its MXFP4 path needs kernels
fetched from the hub), and one MXFP4 MoE layer is timed per token count.

For a shape with routed experts (qwen3-30b-a3b) the roofline counts the bytes a token reads:
the attention, norms and router of every layer, only the experts it picks, and the output
projection; a second table times one MoE layer (router and fused experts) alone, replayed in a
CUDA graph, against the bytes of the experts its tokens pick and against the plain-torch path.

Hybrid shapes (qwen3.6-27b, qwen3.6-35b-a3b: Gated DeltaNet + gated attention) add to their
roofline the recurrent state each decode step reads and writes (conv inputs and delta-rule
matrices, the same at any context), and their KV counts only the attention layers. --context
measures batch-1 decode after long prompts beside a dense shape of about the same size
(bench/long_context.py).

    python bench/latency.py [--shape llama3-8b] [--prompt 512] [--output 256] [--no-hf]
                            [--quantization none fp8 int8 int4 int4-g32 q4_k_m]
                            [--context 32768 131072 [--dense qwen3-32b] [--device cpu]]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gguf_shape
from common import (
    SHAPES,
    WEIGHT_FORMATS,
    _time_cuda,
    bytes_per_token,
    header,
    insitu_method,
    kv_bytes_per_token,
    measure_batch1,
    measure_ceilings,
    param_count,
    start_engine,
    table,
    write_shape_folder,
)
from kvship.kernels import gpt_oss_moe, mxfp4_gemv
from kvship.kernels.fused_moe import fused_moe, fused_moe_torch, moe_config
from kvship.layers.moe import route
from moe_sweep import random_mxfp4_experts


def kvship_latency(folder: str, prompt_len: int, out_len: int, eager: bool, quantization: str | None = None
                   ) -> tuple[float, float, float | None, int, int]:
    """(TTFT s, decode tok/s, with graphs: tok/s of replaying the batch-1 decode graph back to
    back, the GPU's own time per token with no host work at all, weight bytes per token, and
    recurrent-state bytes per token). ``folder``: a shape folder, or a .gguf file."""
    llm = start_engine(folder, prompt_len + out_len + 16, eager, quantization)
    ttft, rate = measure_batch1(llm, prompt_len, out_len)
    graphs = llm.engine.runner.graphs
    replay = None
    if graphs is not None:  # its buffers still hold the last request's final decode step
        replay = 1 / _time_cuda(graphs.graphs[1].replay, iters=100)
    nbytes, state = bytes_per_token(llm)
    del llm
    torch.cuda.empty_cache()
    return ttft, rate, replay, nbytes, state


def hf_latency(shape: str, prompt_len: int, out_len: int) -> float:
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(2, cfg.vocab_size, (1, prompt_len), device="cuda")
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
    torch.cuda.synchronize()
    t0 = time.monotonic()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    dt = time.monotonic() - t0
    del model
    torch.cuda.empty_cache()
    return out_len / dt


def bytes_read_per_token(shape: str) -> dict[str, int]:
    """16-bit weight bytes one batch-1 decode step reads, by part. Dense shapes: every parameter
    (param_count, as the other benchmarks count). With experts (routed in every layer, as in the
    shapes here): each layer's attention, norms and router, the k experts a token picks, and the
    output projection; the input embedding gives one row, left out."""
    c = SHAPES[shape]
    if c.get("linear_num_value_heads"):  # hybrids: param_count's, less the input embedding
        experts = f" ({c['num_experts_per_tok']} of {c['num_experts']} experts)" if c.get("num_experts") else ""
        return {f"weights{experts}": 2 * (param_count(shape) - c["vocab_size"] * c["hidden_size"])}
    if not c.get("num_experts"):
        return {"weights": 2 * param_count(shape)}
    h, layers, e, k = c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    attn = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * d + 2 * h  # + q/k, layer norms
    return {"attention + norms": 2 * layers * attn, "router": 2 * layers * e * h,
            f"experts ({k} of {e})": 2 * layers * k * 3 * h * c["moe_intermediate_size"],
            "lm_head + final norm": 2 * (c["vocab_size"] * h + h)}


def _graph_time(fn, iters: int = 200) -> float:
    """Seconds per replay of fn captured in a CUDA graph: the GPU's time, no launch overhead."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_cuda(graph.replay, iters=iters)


@torch.inference_mode()
def moe_layer_rows(shape: str, bw: float, token_counts=(1, 4, 16, 64)) -> list[list[str]]:
    """One MoE layer of the shape (random bf16 weights) per token count: the fused path replayed
    in a CUDA graph against the bytes of the distinct experts its tokens pick, and the torch path."""
    c = SHAPES[shape]
    e, k, h, inter = c["num_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*dims):
        return torch.randn(*dims, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02

    router, w13, w2 = randn(e, h), randn(e, 2 * inter, h), randn(e, h, inter)
    rows = []
    for t in token_counts:
        x = randn(t, h) * 50

        def layer(experts=fused_moe):
            return experts(x, w13, w2, *route(x @ router.T, k, c.get("norm_topk_prob", False)))

        fused = _graph_time(layer)
        eager = _time_cuda(lambda: layer(fused_moe_torch), iters=20)  # its host sync forbids a graph
        distinct = route(x @ router.T, k, False)[1].unique().numel()
        nbytes = distinct * 3 * h * inter * 2
        rows.append([str(t), str(distinct), f"{nbytes / 1e6:.1f}", f"{fused * 1e6:.1f}",
                     f"{nbytes / fused / 1e9:.0f}", f"{100 * nbytes / fused / bw:.0f}%", f"{eager * 1e6:.1f}"])
    return rows


def is_mxfp4(shape: str) -> bool:
    return (SHAPES[shape].get("quantization_config") or {}).get("quant_method") == "mxfp4"


@torch.inference_mode()
def mxfp4_moe_rows(shape: str, bw: float, token_counts=(1, 4, 16, 64)) -> list[list[str]]:
    """One gpt-oss MoE layer (random MXFP4 experts, bf16 router) per token count, the engine's path
    (kernels/mxfp4_gemv.py for few tokens) and the grouped GEMMs, each replayed in a CUDA graph
    cycling 3 layers' experts (past L2), against the bytes of the distinct experts its tokens pick
    (codes and scales)."""
    c = SHAPES[shape]
    e, k, h, inter = c["num_local_experts"], c["num_experts_per_tok"], c["hidden_size"], c["intermediate_size"]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [random_mxfp4_experts(e, h, inter, g) for _ in range(3)]
    router = torch.randn(e, h, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    per_expert = 3 * h * inter // 2 + 3 * h * inter // 32
    rows = []
    for t in token_counts:
        x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)

        def layer(config=None):
            for ex in layers:
                gpt_oss_moe.gpt_oss_moe_triton(x, ex, *route(x @ router.T, k, True), config)

        engine = _graph_time(layer) / len(layers)
        grouped = _graph_time(lambda: layer(moe_config(t, k, e))) / len(layers)
        distinct = route(x @ router.T, k, True)[1].unique().numel()
        nbytes = distinct * per_expert
        path = "gemv" if mxfp4_gemv.gemv_settings(t) else "grouped"
        rows.append([str(t), str(distinct), f"{nbytes / 1e6:.1f}", path, f"{engine * 1e6:.1f}",
                     f"{nbytes / engine / 1e9:.0f}", f"{100 * nbytes / engine / bw:.0f}%", f"{grouped * 1e6:.1f}"])
    return rows


def use_settings(settings: list) -> None:
    """Put [shape key, setting] pairs into the kernels' per-shape tables (the engine runs in this
    process): 16-bit GEMV settings for (N, K) keys (gemv_sweep.py --best-json); quantized ones
    (quant_gemv_sweep.py --best-json): pairs-kernel settings for one row, mma-kernel ones for 2 to 8 rows;
    "mxfp4_gemv": gpt-oss's few-token MXFP4 table (moe_sweep.py --mxfp4 --best-json)."""
    from kvship.kernels import gemv, quant_linear

    for key, cfg in settings:
        if key == "mxfp4_gemv":  # moe_sweep.py --mxfp4 --best-json: the whole few-token table
            mxfp4_gemv.MXFP4_GEMV = tuple(tuple(entry) for entry in cfg)
            print(f"MXFP4_GEMV: {mxfp4_gemv.MXFP4_GEMV}", file=sys.stderr)
            continue
        if len(key) == 2:
            table_ = gemv.GEMV_SHAPES
        else:
            table_ = quant_linear.MMA_GEMV_SHAPES if "mma" in cfg else quant_linear.PAIRS_GEMV_SHAPES
        table_[tuple(key)] = cfg
        print(f"setting {tuple(key)}: {cfg}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--quantization", nargs="+", choices=["none", *WEIGHT_FORMATS, "q4_k_m"],
                    help="weight formats to compare (graphs only), instead of the bf16 graphs/eager/HF table; "
                         "int4-g32: in-situ int4 in groups of 32 with offsets, the layout GGUF Q4_K blocks load into; "
                         "q4_k_m: a GGUF file of the shape with Q4_K_M's tensor types (bench/gguf_shape.py)")
    ap.add_argument("--settings", nargs="+", help="one-row and small-batch GEMV settings per weight to try (the JSONs "
                                                  "of bench/quant_gemv_sweep.py, gemv_sweep.py or moe_sweep.py --mxfp4 "
                                                  "--best-json), over the engine's own")
    ap.add_argument("--context", type=int, nargs="+",
                    help="batch-1 decode after a prompt of each of these lengths (bench/long_context.py), beside "
                         "--dense's shape at the same context")
    ap.add_argument("--dense", default="qwen3-32b", choices=["none", *sorted(SHAPES)],
                    help="with --context: the shape to compare with (none: only --shape)")
    ap.add_argument("--device", default="cuda", help="with --context: cpu runs the same path (tiny shapes)")
    args = ap.parse_args()
    for path in args.settings or []:
        use_settings(json.loads(Path(path).read_text()))
    if args.context:
        from long_context import compare_contexts  # it builds its engines with start_engine above

        return compare_contexts(args)
    if args.quantization:
        return compare_formats(args)
    bw, mm = measure_ceilings()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, tmp)
        ttft_g, rate_g, replay, loaded_bytes, state = kvship_latency(folder, args.prompt, args.output, eager=False)
        ttft_e, rate_e, _, _, _ = kvship_latency(folder, args.prompt, args.output, eager=True)
    mxfp4 = is_mxfp4(args.shape)
    parts = {"weights as loaded (k experts in MXFP4)": loaded_bytes} if mxfp4 else bytes_read_per_token(args.shape)
    if state:
        parts["recurrent state read + written"] = state
    weight_bytes = sum(parts.values())
    avg_ctx = args.prompt + args.output / 2
    roofline = bw / (weight_bytes + avg_ctx * kv_bytes_per_token(args.shape))
    rows = [
        ["kvship (CUDA graphs)", f"{rate_g:.1f}", f"{100 * rate_g / roofline:.0f}%", f"{ttft_g * 1e3:.1f}"],
        ["kvship decode graph replayed alone (GPU only, no sampling or host work)", f"{replay:.1f}",
         f"{100 * replay / roofline:.0f}%", "-"],
        ["kvship (eager)", f"{rate_e:.1f}", f"{100 * rate_e / roofline:.0f}%", f"{ttft_e * 1e3:.1f}"],
    ]
    if not args.no_hf and not mxfp4:
        hf = hf_latency(args.shape, args.prompt, args.output)
        rows.append(["HF transformers generate (eager)", f"{hf:.1f}", f"{100 * hf / roofline:.0f}%", "-"])
    rows.append(["roofline (bytes / copy BW)", f"{roofline:.1f}", "100%", "-"])
    weights = "bf16, experts MXFP4" if mxfp4 else "bf16"
    print(header(f"Batch-1 latency, {args.shape} shape, {weights}, prompt {args.prompt}, output {args.output}"))
    read = ", ".join(f"{name} {n / 1e9:.3f} GB" for name, n in parts.items())
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; weights read per token: {read}; "
          f"KV at the average context {avg_ctx * kv_bytes_per_token(args.shape) / 1e6:.0f} MB\n")
    print(table(rows, ["engine", "decode tok/s", "of roofline", "TTFT ms"]))
    if mxfp4:
        print(f"\nOne MXFP4 MoE layer (router + experts, {args.shape}), GPU time per call; bytes: the distinct "
              "experts its tokens pick (codes + scales)\n")
        print(table(mxfp4_moe_rows(args.shape, bw), ["tokens", "experts read", "MB", "path", "us (graph)", "GB/s",
                                                     "of copy BW", "grouped GEMMs us"]))
    elif SHAPES[args.shape].get("num_experts"):
        print(f"\nOne MoE layer (router + experts, {args.shape}), GPU time per call; bytes: the distinct "
              "experts its tokens pick\n")
        print(table(moe_layer_rows(args.shape, bw), ["tokens", "experts read", "MB", "fused us (graph)", "GB/s",
                                                     "of copy BW", "torch path us"]))


def compare_formats(args) -> None:
    bw, mm = measure_ceilings()
    kv = (args.prompt + args.output / 2) * kv_bytes_per_token(args.shape)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, tmp)
        for q in args.quantization:
            if q == "q4_k_m":  # a GGUF file of the shape in that file type's tensor types, random blocks
                source, method = str(gguf_shape.write(args.shape, Path(tmp) / f"{args.shape}-Q4_K_M.gguf")), None
            else:  # in-situ from the same random 16-bit weights
                source, method = folder, insitu_method(q)
            ttft, rate, replay, nbytes, state = kvship_latency(source, args.prompt, args.output, eager=False,
                                                               quantization=method)
            roof = bw / (nbytes + kv + state)
            rows.append([q if q != "none" else "bf16", f"{nbytes / 1e9:.2f}", f"{rate:.1f}", f"{replay:.1f}",
                         f"{roof:.1f}", f"{100 * rate / roof:.0f}%", f"{ttft * 1e3:.1f}"])
    print(header(f"Batch-1 latency by weight format, {args.shape} shape, CUDA graphs, prompt {args.prompt}, "
                 f"output {args.output}"))
    state_note = f" + {state / 1e6:.0f} MB of recurrent state read and written" if state else ""
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; roofline = copy bandwidth / (weight bytes read per token + "
          f"{kv / 1e6:.0f} MB of KV{state_note})\n")
    print(table(rows, ["weights", "GB read/token", "decode tok/s", "graph replay tok/s", "roofline tok/s",
                       "of roofline", "TTFT ms"]))


if __name__ == "__main__":
    main()
