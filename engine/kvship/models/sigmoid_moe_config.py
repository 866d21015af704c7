"""Hyper-parameters of the families whose experts are chosen by sigmoid scores: GLM-4.5/4.6/4.7
(glm4_moe: DeepSeek-V3's router with a correction bias, in groups, beside a shared expert), read
by ModelConfig.from_hf. What their model files do not run is refused here by name."""
from __future__ import annotations

from typing import Any

PARTIAL_ROTARY = ("glm4_moe",)  # families whose heads may rotate only in part


def sigmoid_moe_fields(arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    if arch == "glm4_moe":
        return _glm4_moe(cfg, head_dim)
    return {}


def _refuse(name: str, cfg: dict[str, Any], wants: tuple[tuple[str, Any], ...]) -> None:
    from kvship.models.config import UnsupportedModelError  # config.py imports this module

    for key, want in wants:
        if cfg.get(key, want) != want:
            raise UnsupportedModelError(f"{name} with {key}={cfg[key]!r} is not supported ({want!r} is)")


def _glm4_moe(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Dense feed-forward on the first first_k_dense_replace layers, then routed experts; a key
    config.json leaves out takes transformers' default (Glm4MoeConfig: half of each head rotates)."""
    _refuse("GLM-4 MoE", cfg, (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")))
    rope = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
    n, experts = cfg["num_hidden_layers"], cfg.get("n_routed_experts", 128)
    first_dense = cfg.get("first_k_dense_replace", 1) or 0
    inter = cfg.get("moe_intermediate_size", 1408)
    mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0)
    return dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
                moe_intermediate_size=inter, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                shared_experts_intermediate_size=inter * (cfg.get("n_shared_experts", 1) or 0),
                sparse_layers=frozenset(range(first_dense, n + mtp)),  # the MTP layers' blocks are routed too
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                moe_groups=(cfg.get("n_group", 1) or 1, cfg.get("topk_group", 1) or 1), moe_scoring="sigmoid",
                rotary_dim=int(head_dim * partial),
                mtp_layers=mtp)
