"""Random weights (load_format="dummy") that do not depend on the tensor-parallel size.

The single-rank runner draws each parameter in turn from one seeded generator. Here every rank
draws the same full-size tensors in the same order (as the single-rank model's parameters) and
keeps its own slice through the layers' weight loaders, so a model sharded over N ranks holds
exactly the weights the single-rank model would: TP=N and TP=1 outputs can be compared."""
from __future__ import annotations

import torch

from kvship.distributed.parallel import SINGLE
from kvship.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from kvship.loader.source import WeightRef, apply_slices
from kvship.models.registry import model_class


def _ref(t: torch.Tensor) -> WeightRef:
    return WeightRef(t.shape, t.dtype, lambda slices: apply_slices(t, slices))


@torch.no_grad()
def load_dummy_weights(runner, hf_config: dict) -> None:
    """Fill runner.model (a tensor-parallel shard) with the single-rank dummy weights' slices."""
    with torch.device("meta"):
        full = model_class(hf_config)(runner.model_config, runner.max_model_len, SINGLE, runner.backend)
    modules = dict(full.named_modules())
    g = torch.Generator(device=runner.device).manual_seed(runner.config.seed)

    def weights():
        for name, p in full.named_parameters():
            if "norm" in name:
                t = torch.ones(p.shape, dtype=runner.dtype, device=runner.device)
            else:
                t = torch.empty(p.shape, dtype=runner.dtype, device=runner.device).normal_(0.0, 0.02, generator=g)
            mod_name, _, leaf = name.rpartition(".")
            mod = modules[mod_name]
            if isinstance(mod, QKVParallelLinear):
                q, kv = mod.num_heads * mod.head_dim, mod.num_kv_heads * mod.head_dim
                base = mod_name.rpartition(".")[0]
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    yield f"{base}.{part}.{leaf}", _ref(piece)
            elif isinstance(mod, MergedColumnParallelLinear):
                base = mod_name.rpartition(".")[0]
                for part, piece in zip(("gate_proj", "up_proj"), t.split(mod.out_sizes)):
                    yield f"{base}.{part}.{leaf}", _ref(piece)
            else:
                yield name, _ref(t)
            del t

    runner.model.load_weights(weights())
