"""The paged decode-attention kernel alone, per KV-cache layout (16-bit, FP8, int4), over a grid
of launch settings: Llama-3-8B's attention (32 query heads, 8 KV heads, head size 128, block
size 16), batch 32 at 8k-token contexts (the KV-bound decode of bench/kv_decode.py), then the
best settings of each layout at batch 1 / 32k and batch 128 / 2k. Each setting is first checked
against the torch reference on two sequences, then timed from a CUDA graph (CUDA events, after
warm-up, random pages). % BW = the layout's bytes (codes and scales of every key and value
read, the queries and outputs) ÷ time ÷ copy bandwidth measured in the same run.

Quantized layouts run each page read (kernels/tuning/attention.py DECODE_CONFIGS' "packed") over a grid of
settings: as stored (False), "packed" (FP8 converted to fp16 in the registers it was loaded into,
int4 codes and group words loaded whole and unpacked two codes an instruction:
paged_attention._load_kv), FP8 "values" (values packed, keys as stored) and int4 "split" (packed,
left as even and odd channels, two dots each). Reads that lost clearly at 1206f4e (FP8 as stored
and packed, int4 as stored) get a narrow grid, the contenders a wide one: about 100 settings,
about 4 minutes on the H200. The last table puts the best of each side by side, against the best
16-bit setting (tokens/s scale as 1 / us at a fixed batch).

    python bench/kv_attention_sweep.py [--quick] [--layouts fp8,int4] [--mixed 256 512]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import kv_quant as kvq
from kvship.kernels import paged_attention as pa

HQ, HKV, D, BS = 32, 8, 128, 16
LAYOUTS = {"bf16": "auto", "fp8": "fp8", "int4": "int4"}


def make_case(batch: int, ctx: int, kv: str, seed: int = 0, lens: torch.Tensor | None = None):
    """Queries and a paged cache in ``kv``'s layout (random values, blocks in a random order);
    every sequence ``ctx`` tokens long, or ``lens`` (each at most ctx)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = batch * -(-ctx // BS)
    table_ = torch.randperm(blocks, device="cuda", generator=g).view(batch, -1).to(torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        if kv == "auto":
            caches.append(x)
            scales.append(None)
        elif kv == "int4" and not caches:  # keys: per block and channel
            packed = torch.empty(*x.shape[:-1], D // 2, dtype=torch.uint8, device="cuda")
            per_block = torch.empty(blocks, HKV, D, 2, dtype=kvq.SCALE_DTYPE, device="cuda")
            kvq.int4_store_keys(x.flatten(0, 1), packed, per_block, torch.arange(blocks * BS, device="cuda"))
            caches.append(packed)
            scales.append(per_block)
        elif kv == "int4":
            packed, groups = kvq.int4_quantize(x)
            caches.append(packed)
            scales.append(groups)
        else:
            s = torch.tensor([0.02], device="cuda")
            caches.append(kvq.fp8_quantize(x, s, kvq.FP8_DTYPES[kv]))
            scales.append(s)
        del x
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32) if lens is None else lens.cuda().int()
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    return q, caches, scales, table_, seq_lens, cu


def case_bytes(batch: int, ctx: int, kv: str, tokens: int | None = None) -> int:
    """tokens: the batch's context tokens where lengths differ (default batch x ctx)."""
    per_token_head = kvq.bytes_per_block_head(kv, D, torch.bfloat16, BS) / BS  # keys and values
    tokens = batch * ctx if tokens is None else tokens
    return int(tokens * HKV * per_token_head) + 2 * batch * HQ * D * 2


def mixed(layouts: dict, batches: list[int], bw: float) -> None:
    """Offline throughput's decode step (bench/throughput.py: contexts spread over [100, 2048]) at
    each batch, over the split target ("waves"): at 256 rows the default runs one program per
    sequence and KV head, whose lengths then differ twentyfold."""
    rows = []
    for name, kv in layouts.items():
        for batch in batches:
            lens = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(batch))
            case = make_case(batch, 2048, kv, lens=lens)
            nbytes = case_bytes(batch, 2048, kv, tokens=int(lens.sum()))
            default = pa.DECODE_CONFIGS[kvq.kv_mode(case[1][0])]
            us_default, _ = run(case, default)
            for waves in (4, 8, 16, 32, 64):
                cfg = {**default, "waves": waves}
                splits = pa.decode_num_splits(batch, HKV, 2048, pa.device_sms(case[0]), cfg["block_n"], cfg)
                us, err = run(case, cfg)
                rows.append([name, f"B={batch} ctx U[100, 2048]", setting(cfg), str(splits), f"{us:.1f}",
                             f"{100 * nbytes / (us * 1e-6) / bw:.0f}%", f"{us_default / us:.2f}x", f"{err:.1e}"])
            del case
            torch.cuda.empty_cache()
    print(table(rows, ["KV", "case", "setting", "splits", "us", "% BW", "vs default", "rel err"]))


def run(case, cfg: dict | None) -> tuple[float, float]:
    """(microseconds per call, relative error against the reference on the first two sequences)."""
    q, (kc, vc), (ks, vs), bt, sl, cu = case
    out = torch.empty_like(q)

    def call(_i: int = 0):
        pa.paged_attention_triton(q, kc, vc, bt, sl, cu, D**-0.5, 1, out=out, k_scale=ks, v_scale=vs,
                                  decode_config=cfg)

    call()
    ref = pa.paged_attention_torch(q[:2], kc, vc, bt[:2], sl[:2], cu[:3], D**-0.5, ks, vs)
    err = ((out[:2].double() - ref.double()).norm() / ref.double().norm()).item()
    return time_per_call(call, 4), err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few settings per layout")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    ap.add_argument("--mixed", type=int, nargs="+", metavar="BATCH",
                    help="only offline throughput's decode step at these batches, over the split target")
    args = ap.parse_args()
    layouts = {name: LAYOUTS[name] for name in args.layouts.split(",")}
    bw, _ = measure_ceilings()
    if args.mixed:
        print(header("Paged decode attention, contexts U[100, 2048], by split target (8B attention)"))
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
        return mixed(layouts, args.mixed, bw)
    # stages: 2 to 4 keep one buffer per tile, 5 two, 7 three (kernels/tuning/attention.py DECODE_CONFIGS)
    wide = list(itertools.product([64, 128], [4, 8], [2, 3, 5])) + [(64, 4, 7), (32, 4, 5)]
    narrow = [(64, 4, 2), (128, 4, 3), (128, 4, 2), (64, 4, 5)]
    plain = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 3), (128, 8, 3), (64, 4, 5)]
    # (page read, grid) per layout; the H200 sweep at 1206f4e: bf16 best at (64, 4, 2), FP8 as
    # stored 227.9 us and packed 240.4 us against 190.5 us for packed values, int4 as stored 686.1 us
    reads = {"auto": [(False, plain)], "fp8": [(False, narrow), (True, narrow), ("values", wide)],
             "int4": [(False, narrow), (True, wide), ("split", wide)]}
    if args.quick:
        reads = {kv: [(packed, [(64, 4, 2), (128, 4, 3), (64, 4, 5)]) for packed, _ in r] for kv, r in reads.items()}
        # int4 keys are scaled per 16-token block: a tile of two blocks reads fewer scale rows (the H200,
        # 2026-12-04: 317 us split, against 226 at 128 tokens; tiles of 16 tokens are refused, below)
        reads["int4"] = [(packed, grid + [(32, 4, 3)]) for packed, grid in reads["int4"]]
    print(header("Paged decode attention by KV layout and launch setting (8B attention, block size 16)"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
    rows, best, sides = [], {}, []
    for name, kv in layouts.items():
        case = make_case(32, 8000, kv)
        nbytes = case_bytes(32, 8000, kv)
        default = pa.DECODE_CONFIGS[kvq.kv_mode(case[1][0])]
        results = []
        for packed, grid in reads.get(kv, reads["fp8"]):
            for block_n, warps, stages in grid:
                for waves in (4, 8):
                    cfg = {**default, "block_n": block_n, "num_warps": warps, "num_stages": stages, "waves": waves,
                           "packed": packed}
                    try:
                        us, err = run(case, cfg)
                    except Exception as e:  # out of shared memory, say
                        print(f"{name} {cfg}: {type(e).__name__}", file=sys.stderr, flush=True)
                        continue
                    results.append((us, cfg, err))
                    print(f"{name} {setting(cfg)}: {us:.1f} us err {err:.1e}", file=sys.stderr, flush=True)
        results.sort(key=lambda r: r[0])
        us_default, _ = run(case, default)
        for us, cfg, err in results[:4]:
            rows.append([name, "B=32 ctx=8000", setting(cfg), f"{us:.1f}", f"{100 * nbytes / (us * 1e-6) / bw:.0f}%",
                         f"{us_default / us:.2f}x", f"{err:.1e}"])
        for packed in dict.fromkeys(r[1].get("packed", False) for r in results):
            us, cfg, err = next(r for r in results if r[1].get("packed", False) == packed)
            sides.append((name, us, cfg, err, nbytes))
        best[name] = []  # the two fastest, and the fastest of each page read
        for cfg in [r[1] for r in results[:2]] + [side[2] for side in sides if side[0] == name]:
            if cfg not in best[name]:
                best[name].append(cfg)
        del case
        torch.cuda.empty_cache()
    for name, kv in layouts.items():
        for batch, ctx in [(1, 32768), (128, 2048)]:
            case = make_case(batch, ctx, kv)
            nbytes = case_bytes(batch, ctx, kv)
            default = pa.DECODE_CONFIGS[kvq.kv_mode(case[1][0])]
            us_default, _ = run(case, default)
            for cfg in best[name]:
                us, err = run(case, cfg)
                rows.append([name, f"B={batch} ctx={ctx}", setting(cfg), f"{us:.1f}",
                             f"{100 * nbytes / (us * 1e-6) / bw:.0f}%", f"{us_default / us:.2f}x", f"{err:.1e}"])
            del case
            torch.cuda.empty_cache()
    print(table(rows, ["KV", "case", "setting", "us", "% BW", "vs default", "rel err"]))
    bf16 = next((us for name, us, *_ in sides if name == "bf16"), None)
    print("\nBest per page read, B=32 ctx=8000 (targets: fp8 >= 1.35x bf16, int4 >= 1.6x):")
    read_names = {False: "as stored", True: "packed", "values": "packed values", "split": "packed split"}
    print(table([[name, read_names[cfg.get("packed", False)], setting(cfg), f"{us:.1f}",
                  f"{100 * nbytes / (us * 1e-6) / bw:.0f}%", f"{bf16 / us:.2f}x" if bf16 else "-", f"{err:.1e}"]
                 for name, us, cfg, err, nbytes in sides],
                ["KV", "page read", "setting", "us", "% BW", "vs bf16", "rel err"]))
    print(f"\ndefaults: {pa.DECODE_CONFIGS}")


def setting(cfg: dict) -> str:
    return (f"bn={cfg['block_n']} w={cfg['num_warps']} s={cfg['num_stages']} waves={cfg['waves']}"
            + {False: "", True: " packed", "values": " packed=values", "split": " packed=split"}[cfg.get("packed", False)])


if __name__ == "__main__":
    main()
