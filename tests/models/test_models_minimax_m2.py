"""MiniMax-M2 (minimax_m2) against transformers on tiny random checkpoints: q/k RMSNorm over all
heads at once, rotary on part of each head, every layer's experts chosen by sigmoid score plus
a bias and renormalized. Logits in fp32 (batched, in chunks over the cached prefix), greedy
tokens through the engine (batched, chunked prefill, a prefix hit, preemption); tensor parallelism and
unsupported settings refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from kvship.models.config import ModelConfig, UnsupportedModelError
from routed_family_cases import (
    assert_greedy_batched_chunked_cached,
    assert_preemption_changes_nothing,
    make_routed_models,
    prompts,
)
from test_models import DEVICES, assert_logits_match

pytestmark = pytest.mark.timeout(300)

MINIMAX = {
    "half-rotary": ("MiniMaxM2Config", dict(num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                            num_experts_per_tok=3,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5})),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_routed_models(tmp_path_factory.mktemp("minimax"), MINIMAX)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers(models, device):
    folder, ref = models["half-rotary"]
    assert_logits_match(folder, ref, prompts(1), device, chunks=(None, 7))


def test_greedy_matches_transformers_batched_chunked_and_cached(models):
    assert_greedy_batched_chunked_cached(*models["half-rotary"])


def test_preempted_sequences_give_the_same_tokens(models):
    assert_preemption_changes_nothing(*models["half-rotary"])


def test_hub_config_reads_rotary_dim():
    """MiniMax-M2's config.json names its rotary channels (rotary_dim) and routing switches."""
    cfg = ModelConfig.from_hf(dict(
        architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", hidden_size=3072, intermediate_size=1536,
        num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128, vocab_size=200064,
        rotary_dim=64, num_local_experts=256, num_experts_per_tok=8, scoring_func="sigmoid", use_routing_bias=True,
        qk_norm_type="per_layer", shared_intermediate_size=0, rope_theta=5000000))
    assert (cfg.architecture, cfg.rotary_dim, cfg.moe_intermediate_size, cfg.moe_groups) == ("minimax_m2", 64, 1536, (1, 1))
    assert cfg.sparse_layers == frozenset(range(62)) and cfg.norm_topk_prob and cfg.moe_scoring == "sigmoid"


@pytest.mark.parametrize("key,value", [("scoring_func", "softmax"), ("shared_intermediate_size", 512),
                                       ("qk_norm_type", "per_head")])
def test_unsupported_settings_are_refused(key, value):
    cfg = dict(architectures=["MiniMaxM2ForCausalLM"], hidden_size=64, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=320, num_local_experts=4, num_experts_per_tok=2, **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf(cfg)


def test_tensor_parallelism_is_refused(models):
    from kvship.models.registry import model_class
    from kvship.parallel import TPContext

    cfg = ModelConfig.from_hf(json.loads((models["half-rotary"][0] / "config.json").read_text()))
    tp = TPContext(rank=0, size=2)
    with torch.device("meta"), pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        model_class(cfg)(cfg, 64, tp, "torch")
