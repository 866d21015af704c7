"""Llama 4 GGUF files (llama.cpp's ``llama4``): the HF config keys their metadata gives.

llama.cpp's converter keeps Llama 4's q/k rows as HF has them (no permutation), names the
dense layers' size feed_forward_length and the experts' expert_feed_forward_length, and writes
llama3 rope scaling as a ``rope_freqs`` tensor (each frequency's divisor), kept here as rope
scaling of type "factors". What llama.cpp does not store it fixes for the architecture, and so
does this reader: chunks of 8192 on three of every four layers (the fourth position-free),
temperature tuning with floor 8192 and scale 0.1, and q/k norms except on the 128-expert model
(Maverick)."""
from __future__ import annotations

_CHUNK, _NOPE_EVERY, _FLOOR, _TEMP_SCALE = 8192, 4, 8192, 0.1
_NO_QK_NORM_EXPERTS = 128


def llama4_config(meta: dict, tensors: dict, cfg: dict) -> dict:
    p = "llama4."
    n = cfg["num_hidden_layers"]
    experts = int(meta[p + "expert_count"])
    out = {
        "intermediate_size": int(meta[p + "expert_feed_forward_length"]),
        "intermediate_size_mlp": cfg["intermediate_size"],
        "num_local_experts": experts,
        "num_experts_per_tok": int(meta[p + "expert_used_count"]),
        "moe_layers": [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in tensors],
        "no_rope_layers": [int((i + 1) % _NOPE_EVERY != 0) for i in range(n)],
        "attention_chunk_size": _CHUNK,
        "attn_temperature_tuning": True, "floor_scale": _FLOOR, "attn_scale": _TEMP_SCALE,
        "use_qk_norm": experts != _NO_QK_NORM_EXPERTS,
    }
    freqs = tensors.get("rope_freqs.weight")
    if freqs is not None:
        out["rope_scaling"] = {"rope_type": "factors", "factors": freqs.load(None).flatten().tolist()}
    return out
