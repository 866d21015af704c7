"""Start-up time: from process start to /health 200 for a model saved to local disk (random
weights of a real shape, written as sharded safetensors), next to the time HF transformers'
from_pretrained takes to put the same checkpoint on the GPU, and the disk-read floor
(checkpoint bytes / measured sequential read rate of those files).

    python bench/startup.py [--shape llama3-8b] [--dir /tmp/kvship-startup] [--quantization none fp8]

Each --quantization value starts the server once over the same 16-bit checkpoint (fp8: in-situ
quantization while loading).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, table, write_shape_folder
from serve import free_port, popen_logged, wait_ready


def write_checkpoint(shape: str, root: str, shard_bytes: int = 4 << 30) -> str:
    """HF-named random bf16 tensors in safetensors shards with an index, as save_pretrained writes."""
    import transformers
    from safetensors.torch import save_file

    folder = write_shape_folder(shape, root)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator(device="cuda").manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shp in shapes.items():
        current[name] = torch.randn(shp, generator=g, device="cuda", dtype=torch.bfloat16).mul_(0.02).cpu()
        size += current[name].numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in shard}
    Path(folder, "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def read_rate(folder: str) -> tuple[float, int]:
    total, t0 = 0, time.monotonic()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total / (time.monotonic() - t0), total


def serve_start(folder: str, quantization: str) -> float:
    """Seconds from process start to /health 200, checked by one completion."""
    port = free_port()
    extra = [] if quantization == "none" else ["--quantization", quantization]
    t0 = time.monotonic()
    proc = popen_logged([sys.executable, "-m", "kvship.cli", "serve", folder, "--host", "127.0.0.1",
                         "--port", str(port), *extra])
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        took = time.monotonic() - t0
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                        json={"prompt": [5, 6, 7], "max_tokens": 4, "model": Path(folder).name}, timeout=60)
        ok.raise_for_status()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="/tmp/kvship-startup")
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "fp8", "int8", "int4"])
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    folder = write_checkpoint(args.shape, args.dir)
    os.system("sync")
    starts = {q: serve_start(folder, q) for q in args.quantization}
    import transformers

    t0 = time.monotonic()
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
    torch.cuda.synchronize()
    hf = time.monotonic() - t0
    del m
    rate, nbytes = read_rate(folder)  # files are in the page cache by now: a floor, not a cold read
    print(header(f"Start-up, {args.shape} shape, {nbytes / 1e9:.1f} GB safetensors on local disk"))
    rows = [[f"kvship serve{'' if q == 'none' else ' --quantization ' + q}: process start -> /health 200 "
             "(incl. KV sizing, CUDA graphs)", f"{t:.1f}"] for q, t in starts.items()]
    rows += [["HF transformers from_pretrained to GPU (weights only)", f"{hf:.1f}"],
             [f"read floor: bytes / cached read rate ({rate / 1e9:.1f} GB/s)", f"{nbytes / rate:.1f}"]]
    print(table(rows, ["what", "seconds"]))


if __name__ == "__main__":
    main()
