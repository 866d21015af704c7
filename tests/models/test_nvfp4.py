"""NVFP4 checkpoints (compressed-tensors nvfp4-pack-quantized and ModelOpt's layout): packing and
scales checked against compressed-tensors' own compressor and unpacker and the format's
definition (E2M1[code] * FP8 scale / global scale); the W4A16 Triton kernel (the interpreter
without a GPU) against its torch reference; tiny Llama and Qwen3-MoE checkpoints written in
each layout matching transformers on the dequantized weights; unsupported layouts refused."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model
from kvship.kernels import nvfp4_linear as nk
from kvship.kernels._triton import HAS_TRITON
from kvship.quant import UnsupportedQuantization, checkpoint_format
from kvship.quant.nvfp4 import nvfp4, unpack_nibbles
from kvship.quant.tensor import e2m1_values
from test_models import our_logits
from test_quantized_moe import SPEC as MOE_SPEC

pytestmark = pytest.mark.timeout(300)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True))


def _compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' compressor on ``w`` with absmax scales: the global scale maps the
    matrix's largest block scale to FP8's largest value, each block's to its largest code."""
    n, k = w.shape
    gs = (448.0 * 6.0 / w.abs().amax()).reshape(1).float()
    scale = (w.view(n, k // 16, 16).abs().amax(-1) / 6.0 * gs).to(torch.float8_e4m3fn).float()
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, SCHEME)


def _definition(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """E2M1[code] * scale / global scale, the codes unpacked by compressed-tensors, in float32."""
    n, half = packed["weight_packed"].shape
    values = unpack_fp4_from_uint8(packed["weight_packed"], n, 2 * half, dtype=torch.float32)
    return values * (packed["weight_scale"].float() / packed["weight_global_scale"]).repeat_interleave(16, 1)


def test_packing_matches_compressed_tensors():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(0))
    packed = _compress(w)
    qt = nvfp4(dict(packed))
    assert qt.e2m1 and qt.group_size == 16 and qt.codes.shape == (24, 96)
    assert torch.equal(qt.dequantize(), _definition(packed))
    # its pack of our unpacked values gives back the stored bytes
    assert torch.equal(pack_fp4_to_uint8(e2m1_values(qt.codes)), packed["weight_packed"])
    assert torch.equal(unpack_nibbles(packed["weight_packed"]), qt.codes)
    # its own decompressor (bfloat16) agrees to its rounding
    theirs = NVFP4PackedCompressor.decompress(packed, SCHEME)["weight"].float()
    torch.testing.assert_close(theirs, qt.dequantize(), rtol=2**-7, atol=0)
    assert (qt.dequantize() - w).abs().max() < 0.5 * w.abs().max()  # a quantization of w at all
    # ModelOpt's layout: the same codes and block scales, the global factor multiplied
    mo = nvfp4({"weight": packed["weight_packed"], "weight_scale": packed["weight_scale"],
                "weight_scale_2": 1.0 / packed["weight_global_scale"]}, layout="modelopt")
    torch.testing.assert_close(mo.dequantize(), qt.dequantize(), rtol=1e-6, atol=0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("k", [64, 96])
def test_kernel_matches_reference(m, k):
    from kvship.kernels.quant_linear import pack

    g = torch.Generator().manual_seed(m + k)
    qt = nvfp4(dict(_compress(torch.randn(48, k, generator=g))))
    w = pack(qt, DEV)
    assert w.e2m1 and w.qweight.shape == (48, k // 2) and w.scales.dtype == torch.float32
    x = torch.randn(m, k, generator=g).to(DEV)
    bias = torch.randn(48, generator=g).to(DEV)
    want = x @ qt.dequantize().to(DEV).T + bias
    torch.testing.assert_close(nk.nvfp4_linear_torch(x, w.qweight, w.scales, k, bias), want, atol=1e-4, rtol=1e-4)
    got = nk.nvfp4_linear_triton(x, w.qweight, w.scales, k, bias)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if DEV == "cuda":  # bf16 activations on the tensor cores
        got16 = nk.nvfp4_linear_triton(x.bfloat16(), w.qweight, w.scales, k, bias.bfloat16())
        torch.testing.assert_close(got16.float(), want, atol=0.1, rtol=0.02)


def _ct_config(acts: bool) -> dict:
    group = {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
             "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                         "symmetric": True, "dynamic": False}}
    if acts:  # NVFP4A4 as llm-compressor writes it: run weight-only here
        group["input_activations"] = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                      "group_size": 16, "dynamic": "local"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": group}}


def _write_nvfp4(folder, layout: str, ref) -> None:
    """Every linear of ``folder``'s checkpoint in NVFP4 (``layout``); ``ref`` gets the
    dequantized weights (the definition), as transformers is to run them."""
    tensors = load_file(str(folder / "model.safetensors"))
    out, deq = {}, {}
    for name, w in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            out[name] = w
            continue
        packed = _compress(w)
        deq[name] = _definition(packed)
        if layout == "compressed-tensors":
            out.update({f"{prefix}.{k}": v for k, v in packed.items()})
            out[f"{prefix}.input_global_scale"] = torch.ones(1)  # read past: activations stay 16-bit
        else:
            out[f"{prefix}.weight"] = packed["weight_packed"]
            out[f"{prefix}.weight_scale"] = packed["weight_scale"]
            out[f"{prefix}.weight_scale_2"] = 1.0 / packed["weight_global_scale"]
            out[f"{prefix}.input_scale"] = torch.ones(1)
            deq[name] = nvfp4({"weight": packed["weight_packed"], "weight_scale": packed["weight_scale"],
                               "weight_scale_2": 1.0 / packed["weight_global_scale"]}, "modelopt").dequantize()
    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = _ct_config(acts=True) if layout == "compressed-tensors" else {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    result = ref.load_state_dict({**ref.state_dict(), **_fused_experts(ref, deq)}, strict=False)
    assert not result.unexpected_keys


def _fused_experts(ref, deq: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The dequantized per-expert matrices as transformers' model holds them (stacked
    gate_up_proj [E, 2I, H], down_proj [E, H, I]); other names as they are."""
    state = dict(deq)
    for name in ref.state_dict():
        if name.endswith("experts.gate_up_proj"):
            base = name.rsplit(".", 1)[0]
            e = ref.get_parameter(name).shape[0]
            state[name] = torch.stack([torch.cat([state.pop(f"{base}.{i}.gate_proj.weight"),
                                                  state.pop(f"{base}.{i}.up_proj.weight")]) for i in range(e)])
            state[f"{base}.down_proj"] = torch.stack([state.pop(f"{base}.{i}.down_proj.weight") for i in range(e)])
    return state


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_checkpoint_matches_transformers_on_dequantized_weights(tmp_path, caplog, layout, model):
    folder = tmp_path / model
    if model == "llama":
        ref = make_tiny_model(folder, "llama-gqa-tied", seed=3)
    else:
        ref = make_tiny_model(folder, "qwen3-moe", seed=5, spec=MOE_SPEC)
    _write_nvfp4(folder, layout, ref)
    prompts = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 23)]
    with caplog.at_level(logging.WARNING, logger="kvship.quant.nvfp4"):
        got = our_logits(folder, prompts, device=DEV)
    assert "W4A16" in caplog.text
    for p, ours in zip(prompts, got):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours, want, atol=1e-4 if DEV == "cpu" else 2e-2, rtol=0)
        assert torch.equal(ours.argmax(-1), want.argmax(-1)), "greedy tokens differ"


@pytest.mark.skipif(DEV == "cuda" or not HAS_TRITON, reason="CPU: the Triton kernels run in the interpreter")
def test_moe_experts_on_the_triton_path_match_transformers(tmp_path, monkeypatch):
    """The NVFP4 experts on kernels/nvfp4_moe.py's Triton kernels (the GPU's dispatch, forced here):
    a batch (the grouped GEMMs) and one prompt in chunks of 5 whose last step is one token (the
    GEMV) match transformers on the dequantized weights."""
    from kvship.kernels import nvfp4_moe

    folder = tmp_path / "moe"
    ref = make_tiny_model(folder, "qwen3-moe", seed=5, spec=MOE_SPEC)
    _write_nvfp4(folder, "modelopt", ref)
    tokens, triton_path = [], nvfp4_moe.nvfp4_moe_triton
    monkeypatch.setattr(nvfp4_moe, "use_triton", lambda t: True)
    monkeypatch.setattr(nvfp4_moe, "nvfp4_moe_triton", lambda x, *a, **kw: tokens.append(x.shape[0]) or
                        triton_path(x, *a, **kw))
    prompts = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 11)]
    got = our_logits(folder, prompts) + our_logits(folder, prompts[1:], chunk=5)
    assert 1 in tokens and max(tokens) == 17
    for p, ours in zip(prompts + prompts[1:], got):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)


def test_moe_experts_stay_quantized(tmp_path):
    from kvship.llm import LLM

    folder = tmp_path / "moe"
    ref = make_tiny_model(folder, "qwen3-moe", seed=5, spec=MOE_SPEC)
    _write_nvfp4(folder, "compressed-tensors", ref)
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    scales = experts.scales()
    assert scales.e2m1 and scales.w13_group == scales.w2_group == 16 and scales.w13.dtype == torch.float32
    assert experts.w13.dtype == torch.uint8 and experts.w13.shape[2] == ref.config.hidden_size // 2  # two a byte


@pytest.mark.parametrize("cfg,match", [
    ({**_ct_config(False), "config_groups": {"group_0": {
        "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "group_size": 32, "symmetric": True}}}}, "groups of 32"),
    ({**_ct_config(False), "config_groups": {"group_0": {
        "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "group_size": 16, "symmetric": False}}}}, "asymmetric"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "ModelOpt FP8"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}, "kv_cache_quant_algo"),
])
def test_unsupported_layouts_are_refused(cfg, match):
    with pytest.raises(UnsupportedQuantization, match=match):
        checkpoint_format(cfg)
