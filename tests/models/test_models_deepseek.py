"""DeepSeek-V2 and V3 (multi-head latent attention, routed + shared experts, YaRN) against transformers
on tiny random checkpoints: logits in fp32 (batched, and in chunks over the cached prefix),
greedy tokens through the engine (batched with other requests, chunked prefill, a prefix-cache
hit); the paged cache holding the latent (not per-head keys and values) and sized by its
bytes, or in FP8; in-situ quantized weights against the same quantization in transformers; what
the family does not run refused by name. On a GPU: the Triton latent attention in CUDA graphs."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from kvship.config import EngineConfig
from kvship.kernels import kv_quant as kvq
from kvship.models.config import ModelConfig, UnsupportedModelError
from kvship.parallel import SINGLE
from kvship.sampling_params import SamplingParams
from routed_family_cases import make_routed_models, prompts
from test_models import (
    ATOL,
    DEVICES,
    assert_graph_step_equals_eager,
    assert_greedy_matches,
    assert_logits_match,
    gpu_greedy_agreement,
    our_logits,
)

pytestmark = pytest.mark.timeout(300)

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
           n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=24, routed_scaling_factor=1.5,
           norm_topk_prob=False,
           # YaRN as DeepSeek writes it, mscale != mscale_all_dim so that both the rotary's
           # attention factor and the scores' scale differ from 1
           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 0.8, "original_max_position_embeddings": 64,
                            "beta_fast": 32, "beta_slow": 1})
DEEPSEEK = {
    # V2-Lite's shape: q_proj, greedy top-k routing
    "v2-lite": ("DeepseekV2Config", MLA | dict(q_lora_rank=None, num_experts_per_tok=3, topk_method="greedy")),
    # V2's: a low-rank query (q_a_proj, q_a_layernorm, q_b_proj) and group-limited routing
    "v2": ("DeepseekV2Config", MLA | dict(q_lora_rank=24, num_experts_per_tok=2, topk_method="group_limited_greedy",
                                          n_group=4, topk_group=2)),
    # V3's architecture: sigmoid routing with a correction bias in 4 groups (2 kept), top-3
    # renormalized; its rope interleaved (pairs, as V2) or not (halves)
    "v3": ("DeepseekV3Config", MLA | dict(q_lora_rank=24, num_experts_per_tok=3, n_group=4, topk_group=2,
                                          norm_topk_prob=True)),
    "v3-halves": ("DeepseekV3Config", MLA | dict(q_lora_rank=None, num_experts_per_tok=2, n_group=2, topk_group=1,
                                                 norm_topk_prob=False, rope_interleave=False)),
}
LITE_ROPE = {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
             "beta_slow": 1, "original_max_position_embeddings": 4096}
# DeepSeek-V2-Lite's config.json (the fields kvship reads)
V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
               intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
               vocab_size=102400, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=64, n_shared_experts=2,
               num_experts_per_tok=6, moe_intermediate_size=1408, routed_scaling_factor=1.0, topk_method="greedy",
               n_group=1, topk_group=1, norm_topk_prob=False, scoring_func="softmax", rope_theta=10000,
               rope_scaling=LITE_ROPE, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
               bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_routed_models(tmp_path_factory.mktemp("deepseek"), DEEPSEEK)


_prompts = prompts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(DEEPSEEK))
def test_logits_match_transformers(models, arch, device):
    folder, ref = models[arch]
    assert_logits_match(folder, ref, _prompts(1), device, chunks=(None, 7))  # whole prompts; chunks over the prefix


@pytest.mark.parametrize("arch", list(DEEPSEEK))
def test_greedy_matches_transformers_batched_chunked_and_cached(models, arch):
    prompts = _prompts(2)
    prompts.append(prompts[2][:24] + [5, 6, 7])  # shares 24 tokens with the third: prefix-cache blocks
    assert_greedy_matches(*models[arch], prompts, 10)


def test_cache_holds_the_latent(models):
    """One key-only row per token and layer: the normalized latent (which transformers'
    kv_a_layernorm gives for the same input) then the 8 rotary channels; no value cache."""
    from kvship.llm import LLM

    folder, ref = models["v2-lite"]
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=64)
    runner = llm.engine.runner
    layers = runner.model.attention_layers()
    assert all(a.k_cache.shape == (32, 4, 1, 32 + 8) and a.v_cache is None for a in layers)
    assert runner.kv_bytes_per_block() == len(layers) * 4 * (32 + 8) * 4  # fp32
    prompt = list(range(1, 10))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    blocks = runner.num_blocks
    rows = torch.stack([a.k_cache.view(blocks * 4, -1) for a in layers])  # [layers, slots, 40]
    with torch.no_grad():
        attn = ref.model.layers[0].self_attn
        x = ref.model.layers[0].input_layernorm(ref.model.embed_tokens(torch.tensor(prompt)))
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, :32])
    # the prompt's 9 tokens sit in some 9 slots of layer 0
    found = [(rows[0, :, :32] - t).abs().amax(-1).min().item() for t in latent]
    assert max(found) < 1e-5


@pytest.mark.parametrize("kv,max_rel,min_top1", [("fp8", 0.06, 0.9), ("fp8_e5m2", 0.1, 0.8)])
def test_fp8_latent_cache(models, kv, max_rel, min_top1, record_property):
    """--kv-cache-dtype fp8 on DeepSeek: the latent rows stored in FP8 with a scale per layer
    measured at start-up, 4x the blocks of the float32 cache in the same bytes. Against the
    16-bit cache (prompts prefilled in chunks of 7 over the cached prefix, whose pages are read
    back quantized): the logits' relative error and the top tokens' agreement per position,
    reported and bounded (this tiny model's attention weights are scaled up 8x, so its latents
    are far from smooth); a prefix-cache hit changes no greedy token."""
    from kvship.llm import LLM

    folder, _ = models["v2"]
    common = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_memory=1 << 20)
    full, fp8 = LLM(str(folder), **common), LLM(str(folder), kv_cache_dtype=kv, **common)
    layers = fp8.engine.runner.model.attention_layers()
    assert all(a.k_cache.dtype == kvq.FP8_DTYPES[kv] and a.v_cache is None for a in layers)
    assert fp8.engine.runner.num_blocks == 4 * full.engine.runner.num_blocks
    scales = [float(a.fp8_k_scale) for a in layers]
    assert all(s != 1.0 for s in scales) and len(set(scales)) == len(scales)  # measured, per layer
    del full

    prompts = _prompts(4)
    base, got = our_logits(folder, prompts, chunk=7), our_logits(folder, prompts, chunk=7, kv_cache_dtype=kv)
    rel = max(((g - b).norm() / b.norm()).item() for g, b in zip(got, base))
    top1 = sum((g.argmax(-1) == b.argmax(-1)).sum().item() for g, b in zip(got, base)) / sum(map(len, prompts))
    record_property(f"DeepSeek-V2 tiny, {kv} latent cache against 16 bits",
                    f"logits' relative error {rel:.3f}, top token agrees at {top1:.0%} of positions")
    assert rel < max_rel and top1 >= min_top1

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = prompts[2][:20] + [9, 8, 7]
    first = fp8.generate([prompt], params)[0]
    again = fp8.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_v2_lite_cache_bytes():
    """DeepSeek-V2-Lite in bf16: (512 + 64) x 2 = 1,152 bytes a token and layer in the cache,
    where its 16 heads' keys and values in one K/V shape (192 wide) would take 2 x 16 x 192 x 2
    = 12,288 (10,240 with values at their own 128)."""
    from kvship.models.registry import model_class
    from kvship.runner.model_runner import ModelRunner

    cfg = ModelConfig.from_hf(V2_LITE)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, 4096, SINGLE, "torch")
    runner = ModelRunner.__new__(ModelRunner)  # only the sizing: no weights, no cache
    runner.model, runner.block_size, runner.dtype = model, 16, torch.bfloat16
    runner.config = EngineConfig(model="unused", device="cpu")
    per_token_layer = runner.kv_bytes_per_block() / (16 * 27)
    assert per_token_layer == (512 + 64) * 2 == 1152
    assert 2 * 16 * 192 * 2 / per_token_layer > 10


def test_v2_lite_config():
    cfg = ModelConfig.from_hf(V2_LITE)
    assert (cfg.architecture, cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank) == ("deepseek_v2", 64, 512, 0)
    assert cfg.sparse_layers == frozenset(range(1, 27)) and cfg.num_experts == 64 and cfg.num_experts_per_tok == 6
    assert cfg.shared_experts_intermediate_size == 2 * 1408 and cfg.moe_groups is None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40


def test_yarn_frequencies_match_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvship.layers.rotary import rope_attention_factor, rope_inv_freq

    hf = transformers.DeepseekV2Config(**{k: v for k, v in V2_LITE.items()
                                          if k not in ("architectures", "model_type", "torch_dtype", "rope_scaling",
                                                       "rope_theta", "moe_layer_freq", "scoring_func")},
                                       rope_parameters={**LITE_ROPE, "rope_type": "yarn", "rope_theta": 10000.0})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_hf(V2_LITE)
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(factor)


def test_v3_config_keys_left_out_take_transformers_defaults():
    v3 = {k: v for k, v in V2_LITE.items() if k not in ("n_group", "topk_group", "routed_scaling_factor",
                                                          "first_k_dense_replace", "topk_method", "scoring_func",
                                                          "norm_topk_prob")}
    cfg = ModelConfig.from_hf(v3 | dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"))
    assert (cfg.moe_groups, cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.moe_scoring) == ((8, 4), 2.5, True,
                                                                                              "sigmoid")
    assert min(cfg.sparse_layers) == 3


@pytest.mark.parametrize("change,match", [
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (dict(norm_topk_prob=True), "norm_topk_prob=True"),
    (dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    (dict(attention_bias=True), "attention_bias=True"),
    # V3's architecture routes by noaux_tc alone
    (dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", scoring_func="softmax"),
     "DeepSeek-V3 with scoring_func='softmax'"),
    (dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", scoring_func="sigmoid",
          topk_method="group_limited_greedy"), "DeepSeek-V3 routing topk_method='group_limited_greedy'"),
])
def test_unsupported_variants_are_refused_by_name(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(V2_LITE | change)


def test_v3_multi_token_prediction_layers_are_skipped(models, tmp_path):
    """A V3 checkpoint's layers past num_hidden_layers (its multi-token-prediction module, for
    speculative decoding) load as nothing: the logits stay transformers'."""
    from safetensors.torch import load_file, save_file

    folder, ref = models["v3"]
    mtp = tmp_path / "mtp"
    shutil.copytree(folder, mtp)
    tensors = load_file(str(mtp / "model.safetensors"))
    extra = {"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
             "model.layers.2.self_attn.kv_a_layernorm.weight": torch.ones(32)}
    save_file(tensors | extra, str(mtp / "model.safetensors"))
    assert_logits_match(mtp, ref, _prompts(5)[:1])


def test_int4_kv_cache_is_refused(models):
    from kvship.runner.model_setup import load_model

    with pytest.raises(ValueError, match="--kv-cache-dtype int4: DeepSeek's latent KV cache"):
        load_model(EngineConfig(model=str(models["v2-lite"][0]), device="cpu", kv_cache_dtype="int4"))


# a checkpoint's linear layers, as FP8 checkpoints quantize them (the router stays 16-bit)
_CHECKPOINT_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                       "up_proj", "down_proj")
_FP8_BLOCK = 16  # blocks of 16 x 16: the tiny matrices (24 to 112 rows, 24 to 64 inputs) end in partial ones


def _fp8_checkpoint(src, dst, fmt: str):
    """The checkpoint in src written to dst in ``fmt``: "fp8-block" (quant_method fp8, a
    weight_scale_inv per block, partial blocks at the edges as DeepSeek-V3's 576-row kv_a_proj has)
    or "ct-fp8-channel" (compressed-tensors, a weight_scale per row); the same checkpoint with the
    format's dequantized values in 16-bit form beside it, in dst / "dequantized"."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    shutil.copytree(src, dst / "dequantized")
    out, deq = {}, {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            prefix, _, leaf = name.rpartition(".")
            if leaf != "weight" or prefix.rpartition(".")[2] not in _CHECKPOINT_LINEARS:
                out[name] = deq[name] = w
                continue
            n, k = w.shape
            if fmt == "fp8-block":
                b = _FP8_BLOCK
                padded = torch.zeros(-(-n // b) * b, -(-k // b) * b)
                padded[:n, :k] = w
                blocks = (padded.view(padded.shape[0] // b, b, padded.shape[1] // b, b).abs().amax((1, 3)) / 448.0)
                scale = blocks.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
                out[prefix + ".weight_scale_inv"] = blocks.float()
            else:
                scale = w.abs().amax(1, keepdim=True) / 448.0
                out[prefix + ".weight_scale"] = scale.float()
            out[name] = (w / scale).to(torch.float8_e4m3fn)
            deq[name] = out[name].float() * scale
    save_file(out, str(dst / "model.safetensors"))
    save_file(deq, str(dst / "dequantized" / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [_FP8_BLOCK, _FP8_BLOCK]}
        if fmt == "fp8-block" else
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                       "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                       "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}})
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-channel"])
@pytest.mark.parametrize("arch", ["v2-lite", "v2", "v3"])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(models, tmp_path, arch, fmt):
    """FP8 checkpoints (block-wise as DeepSeek-V3's, per channel as compressed-tensors writes
    them), every linear layer quantized, kv_b_proj too (held dequantized): logits equal
    transformers' on the format's dequantized weights in fp32, whole and chunked, and greedy
    tokens; the rope rows' reordering (V2, V3 interleaved) reorders codes and scales alike."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / fmt
    _fp8_checkpoint(models[arch][0], folder, fmt)
    ref = AutoModelForCausalLM.from_pretrained(folder / "dequantized", dtype=torch.float32).eval()
    assert_logits_match(folder, ref, _prompts(8), "cpu", chunks=(None, 7))
    assert_greedy_matches(folder, ref, _prompts(9), 6)


# what in-situ quantization quantizes: every projection but kv_b_proj (absorbed, kept 16-bit) and
# the router; transformers holds the routed experts stacked, [experts, out, in]
_QUANTIZED = tuple(f".{n}.weight" for n in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",
                                              "gate_proj", "up_proj", "down_proj")) + \
    (".experts.gate_up_proj", ".experts.down_proj")


def _dequantized(ref, method: str):
    """A copy of transformers' model with the weights in-situ quantization quantizes replaced by
    their quantized-then-dequantized values (kvship.quant.insitu's rule)."""
    from kvship.quant import insitu

    deq = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in deq.named_parameters():
            if name.endswith(_QUANTIZED):
                for w in (p if p.dim() == 3 else [p]):
                    w.copy_(insitu.quantize(w, method).dequantize(torch.float32))
    return deq


@pytest.mark.parametrize("method", ["fp8", "int8", "int4"])
def test_insitu_quantization_matches_transformers_on_dequantized_weights(models, method):
    """--quantization fp8 / int8 / int4 on DeepSeek-V2 (its V2 form: the low-rank query, group
    routing): logits equal transformers' on the same weights quantized and dequantized by the
    same rule, in fp32, and the greedy tokens; and they differ from the 16-bit model's by more
    than the tolerance, so the quantization is really there."""
    folder, ref = models["v2"]
    deq = _dequantized(ref, method)
    prompts = _prompts(4)
    got = our_logits(folder, prompts, quantization=method)
    moved = 0.0
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want, full = deq(torch.tensor([p])).logits[0], ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(g, want, atol=ATOL, rtol=0)
        assert torch.equal(g.argmax(-1), want.argmax(-1))
        moved = max(moved, (want - full).abs().max().item())
    assert moved > 10 * ATOL


def test_tensor_parallel_equals_single_rank(models):
    """Two ranks: query heads sharded, the latent projection and its cache replicated."""
    from test_tensor_parallel import _run

    prompts = [list(range(1, 30)), [7, 8, 9]]
    tokens, steps = _run(models["v2"][0], 2, prompts)
    ref_tokens, ref_steps = _run(models["v2"][0], 1, prompts)
    for a, b in zip(steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert tokens == ref_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(DEEPSEEK))
def test_gpu_decode_in_cuda_graphs(models, arch):
    """On the GPU decodes store and attend through the Triton MLA kernels, captured in CUDA graphs:
    greedy tokens of a batch (split contexts, a padded graph) equal transformers' in fp32, and a
    bf16 decode step replayed from its graph gives the eager step's logits."""
    from kvship.llm import LLM

    folder, ref = models[arch]
    prompts = _prompts(3) + [[3, 1, 4, 1, 5]]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert llm.engine.runner.graphs is not None
    # a near-tie may flip between kernels' summation orders
    assert gpu_greedy_agreement(llm, ref, prompts, 10) >= len(prompts) - 1
    del llm
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert_graph_step_equals_eager(llm, prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gpu_insitu_quantized_decode(models, method):
    """In-situ quantized projections and experts on the GPU's quantized kernels, in CUDA graphs
    beside the latent attention: greedy tokens equal transformers' on the dequantized weights."""
    from kvship.llm import LLM

    folder, ref = models["v2"]
    prompts = _prompts(5)
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64, quantization=method)
    assert llm.engine.runner.graphs is not None
    assert gpu_greedy_agreement(llm, _dequantized(ref, method), prompts, 10) >= len(prompts) - 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_gpu_fp8_latent_cache_in_cuda_graphs(models, kv):
    """The FP8 latent cache through the Triton store and decode kernels: a decode step replayed
    from its CUDA graph gives the eager step's logits."""
    from kvship.llm import LLM

    llm = LLM(str(models["v3"][0]), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_kv_blocks=64,
              kv_cache_dtype=kv)
    assert llm.engine.runner.graphs is not None
    assert_graph_step_equals_eager(llm, _prompts(6) + [[3, 1, 4, 1, 5]])
