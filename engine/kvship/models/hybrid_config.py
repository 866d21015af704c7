"""Hyper-parameters of the hybrid Gated DeltaNet + gated attention families (Qwen3-Next,
Qwen3.5, Qwen3.5-MoE), read by ModelConfig.from_hf."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers' shapes, and which layers are full attention."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    full_attention_layers: frozenset[int]
    rotary_dim: int  # of each full-attention head (the rest of the head is not rotated)

    def is_linear(self, layer: int) -> bool:
        return layer not in self.full_attention_layers

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A ...ForConditionalGeneration config's language model, with the keys it inherits from
    the outer config (architectures, tied embeddings)."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        keep = ("architectures", "tie_word_embeddings", "quantization_config")
        cfg = {**{k: v for k, v in cfg.items() if k in keep}, **inner}
    # Qwen3.5-MoE has no dense feed-forward, nor its size
    return {"intermediate_size": cfg.get("moe_intermediate_size", 0), **cfg}


def partial_rotary(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters") or {}  # transformers' rotary reads it here first
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))


def hybrid_fields(arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """ModelConfig's fields for a hybrid family: its linear attention, and its experts (Qwen3-Next
    as Qwen2-MoE with a shared expert; Qwen3.5-MoE routes every layer, always renormalized)."""
    if arch not in HYBRID:
        return {}
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % cfg.get("full_attention_interval", 4)
                                       else "full_attention" for i in range(n)]
    rotary = int(head_dim * partial_rotary(cfg))
    linear = LinearAttention(cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32),
                             cfg.get("linear_key_head_dim", 128), cfg.get("linear_value_head_dim", 128),
                             cfg.get("linear_conv_kernel_dim", 4),
                             frozenset(i for i, t in enumerate(types) if t == "full_attention"), rotary)
    mtp = cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0  # Qwen3.5's, Qwen3-Next's
    fields: dict[str, Any] = dict(linear_attention=linear, mtp_layers=int(mtp))
    experts = cfg.get("num_experts") or 0
    if arch != "qwen3_5" and experts:
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or []) if arch == "qwen3_next" else set()
        fields.update(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                      moe_intermediate_size=cfg["moe_intermediate_size"],
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if arch == "qwen3_next" else True,
                      shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
                      sparse_layers=frozenset(i for i in range(n) if i not in dense and (i + 1) % step == 0))
    return fields
