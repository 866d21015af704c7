"""Where a quantized KV cache's perplexity cost comes from, and what other layouts would cost:
the bundled SmolLM2-135M on the CPU, float32, the six windows of tests/engine/test_kv_quant_engine.py
(transformers' Apache-2.0 text, two windows of 1,024 tokens; numpy's LICENSE.txt, four).

Each variant quantizes and dequantizes the keys and the values (each its own way) on their way
into a float32 cache, at the one call every layer's store goes through on the CPU (rotary.py's
``store_kv_torch``); attention then reads them back as the engine's kernels would read the
quantized cache. So the layouts compared need no kernels: the engine's own (fp8 with the keys
turned by R at the scales an fp8 engine measures per layer at start-up; int4 keys per channel
over 16-token blocks, KIVI's layout, and values in groups of 32 channels of a token) against one
FP8 scale for every layer (1.0, as before; 2^-6), int4 keys in groups of 32 channels (as before
2026-12-03) or of 16, smoothed per channel first (calibrated on another window of numpy's text
or on random tokens; the engine's of 2026-12-03 to 12-04 measured on 256 random tokens), in
symmetric codes, groups whose range is clipped for the least squared error, and the parts of
each error (keys alone, values alone).

    python3 bench/kv_quality.py                    # every variant (45 s each on 2 cores)
    python3 bench/kv_quality.py "int4" "int4, keys per block, growing"
"""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import time

import torch

from kvship.kernels import kv_quant as kvq
from kvship.kernels import rotary
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams

WINDOW = 1024
TEXTS = [("transformers", "licenses/LICENSE", range(2)), ("numpy", "LICENSE.txt", range(4))]
CALIBRATION = ("numpy", "LICENSE.txt", 5)  # a window the perplexity does not read
BLOCK = 16  # tokens per per-channel key group: the engine's block size


def fp8(x, scale=1.0):
    return kvq.fp8_quantize(x, torch.tensor(scale), torch.float8_e4m3fn).float() * scale


def int4(x, group: int = kvq.INT4_GROUP):
    """Asymmetric 4-bit codes per `group` channels of a vector (the engine's values' at 32)."""
    if group == kvq.INT4_GROUP:
        packed, groups = kvq.int4_quantize(x)
        return kvq.int4_dequantize(packed, groups, x.shape[-1])
    xg = x.unflatten(-1, (-1, group))
    return _codes(xg, xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)).flatten(-2)


def _codes(x, lo, hi):
    """x quantized to 16 levels between lo and hi (float16 scale and minimum, as the engine's)."""
    s, z = ((hi - lo) / kvq.INT4_LEVELS).half().float(), lo.half().float()
    return torch.where(s > 0, torch.floor((x - z) / s + 0.5), 0.0).clamp(0, kvq.INT4_LEVELS) * s + z


def int4_clipped(x, shrinks=(0.0, 0.04, 0.08, 0.12, 0.16, 0.2, 0.25, 0.3)):
    """int4 in groups of 32 channels whose range is shrunk from both ends by the fraction (of
    those tried) that gives each group its smallest squared error; values past it clip."""
    g = kvq.INT4_GROUP
    xg = x.unflatten(-1, (-1, g))
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    best, best_err = None, None
    for c in shrinks:
        cut = (hi - lo) * c / 2
        q = _codes(xg, lo + cut, hi - cut)
        err = (q - xg).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, best_err = q, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, q, best), torch.minimum(err, best_err)
    return best.flatten(-2)


def int4_symmetric(x, group: int = kvq.INT4_GROUP):
    """4-bit codes -8..7 per `group` channels around 0, one float16 scale a group (half the
    group bytes of the asymmetric codes): the largest magnitude maps to 8 on its side."""
    xg = x.unflatten(-1, (-1, group))
    amax = xg.abs().amax(-1, keepdim=True)
    s = (amax / 8).half().float()
    q = torch.where(s > 0, torch.round(xg / s).clamp(-8, 7), 0.0) * s
    return q.flatten(-2)


def int4_blocks(k):
    """Keys [T, H, D] per channel over each run of BLOCK tokens (a whole prefill block at once)."""
    t = k.shape[0]
    n = -(-t // BLOCK)
    g = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, n * BLOCK - t)).unflatten(0, (n, BLOCK))
    last = g[-1, :t - (n - 1) * BLOCK]  # a short last block: its own tokens' range
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    lo[-1], hi[-1] = last.amin(0), last.amax(0)
    return _codes(g, lo, hi).flatten(0, 1)[:t]


def int4_blocks_growing(k):
    """As int4_blocks, with a block's tokens arriving one at a time (decode): each token that
    widens a channel's range re-quantizes that channel's stored (dequantized) values to it."""
    out = []
    for b0 in range(0, k.shape[0], BLOCK):
        block = k[b0:b0 + BLOCK]
        lo, hi = block[0].clone(), block[0].clone()
        stored = _codes(block[:1], lo, hi)
        for row in block[1:]:
            lo2, hi2 = torch.minimum(lo, row), torch.maximum(hi, row)
            stored = torch.where((lo2 != lo) | (hi2 != hi), _codes(stored, lo2, hi2), stored)
            lo, hi = lo2, hi2
            stored = torch.cat([stored, _codes(row[None], lo, hi)])
        out.append(stored)
    return torch.cat(out)


class Variants:
    """name -> (keys, values): functions of (x [T, H, D] float32, layer index)."""

    def __init__(self, head_dim: int):
        self.r = kvq.key_rotation(head_dim, torch.device("cpu"))
        # per calibration ("text": a window of numpy's text, "random": 256 seeded random tokens,
        # "random1024": 1,024 of them) and layer, [H, D]: (max + min) / 2, and max - min over its mean
        calibrations = ("text", "random", "random1024")
        self.centre: dict[str, dict[int, torch.Tensor]] = {on: {} for on in calibrations}
        self.spread: dict[str, dict[int, torch.Tensor]] = {on: {} for on in calibrations}
        self.v_amax: dict[int, float] = {}  # per layer: calibrated, values' largest magnitude
        self.engine: dict[int, tuple[float, float]] = {}  # per layer: the fp8 engine's (k, v) scales

    def turned(self, f):
        return lambda x, layer: f(x @ self.r, layer) @ self.r.T

    def fp8_engine(self, which: int):
        """FP8 at the engine's own scale for this layer (0: keys', 1: values')."""
        return lambda x, layer: fp8(x, self.engine[layer][which])

    def fp8_measured(self, headroom: float):
        """Values at a scale from their calibrated largest magnitude, `headroom` below the top."""
        return lambda x, layer: fp8(x, self.v_amax[layer] * headroom / kvq.fp8_max(torch.float8_e4m3fn))

    def smoothed(self, power: float = 1.0, centre: bool = True, on: str = "text", turn: bool = False, quant=None):
        quant = quant or int4

        def keys(x, layer):
            c = self.centre[on][layer] if centre else 0.0
            s = self.spread[on][layer] ** power if power else 1.0
            y = (x - c) / s
            if turn:
                return (quant(y @ self.r) @ self.r.T) * s + c
            return quant(y) * s + c
        return keys

    def table(self):
        same = lambda x, layer: x  # noqa: E731
        whole = lambda f: lambda x, layer: f(x)  # noqa: E731
        keys, values = self.fp8_engine(0), self.fp8_engine(1)
        return {
            "auto": (same, same),
            "fp8": (self.turned(keys), values),
            "fp8, keys alone": (self.turned(keys), same),
            "fp8, values alone": (same, values),
            "fp8, values turned too": (self.turned(keys), self.turned(values)),
            "fp8, scales 1.0": (self.turned(whole(fp8)), whole(fp8)),
            "fp8, scales 1.0, keys alone": (self.turned(whole(fp8)), same),
            "fp8, scales 1.0, values alone": (same, whole(fp8)),
            "fp8, values alone, one scale 2^-6": (same, whole(lambda x: fp8(x, 2.0**-6))),
            **{f"fp8, values alone, calibrated, headroom {h}": (same, self.fp8_measured(h)) for h in (1, 16, 64)},
            "int4": (whole(int4_blocks), whole(int4)),
            "int4, keys in groups of 32": (whole(int4), whole(int4)),
            "int4, keys alone, unsmoothed": (whole(int4), same),
            "int4, values alone": (same, whole(int4)),
            "int4, both turned by R": (self.turned(whole(int4)), self.turned(whole(int4))),
            "int4, keys in groups of 16": (whole(lambda x: int4(x, 16)), whole(int4)),
            "int4, keys per block, growing": (whole(int4_blocks_growing), whole(int4)),
            "int4, keys smoothed": (self.smoothed(), whole(int4)),
            "int4, keys smoothed by sqrt": (self.smoothed(0.5), whole(int4)),
            "int4, keys centred": (self.smoothed(0.0), whole(int4)),
            "int4, keys smoothed on random tokens": (self.smoothed(on="random"), whole(int4)),
            "int4, keys smoothed by sqrt on random tokens": (self.smoothed(0.5, on="random"), whole(int4)),
            "int4, keys centred on random tokens": (self.smoothed(0.0, on="random"), whole(int4)),
            "int4, keys centred and turned by R": (self.smoothed(0.0, turn=True), whole(int4)),
            "int4, keys centred on random tokens, turned by R": (self.smoothed(0.0, on="random", turn=True),
                                                                whole(int4)),
            "int4, keys smoothed on random tokens, turned by R": (self.smoothed(on="random", turn=True), whole(int4)),
            "int4, keys smoothed on 1024 random tokens": (self.smoothed(on="random1024"), whole(int4)),
            "int4, each group's range clipped for its least squared error": (
                self.smoothed(on="random", quant=int4_clipped), whole(int4_clipped)),
            "int4, keys smoothed, in groups of 16": (self.smoothed(on="random", quant=lambda y: int4(y, 16)),
                                                     whole(int4)),
            "int4, keys smoothed, symmetric codes": (self.smoothed(on="random", quant=int4_symmetric), whole(int4)),
            "int4, keys smoothed, symmetric codes in groups of 16": (
                self.smoothed(on="random", quant=lambda y: int4_symmetric(y, 16)), whole(int4)),
            "int4, keys' groups clipped": (self.smoothed(on="random", quant=int4_clipped), whole(int4)),
            "int4, values' groups clipped": (self.smoothed(on="random"), whole(int4_clipped)),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", help="names from the table (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(device="cpu", kv_cache_dtype="auto", num_kv_blocks=160)
    tok = llm.engine.tokenizer
    windows = []
    for dist, path, which in TEXTS:
        ids = tok.encode(importlib.metadata.distribution(dist).read_text(path))
        windows += [ids[i * WINDOW:(i + 1) * WINDOW] for i in which]
    dist, path, i = CALIBRATION
    calibration = tok.encode(importlib.metadata.distribution(dist).read_text(path))[i * WINDOW:(i + 1) * WINDOW]
    assert len(calibration) == WINDOW

    def nll(ids) -> float:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
        return -sum(c.logprob for c, _ in out.prompt_logprobs) / (len(ids) - 1)

    variants = Variants(llm.engine.runner.model.attention_layers()[0].head_dim)
    table = variants.table()
    names = args.variants or list(table)
    unknown = set(names) - set(table)
    if unknown:
        sys.exit(f"unknown variants {sorted(unknown)}; known: {list(table)}")
    layers: dict[int, int] = {}  # the cache tensor's id -> layer index, in order of first store
    seen: dict[int, list] = {}
    current = {"kv": table["auto"], "record": False}
    store = rotary.store_kv_torch

    def quantized_store(k, v, k_cache, v_cache, slots, k_scale=None, v_scale=None, k_transform=None):
        layer = layers.setdefault(id(k_cache), len(layers))
        k, v = k.float(), v.float()
        if current["record"]:
            seen.setdefault(layer, []).append((k, v))
        fk, fv = current["kv"]
        return store(fk(k, layer), fv(v, layer), k_cache, v_cache, slots, k_scale, v_scale, k_transform)

    rotary.store_kv_torch = quantized_store
    vocab = llm.engine.runner.model_config.vocab_size
    random_ids = torch.randint(0, vocab, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    for on, ids in (("text", calibration), ("random", random_ids[:256]), ("random1024", random_ids)):
        seen.clear()
        current["record"] = True
        nll(ids)
        current["record"] = False
        for layer, kvs in seen.items():
            k, v = torch.cat([k for k, _ in kvs]), torch.cat([v for _, v in kvs])
            hi, lo = k.amax(0), k.amin(0)
            variants.centre[on][layer] = (hi + lo) / 2
            spread = (hi - lo).clamp_min(1e-6)
            variants.spread[on][layer] = spread / spread.mean(-1, keepdim=True)
            if on == "text":
                variants.v_amax[layer] = float(v.abs().amax())
    fp8_layers = LLM(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16).engine.runner.model.attention_layers()
    variants.engine = {i: (float(a.fp8_k_scale), float(a.fp8_v_scale)) for i, a in enumerate(fp8_layers)}

    print(f"SmolLM2-135M perplexity, {len(windows)} windows of {WINDOW} tokens, keys and values quantized "
          f"and dequantized into a float32 cache\n")
    print("| keys, values | perplexity | vs auto | windows, vs auto |\n|---|---|---|---|")
    base = None
    for name in ["auto", *(n for n in names if n != "auto")]:
        current["kv"] = table[name]
        t0 = time.monotonic()
        per = [nll(w) for w in windows]
        base = base or per
        ppl, ref = math.exp(sum(per) / len(per)), math.exp(sum(base) / len(base))
        by_window = " ".join(f"{100 * (math.exp(a - b) - 1):+.1f}%" for a, b in zip(per, base))
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / ref - 1):+.2f}% | {by_window} |", flush=True)
        print(f"{name}: {time.monotonic() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
