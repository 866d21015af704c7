"""GLM-4.5/4.6/4.7 (glm4_moe) against transformers on tiny random checkpoints: partial rotary, q/k/v
biases, optional q/k norms, a leading dense layer, sigmoid routing with a correction bias in
groups and a shared expert. Logits in fp32 (batched, in chunks over the cached prefix), greedy
tokens through the engine (batched, chunked prefill, a prefix hit, preemption); the MTP layer's
tensors loaded and kept; what the family does not run refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from kvship.models.config import ModelConfig, UnsupportedModelError
from kvship.sampling_params import SamplingParams
from routed_family_cases import (
    assert_greedy_batched_chunked_cached,
    assert_preemption_changes_nothing,
    make_routed_models,
    prompts,
)
from test_models import DEVICES, assert_logits_match

pytestmark = pytest.mark.timeout(300)

BASE = dict(num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=24,
            first_k_dense_replace=1, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=1.5,
            norm_topk_prob=True)
GLM = {
    # GLM-4.5's switches: q/k norms, attention biases, half of each head rotated
    "glm4.5": ("Glm4MoeConfig", BASE | dict(use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)),
    # GLM-4.5-Air's: no q/k norm, a quarter rotated, weights not renormalized, one group
    "air-quarter": ("Glm4MoeConfig", BASE | dict(use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.25,
                                                 n_group=1, topk_group=1, norm_topk_prob=False)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_routed_models(tmp_path_factory.mktemp("glm"), GLM)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(GLM))
def test_logits_match_transformers(models, arch, device):
    folder, ref = models[arch]
    assert_logits_match(folder, ref, prompts(1), device, chunks=(None, 7))


@pytest.mark.parametrize("arch", list(GLM))
def test_greedy_matches_transformers_batched_chunked_and_cached(models, arch):
    assert_greedy_batched_chunked_cached(*models[arch])


def test_preempted_sequences_give_the_same_tokens(models):
    assert_preemption_changes_nothing(*models["glm4.5"])


def test_mtp_layer_is_loaded_and_kept(models, tmp_path, caplog):
    """A checkpoint with GLM's MTP layer (layer num_hidden_layers: enorm, hnorm, eh_proj,
    shared_head, a routed decoder block, and copies of the embedding and head): its tensors land
    in ``model.mtp`` as stored, the copies are dropped, the outputs do not change."""
    import logging

    from safetensors.torch import load_file, save_file

    from kvship.llm import LLM

    folder, _ = models["glm4.5"]
    tensors = load_file(folder / "model.safetensors")
    mtp = {k.replace("layers.1.", "layers.2.", 1): v.clone() + 0.25 for k, v in tensors.items() if ".layers.1." in k}
    g = torch.Generator().manual_seed(5)
    extra = {"enorm.weight": (64,), "hnorm.weight": (64,), "eh_proj.weight": (64, 128),
             "shared_head.norm.weight": (64,), "embed_tokens.weight": (320, 64), "shared_head.head.weight": (320, 64)}
    mtp |= {f"model.layers.2.{k}": torch.randn(*s, generator=g) for k, s in extra.items()}
    (tmp_path / "m").mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / f).write_bytes((folder / f).read_bytes())
    save_file(tensors | mtp, tmp_path / "m" / "model.safetensors")
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = prompts(6)[1]
    with caplog.at_level(logging.INFO, logger="kvship.models.glm4_moe"):
        llm = LLM(str(tmp_path / "m"), device="cpu", dtype="float32", num_kv_blocks=32, block_size=4,
                  max_model_len=64)
    assert "multi-token-prediction" in caplog.text
    model = llm.engine.runner.model
    layer = model.model.mtp[0]
    torch.testing.assert_close(layer.eh_proj.weight, mtp["model.layers.2.eh_proj.weight"])
    torch.testing.assert_close(layer.shared_head.norm.weight, mtp["model.layers.2.shared_head.norm.weight"])
    torch.testing.assert_close(layer.mlp.gate.e_score_correction_bias,
                               mtp["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert not any(n.startswith("model.mtp.0.embed_tokens") for n, _ in model.named_parameters())
    plain = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64)
    assert len(plain.engine.runner.model.model.mtp) == 0  # none stored: none kept
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == \
        plain.generate([prompt], params)[0].outputs[0].token_ids
    # the layer drafts (models/mtp.py, core/mtp.py): the same greedy tokens
    spec = LLM(str(tmp_path / "m"), device="cpu", dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert spec.generate([prompt], params)[0].outputs[0].token_ids == \
        plain.generate([prompt], params)[0].outputs[0].token_ids
    assert spec.engine.speculator.stats.num_draft_tokens > 0


def test_glm45_air_config():
    """GLM-4.5-Air's config.json (the fields kvship reads)."""
    cfg = ModelConfig.from_hf(dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=4096, intermediate_size=10944,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
        partial_rotary_factor=0.5, rope_theta=1000000, attention_bias=True, use_qk_norm=False,
        first_k_dense_replace=1, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
        moe_intermediate_size=1408, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        num_nextn_predict_layers=1, rms_norm_eps=1e-5, eos_token_id=[151329, 151336, 151338]))
    assert (cfg.architecture, cfg.rotary_dim, cfg.qk_norm, cfg.attention_bias) == ("glm4_moe", 64, False, True)
    assert cfg.sparse_layers == frozenset(range(1, 47)) and cfg.moe_scoring == "sigmoid"
    assert cfg.shared_experts_intermediate_size == 1408 and cfg.moe_groups == (1, 1) and cfg.mtp_layers == 1


@pytest.mark.parametrize("key,value", [("hidden_act", "gelu"), ("scoring_func", "softmax")])
def test_unsupported_settings_are_refused(key, value):
    cfg = dict(architectures=["Glm4MoeForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=320, **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf(cfg)
