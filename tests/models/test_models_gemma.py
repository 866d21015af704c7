"""Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints, with prompts
longer than the sliding window so that the local layers' window matters: logits in fp32
(batched, and in chunks), greedy tokens through the engine (batched with other requests,
chunked prefill), TP=2 equal to TP=1; Mistral's window applied by the attention layers."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from kvship.models.config import ModelConfig, UnsupportedModelError
from test_models import DEVICES, assert_greedy_matches, assert_logits_match

WINDOW = 8
GEMMA = {
    # local, global (layer_types written by transformers); both soft caps small enough to bite
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=WINDOW, attn_logit_softcapping=0.3, final_logit_softcapping=1.0)),
    # a local and a global layer with rope bases of their own, the global one linearly scaled
    "gemma3": ("Gemma3TextConfig", dict(
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=4.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # one window over every layer, the Llama block
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    models = {name: (root / name, make_tiny_model(root / name, name, spec=spec)) for name, spec in GEMMA.items()}
    for _, ref in models.values():  # transformers' SDPA path drops Gemma 2's score cap; eager applies it
        ref.set_attn_implementation("eager")
    return models


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 319, (n,), generator=g).tolist() for n in (5, 17, 45)]


@pytest.mark.parametrize("device", DEVICES)  # on a GPU: the Triton kernels, windows inside their tiles
@pytest.mark.parametrize("arch", list(GEMMA))
def test_logits_match_transformers(models, arch, device):
    folder, ref = models[arch]
    assert_logits_match(folder, ref, _prompts(1), device, chunks=(None, 7))  # whole prompts; chunks over the prefix


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_greedy_matches_transformers_batched_chunked_and_cached(models, arch):
    prompts = _prompts(2)
    prompts.append(prompts[2][:36] + [5, 6, 7])  # shares 36 tokens, past the window, with the third: a prefix hit
    assert_greedy_matches(*models[arch], prompts, 10)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tensor_parallel_equals_single_rank(models, arch):
    from test_tensor_parallel import _run

    prompts = [list(range(1, 30)), [7, 8, 9]]  # past the window
    tokens, steps = _run(models[arch][0], 2, prompts)
    ref_tokens, ref_steps = _run(models[arch][0], 1, prompts)
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert tokens == ref_tokens


def test_config_windows_and_rope_bases():
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=10, head_dim=16)
    # a hub Gemma 3 config (transformers < 4.53 wrote no layer_types)
    g3 = ModelConfig.from_hf(base | dict(
        architectures=["Gemma3ForCausalLM"], num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6,
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0))
    assert g3.layer_windows == tuple(None if i in (5, 11) else 512 for i in range(12))
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert g3.qk_norm and g3.tie_word_embeddings and g3.hidden_act == "gelu_tanh"
    assert g3.attn_logit_softcapping is None  # transformers' Gemma 3 attention never caps
    g2 = ModelConfig.from_hf(base | dict(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4,
                                         sliding_window=4096, attn_logit_softcapping=50.0, query_pre_attn_scalar=144))
    assert g2.layer_windows == (4096, None, 4096, None) and g2.attn_logit_softcapping == 50.0
    assert g2.attention_scale == 144**-0.5 and not g2.qk_norm
    mistral = ModelConfig.from_hf(base | dict(architectures=["MistralForCausalLM"], num_hidden_layers=2,
                                              sliding_window=4096))
    assert mistral.layer_windows == (4096, 4096)


def test_multimodal_gemma3_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="Gemma3ForConditionalGeneration.*text-only"):
        ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                             "text_config": {"hidden_size": 64}})
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": {"hidden_size": 64}})
