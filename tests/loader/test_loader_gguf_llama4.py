"""Llama 4 GGUF files ("llama4") in llama.cpp's layout: a tiny random transformers model written
here as llama.cpp's converter writes it, then served by kvship and compared with transformers.

The converter's layout: q/k rows as HF has them (undo_permute False), the dense layers' size as
feed_forward_length and the experts' as expert_feed_forward_length, the experts stacked
(ffn_*_exps, gate and up split), the shared expert *_shexp, the norm before the feed-forward
ffn_norm, and llama3 rope scaling as a rope_freqs tensor of per-frequency divisors. The tiny
model takes the values llama.cpp fixes for the architecture: chunks of 8192, every fourth layer
position-free, temperature floor 8192 and scale 0.1, q/k norms (not 128 experts)."""
from __future__ import annotations

import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvship.loader import resolve_model
from test_loader_gguf_moe import PROMPTS, _check_against, dense_metadata, layer_tensors, write_tensors_and_close
from test_models_llama4 import make_tiny_llama4

pytestmark = pytest.mark.timeout(300)

ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SPEC = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, max_position_embeddings=256, eos_token_id=319,
            bos_token_id=0, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, intermediate_size=32,
            intermediate_size_mlp=96, num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=8192,
            no_rope_layer_interval=4, floor_scale=8192, attn_scale=0.1, rope_parameters=ROPE)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
          "feed_forward.router": "ffn_gate_inp", "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
          "feed_forward.shared_expert.up_proj": "ffn_up_shexp", "feed_forward.shared_expert.down_proj": "ffn_down_shexp"}


def _rope_freqs(head_dim: int) -> np.ndarray:
    """llama.cpp's converter's llama3 factors: each frequency's divisor."""
    base, factor = ROPE["rope_theta"], ROPE["factor"]
    low, high, old = ROPE["low_freq_factor"], ROPE["high_freq_factor"], ROPE["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    out = {"rope_freqs.weight": _rope_freqs(model.config.head_dim)}
    for blk, rest, w in layer_tensors(model, out):
        if rest == "feed_forward.experts.gate_up_proj":  # [E, H, 2I] (x @ W): to [E, I, H] gate and up
            gate, up = np.split(w, 2, axis=2)
            out[blk + "ffn_gate_exps.weight"] = np.ascontiguousarray(gate.transpose(0, 2, 1))
            out[blk + "ffn_up_exps.weight"] = np.ascontiguousarray(up.transpose(0, 2, 1))
        elif rest == "feed_forward.experts.down_proj":  # [E, I, H] -> [E, H, I]
            out[blk + "ffn_down_exps.weight"] = np.ascontiguousarray(w.transpose(0, 2, 1))
        else:
            part, kind = rest.rsplit(".", 1)
            out[f"{blk}{_LAYER[part]}.{kind}"] = w
    return out


@pytest.fixture(scope="module")
def llama4_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4-gguf")
    model = make_tiny_llama4(root / "hf", SPEC)
    w = gguf.GGUFWriter(str(root / "tiny-llama4.gguf"), "llama4")
    dense_metadata(w, type("C", (), {**model.config.to_dict(), "intermediate_size": 96})())
    w.add_rope_freq_base(ROPE["rope_theta"])
    w.add_interleave_moe_layer_step(2)
    w.add_expert_feed_forward_length(32)
    w.add_expert_count(4)
    w.add_expert_used_count(1)
    write_tensors_and_close(w, _gguf_tensors(model))
    return root / "tiny-llama4.gguf", model


def test_llama4_gguf_matches_transformers(llama4_file):
    path, ref = llama4_file
    c = resolve_model(str(path)).hf_config
    assert (c["model_type"], c["intermediate_size"], c["intermediate_size_mlp"]) == ("llama4_text", 32, 96)
    assert c["moe_layers"] == [1, 3] and c["no_rope_layers"] == [1, 1, 1, 0] and c["use_qk_norm"]
    assert c["rope_scaling"]["rope_type"] == "factors" and len(c["rope_scaling"]["factors"]) == 8
    _check_against(ref, path, PROMPTS)
