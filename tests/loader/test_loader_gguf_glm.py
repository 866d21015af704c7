"""GLM-4.5 GGUF files ("glm4moe") in llama.cpp's layout: a tiny random transformers model written
here as llama.cpp's converter writes it, then served by kvship and compared with transformers on
the same weights.

The converter's layout: block_count counts the MTP layer (nextn_predict_layers, last), stored as
a decoder block with nextn.* tensors beside it; the norm after attention is post_attention_norm,
the shared expert *_shexp, the router's bias exp_probs_b.bias, the experts stacked; q and k rows
as HF has them (NEOX rope); rope.dimension_count the rotated part of each head."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import make_tiny_model
from kvship.loader import resolve_model
from routed_family_cases import sharpen_and_save
from test_loader_gguf_moe import (
    PROMPTS,
    _check_against,
    dense_metadata,
    layer_tensors,
    routed_expert_tensor,
    routed_metadata,
    write_tensors_and_close,
)
from test_models_glm4_moe import GLM

pytestmark = pytest.mark.timeout(300)

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, and an MTP block after its last layer (the
    last layer's tensors shifted, plus the nextn.* ones)."""
    out = {}
    for blk, rest, w in layer_tensors(model, out):
        if not routed_expert_tensor(out, blk, rest, w):
            part, kind = rest.rsplit(".", 1)
            out[f"{blk}{_LAYER[part]}.{kind}"] = w
    n, h = model.config.num_hidden_layers, model.config.hidden_size
    last = f"blk.{n - 1}."
    out.update({f"blk.{n}." + k[len(last):]: v + 0.25 for k, v in list(out.items()) if k.startswith(last)})
    rng = np.random.default_rng(7)
    for name, shape in (("eh_proj", (h, 2 * h)), ("enorm", (h,)), ("hnorm", (h,)), ("shared_head_norm", (h,)),
                        ("embed_tokens", (model.config.vocab_size, h)),
                        ("shared_head_head", (model.config.vocab_size, h))):
        out[f"blk.{n}.nextn.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
    return out


def write_glm_gguf(path, model, tensors: dict[str, np.ndarray]) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "glm4moe")
    dense_metadata(w, SimpleNamespace(**{**vars(cfg), "num_hidden_layers": cfg.num_hidden_layers + 1}))
    w.add_nextn_predict_layers(1)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    routed_metadata(w, cfg)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.n_group > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    write_tensors_and_close(w, tensors)


@pytest.fixture(scope="module")
def glm_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-gguf")
    model = make_tiny_model(root / "hf", "glm4.5", seed=5, spec=GLM["glm4.5"])
    sharpen_and_save(model, root / "hf")
    tensors = _gguf_tensors(model)
    path = root / "tiny-glm.gguf"
    write_glm_gguf(path, model, tensors)
    return path, model, tensors


def test_glm_gguf_matches_transformers(glm_file):
    path, ref, _ = glm_file
    c = resolve_model(str(path)).hf_config
    assert (c["model_type"], c["num_hidden_layers"], c["num_nextn_predict_layers"]) == ("glm4_moe", 2, 1)
    assert c["partial_rotary_factor"] == 0.5 and c["use_qk_norm"] and c["attention_bias"]
    assert (c["n_group"], c["topk_group"], c["scoring_func"]) == (4, 2, "sigmoid")
    _check_against(ref, path, PROMPTS)


def test_mtp_layer_is_kept_from_the_file(glm_file):
    from kvship.llm import LLM

    path, _, tensors = glm_file
    llm = LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=16, block_size=4, max_model_len=32)
    mtp = llm.engine.runner.model.model.mtp[0]
    torch.testing.assert_close(mtp.eh_proj.weight, torch.tensor(tensors["blk.2.nextn.eh_proj.weight"]))
    torch.testing.assert_close(mtp.shared_head.norm.weight, torch.tensor(tensors["blk.2.nextn.shared_head_norm.weight"]))
    torch.testing.assert_close(mtp.input_layernorm.weight, torch.tensor(tensors["blk.2.attn_norm.weight"]))
