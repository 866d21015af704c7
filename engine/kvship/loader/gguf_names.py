"""GGUF (llama.cpp) tensor names -> Hugging Face parameter names for the Llama block, and where
Gemma 2 / 3, Phi-3, DeepSeek and the hybrid Qwen3-Next / Qwen3.5 name theirs otherwise."""
from __future__ import annotations

import re

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Where a family's layer tensors differ: Gemma's four norms a layer (llama.cpp's ffn_norm is the
# norm before the MLP, the Llama block's post-attention norm), Phi-3's fused q/k/v and gate/up
# matrices (split by the model's loader, models/llama.py).
_ARCH_LAYER = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER["gemma3"] = _ARCH_LAYER["gemma2"]
# DeepSeek-V2/V3 ("deepseek2"): the attention's low-rank projections and their norms, kv_b_proj in
# files from before llama.cpp split it (newer ones: attn_k_b and attn_v_b, joined by the loader),
# and the shared experts, "shared_experts" in HF's DeepSeek where Qwen2-MoE's is "shared_expert".
_ARCH_LAYER["deepseek2"] = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# The hybrid Gated DeltaNet families (loader/gguf_hybrid.py): Qwen3.5's HF names for the DeltaNet
# projections (Qwen3-Next's in_proj_qkvz is stored as Qwen3.5's in_proj_qkv and in_proj_z), and the
# norm after attention, which these files name post_attention_norm.
_ARCH_LAYER["qwen35"] = {
    "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_ARCH_LAYER["qwen35moe"] = _ARCH_LAYER["qwen3next"] = _ARCH_LAYER["qwen35"]
# gpt-oss: the norm after attention, the per-head sinks and the router (its experts: loader/gguf_gpt_oss.py)
_ARCH_LAYER["gpt-oss"] = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                          "ffn_gate_inp": "mlp.router"}

# GLM-4 MoE: the norm after attention, DeepSeek's shared experts, and the MTP layer's own tensors
# (nextn.*; its copies of the embedding and head are dropped by models/glm4_moe.py)
_ARCH_LAYER["glm4moe"] = {
    "post_attention_norm": "post_attention_layernorm", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm", "nextn.embed_tokens": "embed_tokens",
    "nextn.shared_head_head": "shared_head.head",
}

# Tensors llama.cpp stores that carry no parameter of their own (e.g. llama-3 rope factors,
# which the config's rope scaling already describes).
SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_BLK = re.compile(r"^blk\.(\d+)\.([a-z0-9_.]+)\.(weight|bias)$")  # "." in GLM's nextn.* names
_PLAIN = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


def arch_layer_name(arch: str, part: str) -> str | None:
    """A family's own HF name for a layer tensor's llama.cpp name (``part``: "ffn_up_shexp"), if it
    has one: it takes precedence over the shared tables."""
    return _ARCH_LAYER.get(arch, {}).get(part)


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name for a GGUF tensor name of an ``arch`` file, or None when the tensor has no HF
    counterpart."""
    if name in SKIPPED:
        return None
    m = _BLK.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = arch_layer_name(arch, part) or _LAYER.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    m = _PLAIN.match(name)
    if m:
        part, kind = m.groups()
        hf = _TOP.get(part)
        return None if hf is None else f"{hf}.{kind}"
    return None
