"""Random weights (load_format="dummy", for benchmarks of model shapes without checkpoints)
that do not depend on the tensor-parallel size.

Every rank draws the same full-size tensors, in the order of the single-rank model's
parameters, from one seeded generator (never zero: kernels see realistic data; norms are 1),
names them as a checkpoint would, and keeps its own slice through the layers' weight loaders
like any checkpoint: a model sharded over N ranks holds exactly the weights the single-rank
model would, so TP=N and TP=1 outputs can be compared."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from kvship.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from kvship.layers.moe import MoEExperts
from kvship.loader.source import WeightRef, apply_slices
from kvship.models.config import ModelConfig
from kvship.parallel import SINGLE


def _ref(t: torch.Tensor) -> WeightRef:
    return WeightRef(t.shape, t.dtype, lambda slices: apply_slices(t, slices))


@torch.no_grad()
def dummy_weights(build, model_config: ModelConfig, max_model_len: int, backend: str, seed: int,
                  dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, WeightRef]]:
    """(checkpoint name, tensor) for the single-rank model ``build(...)`` would make."""
    with torch.device("meta"):  # the 16-bit model's tensors (in-situ quantization takes them as loaded)
        full = build(dataclasses.replace(model_config, quantization=None), max_model_len, SINGLE, backend)
    modules = dict(full.named_modules())
    g = torch.Generator(device=device).manual_seed(seed)

    def weights():
        for name, p in full.named_parameters():
            mod_name, _, leaf = name.rpartition(".")
            mod = modules[mod_name]
            if hasattr(mod, "dummy_checkpoint"):  # a layer that names and draws its checkpoint's tensors itself
                if leaf == next(iter(dict(mod.named_parameters()))):  # once, at its first parameter
                    yield from mod.dummy_checkpoint(mod_name, g, dtype, device)
                continue
            if "norm" in name:
                t = torch.ones(p.shape, dtype=dtype, device=device)
            else:
                t = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=g)
            if isinstance(mod, QKVParallelLinear):
                q, kv = mod.num_heads * mod.head_dim, mod.num_kv_heads * mod.head_dim
                base = mod_name.rpartition(".")[0]
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    yield f"{base}.{part}.{leaf}", _ref(piece)
            elif isinstance(mod, MoEExperts):  # stacked experts: one checkpoint matrix per expert and part
                parts = ("gate_proj", "up_proj") if leaf == "w13" else ("down_proj",)
                for e in range(mod.num_experts):
                    pieces = t[e].split(mod.intermediate) if leaf == "w13" else (t[e],)
                    for part, piece in zip(parts, pieces):
                        # a copy: the loader still holds the last matrix it took while the next stack
                        # is drawn, and a view would keep this whole stack on the device beside it
                        yield f"{mod_name}.{e}.{part}.weight", _ref(piece.clone())
            elif isinstance(mod, MergedColumnParallelLinear):
                base = mod_name.rpartition(".")[0]
                parts = getattr(mod, "checkpoint_parts", ("gate_proj", "up_proj"))  # (Gated DeltaNet's in_proj)
                for part, piece in zip(parts, t.split(mod.out_sizes)):
                    yield f"{base}.{part}.{leaf}", _ref(piece)
            else:
                yield name, _ref(t)
            t = pieces = piece = None  # and its views: freed before the next one is drawn

    return weights()
