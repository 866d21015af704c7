"""GLM-4.5/4.6/4.7 GGUF files (llama.cpp's ``glm4moe``): the HF config keys their metadata gives.

llama.cpp's converter counts the MTP layer in block_count (nextn_predict_layers of them, last)
and stores it as a decoder block plus ``nextn.*`` tensors (gguf_names.py maps them onto the
checkpoint's names, which models/glm4_moe.py keeps in ``model.mtp``). The router is DeepSeek-V3's
(expert_gating_func 2: sigmoid, exp_probs_b its correction bias); rope.dimension_count gives the
rotated part of each head; q/k norms are there where their tensors are."""
from __future__ import annotations

_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def glm4moe_config(meta: dict, tensor_names: set[str], cfg: dict) -> dict:
    p = "glm4moe."
    nextn = int(meta.get(p + "nextn_predict_layers") or 0)
    gating = int(meta.get(p + "expert_gating_func") or _SIGMOID)
    return {
        "num_hidden_layers": int(meta[p + "block_count"]) - nextn,
        "num_nextn_predict_layers": nextn,
        "partial_rotary_factor": int(meta.get(p + "rope.dimension_count") or cfg["head_dim"] // 2) / cfg["head_dim"],
        "use_qk_norm": any(n.endswith("attn_q_norm.weight") for n in tensor_names),
        "first_k_dense_replace": int(meta.get(p + "leading_dense_block_count") or 0),
        "n_routed_experts": int(meta[p + "expert_count"]),
        "num_experts_per_tok": int(meta[p + "expert_used_count"]),
        "n_shared_experts": int(meta.get(p + "expert_shared_count") or 0),
        "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
        "routed_scaling_factor": float(meta.get(p + "expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", True)),
        "n_group": int(meta.get(p + "expert_group_count") or 1),
        "topk_group": int(meta.get(p + "expert_group_used_count") or 1),
        "scoring_func": "sigmoid" if gating == _SIGMOID else "softmax",  # softmax: refused by name
    }
