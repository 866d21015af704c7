"""Mixture-of-experts models with quantized experts. A tiny Qwen3-MoE checkpoint is written here as
quantized checkpoints store one (FP8: block-wise codes and ``weight_scale_inv``, Qwen3-30B-A3B-FP8's
format, and compressed-tensors FP8 per channel; integer: GPTQ 4- and 8-bit, AWQ and
compressed-tensors pack-quantized W4A16, Qwen3-30B-A3B-GPTQ-Int4's kind): it loads with its
experts kept quantized and matches transformers running the dequantized weights, on the torch
path and on the Triton kernels (the interpreter). GPTQ act-order experts are refused. In-situ
``--quantization fp8|int8|int4`` of a 16-bit one stays close to the 16-bit model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model
from kvship.config import EngineConfig
from kvship.kernels import fused_moe as fm
from kvship.kernels._triton import HAS_TRITON
from kvship.layers.moe import MoEExperts
from kvship.llm import LLM
from kvship.loader import resolve_model
from kvship.models.config import ModelConfig
from kvship.parallel import TPContext
from kvship.quant import QuantRef, QuantScheme, checkpoint_format
from kvship.runner.model_runner import ModelRunner
from kvship.sampling_params import SamplingParams
from test_fused_moe import fp8_block
from test_models import ATOL, our_logits
from test_quantized_weights import _write_format

# 8 experts of 64 x 64 (two 32 x 32 blocks along hidden and along the expert intermediate
# size, as _write_format's block-wise FP8 cuts them); layer 1 a dense MLP
SPEC = ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]))
PROMPTS = [torch.randint(0, 319, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11)]


def _moe_folder(root, fmt: str):
    """The checkpoint in ``fmt`` (_write_format's; every linear but the router quantized) at
    root / fmt; returns it with transformers' model on the dequantized weights and the
    quantized tensors written."""
    folder, dequantized = root / fmt, root / (fmt + "-dequantized")
    make_tiny_model(folder, "qwen3-moe", seed=5, spec=SPEC)
    tensors = load_file(str(folder / "model.safetensors"))  # one matrix per expert, as checkpoints hold them
    out, deq, qcfg = _write_format(tensors, fmt, torch.Generator().manual_seed(0))
    dequantized.mkdir()
    (dequantized / "config.json").write_text((folder / "config.json").read_text())
    save_file(deq, str(dequantized / "model.safetensors"))
    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32).eval()
    return folder, ref, out


def _assert_logits_match(folder, ref, atol=ATOL, **kw) -> None:
    for p, got in zip(PROMPTS, our_logits(folder, PROMPTS, **kw)):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)  # fp32 on both sides
        assert torch.equal(got.argmax(-1), want.argmax(-1)), "greedy tokens differ"


def _assert_greedy_matches(folder, ref) -> LLM:
    """8 greedy tokens of each prompt through LLM equal transformers' generate; returns the LLM."""
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=256)
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for p, out in zip(PROMPTS, got):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == want
    return llm


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["fp8-block", "ct-fp8-channel"])
def test_fp8_checkpoint_keeps_experts_fp8_and_matches_transformers(tmp_path, fmt):
    folder, ref, written = _moe_folder(tmp_path, fmt)
    source = resolve_model(str(folder))
    runner = ModelRunner(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=16,
                                      max_model_len=256, enforce_eager=True),
                         ModelConfig.from_hf(source.hf_config), source.weights())
    experts = runner.model.model.layers[0].mlp.experts
    groups = 2 if fmt == "fp8-block" else 1  # scales per row: one per 32 inputs, or one
    assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
    assert experts.w13.nbytes == 8 * 128 * 64 and experts.w2.nbytes == 8 * 64 * 64  # a byte a weight
    assert experts.w13_scale.shape == (8, 128, groups) and experts.w2_scale.shape == (8, 64, groups)
    key = "model.layers.0.mlp.experts.{}.{}.weight"
    for e in (0, 5):  # the checkpoint's bytes, gate rows then up rows
        want = torch.cat([written[key.format(e, "gate_proj")], written[key.format(e, "up_proj")]])
        assert torch.equal(experts.w13[e].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(experts.w2[e].view(torch.uint8), written[key.format(e, "down_proj")].view(torch.uint8))
    scale = written[f"model.layers.0.mlp.experts.5.down_proj.{'weight_scale_inv' if groups == 2 else 'weight_scale'}"]
    torch.testing.assert_close(experts.w2_scale[5], scale.repeat_interleave(64 // scale.shape[0], 0), atol=0, rtol=0)

    _assert_logits_match(folder, ref)
    _assert_greedy_matches(folder, ref)


# integer checkpoint format -> (the stacks' bits, offsets stored, logits' tolerance). Groups of 32
# inputs, two to a row of 64 (the scale buffers' last dimension). GPTQ and AWQ files hold fp16
# scales (and AWQ integer zeros) that kvship keeps exactly but for AWQ's offsets, -zero * scale
# rounded to fp16 (measured 3e-5 on these logits): the fp32 tolerance. compressed-tensors' own
# decompressor, the reference, rounds each weight to fp16 (up to 6e-5 here): the dense formats'
# 2e-3 (test_quantized_weights), measured 2.2e-4.
INT_FORMATS = {"gptq": (4, False, ATOL), "gptq-8bit": (8, False, ATOL), "awq": (4, True, ATOL),
               "ct-w4a16": (4, False, 2e-3), "ct-w4a16-asym": (4, True, 2e-3)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", list(INT_FORMATS))
def test_integer_checkpoint_keeps_experts_quantized_and_matches_transformers(tmp_path, monkeypatch, fmt):
    """Every expert's gate/up/down in the file's integer codes (the router in 16 bits), packed as
    quant_linear lays out a matrix; the torch path dequantizes them one expert at a time."""
    bits, offsets, atol = INT_FORMATS[fmt]
    folder, ref, _ = _moe_folder(tmp_path, fmt)
    read = []
    expert_weight = fm.expert_weight
    monkeypatch.setattr(fm, "expert_weight", lambda w, s, name, *a: read.append(s.of(name)[2:])
                        or expert_weight(w, s, name, *a))
    llm = _assert_greedy_matches(folder, ref)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == torch.uint8 and experts.bits == {"w13": bits, "w2": bits}
    assert experts.w13.shape == (8, 128, 64 * bits // 8) and experts.w2.shape == (8, 64, 64 * bits // 8)
    assert experts.groups == {"w13": 32, "w2": 32}
    assert experts.w13_scale.shape == (8, 128, 2) and experts.w2_scale.shape == (8, 64, 2)
    assert (experts.w13_bias is not None) == (experts.w2_bias is not None) == offsets
    assert read and set(read) == {(32, bits)}  # (group, bits) of every expert matrix the torch path read
    _assert_logits_match(folder, ref, atol=atol)


def test_act_order_experts_are_refused(tmp_path):
    """GPTQ desc_act: each matrix's g_idx visits its inputs out of order, which the expert
    kernels do not read (dense layers do)."""
    folder, _, _ = _moe_folder(tmp_path, "gptq-act-order")
    with pytest.raises(ValueError, match=r"expert 0's down matrix is quantized with act-order \(GPTQ desc_act"):
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=256)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="CPU only: the Triton interpreter")
@pytest.mark.parametrize("fmt", ["fp8-block", "gptq", "awq"])
def test_checkpoint_on_the_triton_kernels_matches_transformers(tmp_path, monkeypatch, fmt):
    """The GPU's dispatch, forced: the prompts' prefill on the grouped GEMMs, and a prompt fed
    a token at a time on the one-token kernels, with the FP8 block scales, or 4-bit codes in
    groups of 32 (GPTQ symmetric, AWQ with offsets)."""
    folder, ref, _ = _moe_folder(tmp_path, fmt)
    calls = []
    triton_path = fm.fused_moe_triton
    monkeypatch.setattr(fm, "use_triton", lambda t: True)
    monkeypatch.setattr(fm, "fused_moe_triton", lambda *a, **kw: calls.append(kw["scales"]) or triton_path(*a, **kw))
    _assert_logits_match(folder, ref)
    got = our_logits(folder, PROMPTS[:1], chunk=1)[0]
    with torch.no_grad():
        torch.testing.assert_close(got, ref(torch.tensor(PROMPTS[:1])).logits[0], atol=ATOL, rtol=0)
    assert calls and all(s is not None and s.w13_group == s.w2_group == 32 for s in calls)


# in-situ method -> (experts' code dtype and bits, largest relative error of the logits, least
# agreement of the greedy tokens). FP8 rounds each weight by up to 1/16 of its value (3 mantissa
# bits); int8 by half of a row's amax / 127; int4 to 16 levels between a group's min and max (one
# group of 128 over these rows of 64 and 32 inputs).
INSITU = {"fp8": (torch.float8_e4m3fn, 8, 6e-2, 0.75), "int8": (torch.uint8, 8, 2e-2, 0.75),
          "int4": (torch.uint8, 4, 0.25, 0.5)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", list(INSITU))
def test_insitu_quantization_of_a_moe_model(tmp_path, record_property, method):
    """--quantization fp8 / int8 / int4 on a 16-bit (here fp32) Qwen3-MoE: experts quantized
    with a scale per row (fp8, int8) or per group of 128 with offsets (int4, two codes a byte),
    logits close to the 16-bit model's, and the greedy tokens' agreement reported."""
    dtype, bits, max_rel, min_agree = INSITU[method]
    folder = tmp_path / "qwen3-moe"
    make_tiny_model(folder, "qwen3-moe", seed=5, spec=SPEC)
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=256, quantization=method)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == dtype and experts.w13_scale.shape[2] == 1 and experts.bits["w13"] == bits
    assert experts.w13.shape == (8, 128, 64 * bits // 8) and (experts.w13_bias is not None) == (method == "int4")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    quantized = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    full = [o.outputs[0].token_ids for o in LLM(str(folder), device="cpu", dtype="float32",
                                                  max_model_len=256).generate(PROMPTS, params)]
    agree = sum(a == b for x, y in zip(quantized, full) for a, b in zip(x, y)) / sum(map(len, full))
    rel = []
    for q, w in zip(our_logits(folder, PROMPTS, quantization=method), our_logits(folder, PROMPTS)):
        rel.append(((q - w).norm() / w.norm()).item())
    record_property(f"in-situ {method} MoE", f"greedy tokens agree {agree:.0%}, logits' relative error {max(rel):.2e}")
    assert max(rel) < max_rel and agree >= min_agree


def test_tensor_parallel_split_inside_a_block_is_refused():
    """Expert intermediate 48 over two ranks: w13's rows split anywhere (their scales are
    repeated per row), w2's inputs only between the 16-input blocks."""
    fmt = checkpoint_format({"quant_method": "fp8", "weight_block_size": [16, 16]})

    def ref(w):
        codes, scale = fp8_block(w, 16)
        return QuantRef(lambda: fmt.convert({"weight": codes, "weight_scale_inv": scale}), "fp8")

    experts = MoEExperts(2, 32, 48, TPContext(rank=1, size=2), quant=QuantScheme(checkpoint="fp8"))
    gate = torch.randn(48, 32)
    experts.weight_loader(experts.w13, ref(gate), (0, 0))
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.groups["w13"] == 16
    want = fmt.convert(dict(zip(("weight", "weight_scale_inv"), fp8_block(gate, 16)))).dequantize()[24:]
    torch.testing.assert_close(fm.expert_weight(experts.w13, fm.ExpertScales(experts.w13_scale, None, 16), "w13", 0, 32, torch.float32)[:24], want)
    with pytest.raises(ValueError, match="split a quantization group of 16"):
        experts.weight_loader(experts.w2, ref(torch.randn(32, 48)), (0, None))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["fp8-block", "awq"])
def test_quantized_experts_sharded_over_two_ranks_equal_one(tmp_path, fmt):
    """Qwen3-MoE in block-wise FP8 or AWQ over TP=2 (gloo): each rank holds half of every
    expert's intermediate rows (gate and up, with their scales and offsets) and one of the two
    32-input blocks (groups) of its down matrix; the logits equal one rank's."""
    from test_tensor_parallel import _run

    folder, _, _ = _moe_folder(tmp_path, fmt)
    tokens1, steps1 = _run(folder, 1)
    tokens2, steps2 = _run(folder, 2)
    for a, b in zip(steps2, steps1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert tokens2 == tokens1
