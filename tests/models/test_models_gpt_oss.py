"""gpt-oss against transformers on tiny random checkpoints: attention sinks, q/k/v/o biases,
sliding-window layers alternating with full ones, YaRN, the biased router and clamped-SwiGLU
experts. Logits in fp32 (batched, and in chunks over the cached prefix), greedy tokens through
the engine (batched, chunked prefill, a prefix-cache hit, preemption); an MXFP4 checkpoint laid
out as OpenAI ships it, kept packed, against transformers on the dequantized weights; gpt-oss-20b's
config.json read as it is; what the family does not run refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import make_tiny_model
from kvship.models.config import ModelConfig, UnsupportedModelError
from kvship.sampling_params import SamplingParams
from test_models import (
    DEVICES,
    assert_graph_step_equals_eager,
    assert_greedy_matches,
    assert_logits_match,
    gpu_greedy_agreement,
)

pytestmark = pytest.mark.timeout(300)

WINDOW = 6
SPEC = ("GptOssConfig", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                              "original_max_position_embeddings": 64}))
# gpt-oss-20b's config.json (the fields kvship reads)
GPT_OSS_20B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, head_dim=64,
                   hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, experts_per_token=4,
                   layer_types=["sliding_attention", "full_attention"] * 12, sliding_window=128,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000, swiglu_limit=7.0,
                   rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                                 "original_max_position_embeddings": 4096, "truncate": False},
                   quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                       "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
                   tie_word_embeddings=False, vocab_size=201088, eos_token_id=200002, pad_token_id=199999)


def _liven(ref) -> None:
    """transformers draws every weight with std 0.02: attention scaled up so that the window,
    rotary and sinks move the logits, sinks near the scores' size, experts large enough that
    the SwiGLU's clamp (7) is reached."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif ".self_attn." in name and name.endswith("weight"):
                p.mul_(6.0)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.mul_(25.0)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss") / "bf16"
    ref = make_tiny_model(folder, "gpt_oss", spec=SPEC)
    _liven(ref)
    ref.save_pretrained(folder)
    return folder, ref


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 319, (n,), generator=g).tolist() for n in (5, 17, 40)]


@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers(gpt_oss, device):
    folder, ref = gpt_oss
    assert_logits_match(folder, ref, _prompts(1), device, chunks=(None, 5))


def test_sinks_and_window_matter(gpt_oss):
    """The comparison above could not pass with sinks ignored (transformers' logits move when
    they are taken away) nor with the window ignored (the prompts outrun it on layer 0)."""
    _, ref = gpt_oss
    prompt = torch.tensor([_prompts(1)[2]])
    with torch.no_grad():
        base = ref(prompt).logits
        attn = ref.model.layers[0].self_attn
        saved = attn.sinks.clone()
        attn.sinks.fill_(-1e4)
        no_sinks = ref(prompt).logits
        attn.sinks.copy_(saved)
    assert (base - no_sinks).abs().max() > 1e-2
    assert prompt.shape[1] > 2 * WINDOW
    assert ModelConfig.from_hf(json.loads((gpt_oss[0] / "config.json").read_text())).layer_windows == (WINDOW, None)


def test_greedy_matches_transformers_batched_chunked_and_cached(gpt_oss):
    prompts = _prompts(2)
    prompts.append(prompts[2][:24] + [5, 6, 7])  # shares 24 tokens with the third: prefix-cache blocks
    assert_greedy_matches(*gpt_oss, prompts, 10)


def test_preemption_keeps_greedy_tokens(gpt_oss):
    from kvship.llm import LLM

    folder, ref = gpt_oss
    prompts = _prompts(3)
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=20, block_size=4, max_num_batched_tokens=64,
              max_model_len=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        assert got == want


def _mxfp4_checkpoint(src, dst):
    """``src``'s checkpoint with the experts replaced by random MXFP4 ones in OpenAI's layout
    (*_blocks [E, N, K / 32, 16], *_scales [E, N, K / 32]); returns the tensors' dequantized
    form as transformers computes it ([E, K, N], its experts' layout)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(123, 127, (e, n, k // 32), generator=g, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


def _with_experts(ref, experts: dict[str, torch.Tensor]):
    """A copy of ``ref`` with the named expert tensors replaced."""
    hf = type(ref)(ref.config).eval()
    hf.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for name, t in experts.items():
            hf.get_parameter(name).copy_(t)
    return hf


def test_mxfp4_checkpoint_kept_packed_matches_transformers_dequantized(gpt_oss, tmp_path):
    from kvship.llm import LLM

    folder, ref = gpt_oss
    hf = _with_experts(ref, _mxfp4_checkpoint(folder, tmp_path / "mxfp4"))
    assert_logits_match(tmp_path / "mxfp4", hf, _prompts(4), chunks=(None, 7))
    llm = LLM(str(tmp_path / "mxfp4"), device="cpu", dtype="float32", num_kv_blocks=16, block_size=4,
              max_model_len=64)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.uint8 and experts.w13.shape == (4, 2 * 128, 64 // 2)
    assert experts.w2_scale.shape == (4, 64, 128 // 32)


def test_gpt_oss_20b_config():
    cfg = ModelConfig.from_hf(GPT_OSS_20B)
    assert (cfg.architecture, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok) == ("gpt_oss", 64, 32, 4)
    assert cfg.expert_format == "mxfp4" and cfg.quantization is None and cfg.attention_bias
    assert cfg.layer_windows == (128, None) * 12 and cfg.kv_window is None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert cfg.sparse_layers == frozenset(range(24)) and cfg.norm_topk_prob


def test_what_is_not_supported_is_refused(gpt_oss):
    from kvship.llm import LLM

    llama_mxfp4 = dict(GPT_OSS_20B, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(UnsupportedModelError, match="MXFP4 checkpoints are supported for gpt-oss only"):
        ModelConfig.from_hf(llama_mxfp4)
    with pytest.raises(ValueError, match="gpt-oss is served as its checkpoint stores it"):
        LLM(str(gpt_oss[0]), device="cpu", dtype="float32", quantization="fp8", num_kv_blocks=16, max_model_len=64)


def test_random_mxfp4_weights_for_benchmarks(gpt_oss, tmp_path):
    """load_format "dummy" (bench/latency.py's gpt-oss shapes): the experts drawn as an MXFP4
    checkpoint's tensors (codes, scales near 2 ** -6, biases) and kept packed; the model runs."""
    from conftest import write_word_tokenizer
    from kvship.llm import LLM

    cfg = json.loads((gpt_oss[0] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(tmp_path, cfg["vocab_size"])
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy", num_kv_blocks=16, block_size=4,
              max_model_len=64)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.uint8 and int(experts.w13.max()) > 200
    assert 119 <= int(experts.w2_scale.min()) and int(experts.w2_scale.max()) <= 122
    assert experts.w13_bias.abs().max() > 0
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_experts_made_once_until_their_parameters_are_replaced():
    """The layer hands every forward one GptOssExperts (and one packed form of it): weights
    loaded afterwards land in it, a cast that replaces the parameters makes a new one."""
    from kvship.layers.gpt_oss_moe import GptOssMoEExperts
    from kvship.parallel import SINGLE

    layer = GptOssMoEExperts(4, 32, 32, SINGLE, mxfp4=False)
    ex = layer.experts()
    assert layer.experts() is ex and ex.packed is ex.packed
    for name, ref in layer.dummy_checkpoint("e", torch.Generator().manual_seed(0), torch.float32, "cpu"):
        layer.weight_loader(getattr(layer, layer.CHECKPOINT[name.rpartition(".")[2]]), ref)
    assert layer.experts() is ex and torch.equal(ex.w13, layer.w13) and ex.w13.abs().max() > 0
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # .to() makes new parameters
    try:
        layer.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    assert layer.experts() is not ex and layer.experts().packed.w13 is layer.w13
    assert layer.w13.dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpu_decode_in_cuda_graphs(gpt_oss, tmp_path, mxfp4):
    """On the GPU: sinks in the Triton attention (split decode, prefill), the experts' grouped
    GEMMs (MXFP4 decoded in registers), all captured in CUDA graphs: greedy tokens of a batch
    equal transformers' in fp32, and a bf16 decode step replayed from its graph gives the eager
    step's logits."""
    from kvship.llm import LLM

    folder, ref = gpt_oss
    if mxfp4:
        dequantized = _mxfp4_checkpoint(folder, tmp_path / "mxfp4")
        folder, ref = tmp_path / "mxfp4", _with_experts(ref, dequantized)
    prompts = _prompts(5) + [[3, 1, 4, 1, 5]]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert llm.engine.runner.graphs is not None
    assert gpu_greedy_agreement(llm, ref, prompts, 10) >= len(prompts) - 1  # a near-tie may flip
    del llm
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert_graph_step_equals_eager(llm, prompts)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_tensor_parallel_equals_single_rank(gpt_oss, tmp_path, mxfp4):
    """TP=2 on CPU (gloo): heads and their sinks sharded, o_proj's and the experts' down biases
    added once, MXFP4 codes and scales sliced by the intermediate dimension: every step's logits
    and the greedy tokens equal one rank's."""
    from test_tensor_parallel import _run

    folder = gpt_oss[0]
    if mxfp4:
        _mxfp4_checkpoint(folder, tmp_path / "mxfp4")
        folder = tmp_path / "mxfp4"
    prompts = _prompts(6)
    ref_tokens, ref_steps = _run(folder, 1, prompts, dtype="float32")
    tokens, steps = _run(folder, 2, prompts, dtype="float32")
    assert len(steps) == len(ref_steps) and tokens == ref_tokens
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
