"""Hyper-parameters of the families whose experts are chosen by sigmoid scores, read by
ModelConfig.from_hf: GLM-4.5/4.6/4.7 (glm4_moe: DeepSeek-V3's router with a correction bias, in
groups, beside a shared expert), Llama 4 (llama4: top-1 scaling the expert's input, chunked
local attention, position-free global layers) and MiniMax-M2 (minimax_m2: top-k with a bias). What their model files do not run is refused
here by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvship.models.errors import UnsupportedModelError

PARTIAL_ROTARY = ("glm4_moe", "minimax_m2")  # families whose heads may rotate only in part


def sigmoid_moe_fields(arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    if arch == "glm4_moe":
        return _glm4_moe(cfg, head_dim)
    if arch == "llama4":
        return _llama4(cfg)
    if arch == "minimax_m2":
        return _minimax_m2(cfg, head_dim)
    return {}


def _refuse(name: str, cfg: dict[str, Any], wants: tuple[tuple[str, Any], ...]) -> None:

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


@dataclass(frozen=True)
class Llama4Layers:
    """Llama 4's per-layer attention and feed-forward switches."""

    rope_layers: frozenset[int]  # the others are position-free (NoPE) and see the whole context
    chunk: int | None  # attention_chunk_size: a rotary layer's query sees keys of its own chunk only
    l2_qk_norm: bool  # q and k of the rotary layers RMS-normed without a weight (use_qk_norm)
    temperature: tuple[float, float] | None  # NoPE queries times 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
    dense_intermediate_size: int  # intermediate_size_mlp: the dense layers' MLP


def _llama4(cfg: dict[str, Any]) -> dict[str, Any]:
    """Routed layers every interleave_moe_layer_step (moe_layers where written), top-1 by a
    sigmoid score that scales the expert's input, beside a shared expert; defaults as
    transformers' Llama4TextConfig."""
    _refuse("Llama 4", cfg, (("hidden_act", "silu"), ("num_experts_per_tok", 1), ("attention_bias", False)))
    n = cfg["num_hidden_layers"]
    step = cfg.get("interleave_moe_layer_step", 1) or 1
    moe = cfg.get("moe_layers")
    moe = list(range(step - 1, n, step)) if moe is None else moe
    nope = cfg.get("no_rope_layers")  # 1: the layer rotates (transformers' naming)
    if not nope:
        interval = cfg.get("no_rope_layer_interval", 4)
        nope = [int((i + 1) % interval != 0) for i in range(n)]
    temperature = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1))) \
        if cfg.get("attn_temperature_tuning", True) else None
    layers = Llama4Layers(frozenset(i for i in range(n) if nope[i]), cfg.get("attention_chunk_size") or None,
                          bool(cfg.get("use_qk_norm", True)), temperature, cfg.get("intermediate_size_mlp", 16384))
    return dict(num_experts=cfg.get("num_local_experts", 16), num_experts_per_tok=1,
                moe_intermediate_size=cfg["intermediate_size"], sparse_layers=frozenset(moe), llama4=layers)


def _minimax_m2(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Every layer routed (experts intermediate_size wide), top-k by sigmoid score plus a bias,
    renormalized, no shared expert; rotary_dim channels of each head rotate."""
    _refuse("MiniMax-M2", cfg, (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("use_routing_bias", True),
                                ("shared_intermediate_size", 0), ("qk_norm_type", "per_layer"),
                                ("attention_bias", False)))
    rope = cfg.get("rope_parameters") or {}
    rotary = cfg.get("rotary_dim") or int(head_dim * cfg.get("partial_rotary_factor",
                                                               rope.get("partial_rotary_factor", 1.0)))
    n = cfg["num_hidden_layers"]
    return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                sparse_layers=frozenset(range(n)), moe_groups=(1, 1), moe_scoring="sigmoid", rotary_dim=rotary)
