"""Llama 4 text (llama4_text) against transformers on tiny random checkpoints: chunked local
attention on the rotary layers (chunks of 8, so the prompts cross several), position-free global
layers with temperature tuning (floor_scale 4, so it moves within the prompts), the weightless
q/k norm, interleaved routed (top-1 sigmoid scaling the input, a shared expert) and dense layers.
Logits in fp32 (batched, in chunks over the cached prefix), greedy tokens through the engine
(batched, chunked prefill, a prefix hit, preemption); the ...ForConditionalGeneration layout."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import write_word_tokenizer
from kvship.models.config import ModelConfig, UnsupportedModelError
from routed_family_cases import (
    assert_greedy_batched_chunked_cached,
    assert_preemption_changes_nothing,
    prompts,
    sharpen_and_save,
)
from test_models import (
    DEVICES,
    assert_graph_step_equals_eager,
    assert_logits_match,
    gpu_greedy_agreement,
    save_checkpoint,
)

pytestmark = pytest.mark.timeout(300)

BASE = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, max_position_embeddings=256, eos_token_id=319,
            bos_token_id=0, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, intermediate_size=32,
            intermediate_size_mlp=96, num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=8,
            no_rope_layer_interval=2, floor_scale=4, attn_scale=0.5)
LLAMA4 = {
    "scout-like": BASE,
    # every layer routed, no q/k norm, no temperature tuning, llama3 rope scaling
    "all-moe": BASE | dict(interleave_moe_layer_step=1, use_qk_norm=False, attn_temperature_tuning=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16}),
}


def make_tiny_llama4(folder, spec: dict):
    """transformers' Llama 4 of ``spec`` saved to ``folder`` with a word tokenizer: norms drawn,
    its fused experts drawn (it leaves zeros), attention sharpened (routed_family_cases)."""
    import transformers

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.Llama4TextConfig(**spec),
                                                        dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.1, generator=g)
            if ".experts." in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sharpen_and_save(ref, folder)
    write_word_tokenizer(folder, 320)
    return ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    return {name: (root / name, make_tiny_llama4(root / name, spec)) for name, spec in LLAMA4.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(LLAMA4))
def test_logits_match_transformers(models, arch, device):
    folder, ref = models[arch]
    assert_logits_match(folder, ref, prompts(1), device, chunks=(None, 7))


@pytest.mark.parametrize("arch", list(LLAMA4))
def test_greedy_matches_transformers_batched_chunked_and_cached(models, arch):
    assert_greedy_batched_chunked_cached(*models[arch])


def test_preempted_sequences_give_the_same_tokens(models):
    assert_preemption_changes_nothing(*models["scout-like"])


@pytest.mark.gpu
def test_gpu_chunked_attention_in_the_kernels_and_cuda_graphs(models):
    """On the GPU the rotary layers' chunks are masked by the Triton paged attention (decode and
    prefill) and decode steps are captured in CUDA graphs: greedy tokens of a batch crossing
    several chunks equal transformers' in fp32, and a bf16 decode step replayed from its graph
    gives the eager step's logits."""
    from kvship.llm import LLM

    folder, ref = models["scout-like"]
    batch = prompts(5) + [[3, 1, 4, 1, 5]]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    assert attn.chunk == 8 and not attn.force_torch and llm.engine.runner.graphs is not None
    assert gpu_greedy_agreement(llm, ref, batch, 10) >= len(batch) - 1  # a near-tie may flip
    del llm
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert_graph_step_equals_eager(llm, batch)


def test_conditional_generation_checkpoint_reads_its_language_model(models, tmp_path):
    """Llama4ForConditionalGeneration's layout: the text config nested, the language model's
    tensors under language_model., the vision tower's skipped; the same logits."""
    from safetensors.torch import load_file

    folder, ref = models["scout-like"]
    inner = json.loads((folder / "config.json").read_text())
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
           "text_config": {**inner, "model_type": "llama4_text"}, "vision_config": {"num_hidden_layers": 1}}
    tensors = {"language_model." + k: v for k, v in load_file(folder / "model.safetensors").items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    out = tmp_path / "cond"
    save_checkpoint(out, tensors, cfg)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((folder / f).read_bytes())
    assert ModelConfig.from_hf(cfg).llama4 is not None
    assert_logits_match(out, ref, prompts(5)[1:])


def test_scout_config():
    """Llama-4-Scout's text config (the fields kvship reads)."""
    cfg = ModelConfig.from_hf(dict(
        architectures=["Llama4ForCausalLM"], model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
        intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, vocab_size=202048, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
        attention_chunk_size=8192, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)], use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192}))
    spec = cfg.llama4
    assert cfg.sparse_layers == frozenset(range(48)) and cfg.moe_intermediate_size == 8192
    assert spec.rope_layers == frozenset(i for i in range(48) if i % 4 != 3) and spec.chunk == 8192
    assert spec.dense_intermediate_size == 16384 and spec.temperature == (8192.0, 0.1) and spec.l2_qk_norm


@pytest.mark.parametrize("key,value", [("num_experts_per_tok", 2), ("attention_bias", True)])
def test_unsupported_settings_are_refused(key, value):
    cfg = dict(architectures=["Llama4ForCausalLM"], hidden_size=64, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=320, **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf(cfg)
