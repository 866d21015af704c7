"""Quantized weights multiplied as integers on the CPU (kernels/cpu_quant_linear.py, the default
``cpu_weight_format`` "auto"): each product against its float reference, a checkpoint's 4-bit
groups kept exactly, the bundled model's perplexity against the float32 path on a fixed text
(perplexity_text.txt, 386 tokens), and the option."""
import math
from pathlib import Path

import pytest
import torch

from kvship.config import EngineConfig
from kvship.kernels.cpu_quant_linear import (
    GEMM_FROM_ROWS,
    CpuQuantLinear,
    Int4Groups,
    Int8Rows,
    bf16_kernels,
    cpu_quant_weight,
    quant_linear_reference,
)
from kvship.llm import LLM
from kvship.quant import quantize
from kvship.sampling_params import SamplingParams

TEXT = Path(__file__).with_name("perplexity_text.txt")
# Both paths' outputs are bfloat16 (8 significant bits), summed in their own order: a product
# within 1% of the reference's norm, where a wrong scale or transposed codes miss by 100%.
PRODUCT_TOL = 0.01
PPL_TOL = 0.01  # the bound for the quantized path against float32
needs_bf16 = pytest.mark.skipif(not bf16_kernels(), reason="the int4 kernel needs AVX512-BF16 or AMX")


def weight(seed: int) -> torch.Tensor:
    return torch.randn(96, 256, generator=torch.Generator().manual_seed(seed)) * 0.05


def check_product(held: Int4Groups | Int8Rows, rows: int) -> None:
    x = torch.randn(2, rows, held.codes.shape[1], generator=torch.Generator().manual_seed(rows))
    want = quant_linear_reference(x, held)
    got = CpuQuantLinear(held)(x)
    assert got.shape == (2, rows, held.codes.shape[0]) and got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < PRODUCT_TOL


@pytest.mark.parametrize("rows", [1, 3, GEMM_FROM_ROWS["int8"], 33])  # the int8 kernel, then the GEMM copy
@pytest.mark.parametrize("source", ["float", "int4 groups"])
def test_int8_product_matches_reference(rows, source):
    w = weight(rows)
    int8 = Int8Rows.of(quantize(w, "int4") if source == "int4 groups" else w)
    check_product(int8, rows)
    # requantizing with a scale per row moves a weight by at most half that scale
    source_w = quantize(w, "int4").dequantize() if source == "int4 groups" else w
    assert ((int8.dequantize() - source_w).abs() <= int8.scales[:, None] / 2 + 1e-7).all()


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, GEMM_FROM_ROWS["int4"], 33])  # the int4 kernel, then the GEMM copy
def test_int4_product_matches_reference(rows):
    check_product(Int4Groups.of(quantize(weight(rows), "int4")), rows)


def q4_1(w: torch.Tensor):
    """A GGUF Q4_1 tensor of ``w`` as the loader reads one: codes 0..15, a scale and a minimum a
    block of 32 (bias = minimum)."""
    from kvship.quant import QuantizedTensor

    n, k = w.shape
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    codes = torch.round((g - lo[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedTensor(codes, d, lo, 4, 32)


def symmetric(w: torch.Tensor, group: int):
    """4-bit codes centred on 8 with a scale a group (GPTQ without zero points, GGUF Q4_0)."""
    from kvship.quant import QuantizedTensor

    n, k = w.shape
    g = w.view(n, k // group, group)
    d = g.abs().amax(-1) / 7
    codes = (torch.round(g / d[..., None]).clamp(-8, 7) + 8).to(torch.uint8).view(n, k)
    return QuantizedTensor(codes, d, None, 4, group)


@pytest.mark.parametrize("source", ["q4_1 blocks of 32", "symmetric groups of 128", "groups of 128, the last of 64"])
def test_int4_keeps_a_checkpoints_4bit_groups(source):
    """Codes and groups taken as the checkpoint has them: the same values (up to float32
    rounding), not a requantization; a last group shorter than the others (576 inputs in groups
    of 128, as the bundled model's under --quantization int4) too."""
    w = weight(7)
    if source.startswith("q4_1"):
        q = q4_1(w)
    elif source.startswith("symmetric"):
        q = symmetric(w, 128)
    else:
        q = quantize(torch.randn(96, 320, generator=torch.Generator().manual_seed(7)) * 0.05, "int4")
        assert q.group_size == 128 and q.scales.shape[1] == 3
    assert q.bits == 4 and (q.biases is not None) != source.startswith("symmetric")
    held = Int4Groups.of(q)
    assert torch.equal(held.codes, q.codes)
    torch.testing.assert_close(held.dequantize(), q.dequantize(), rtol=0, atol=1e-6)


def test_auto_picks_int4_for_4bit_groups_only():
    w = weight(3)
    expect_int4 = Int4Groups if bf16_kernels() else Int8Rows
    assert isinstance(cpu_quant_weight(q4_1(w), "auto"), expect_int4)
    assert isinstance(cpu_quant_weight(quantize(w, "int8"), "auto"), Int8Rows)  # 8-bit codes: not requantized to 4
    assert isinstance(cpu_quant_weight(quantize(w, "int8"), "int4"), expect_int4)  # asked for
    assert isinstance(cpu_quant_weight(q4_1(w), "int8"), Int8Rows)
    odd = torch.randn(40, 256)  # rows not a multiple of 16: the int4 kernel cannot pack them
    assert isinstance(cpu_quant_weight(odd, "int4"), Int8Rows)


def mean_nll(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [chosen.logprob for chosen, _ in out.prompt_logprobs]
    assert len(logprobs) == len(ids) - 1
    return -sum(logprobs) / len(logprobs)


@pytest.mark.timeout(900)
def test_bundled_model_perplexity_within_one_percent_of_float32(record_property):
    """The prompt in steps of 512 tokens (the GEMM copy) and of 4 (the weight-only kernels, as
    decodes). The bundled file is Q4_1: "auto" holds it as int4."""
    text = TEXT.read_text()
    nll, kinds = {}, {}
    runs = [("float32", 512), ("auto", 512), ("auto", 4), ("int8", 4)]
    for fmt, step in runs:
        llm = LLM(device="cpu", cpu_weight_format=fmt, num_kv_blocks=32, max_num_batched_tokens=step,
                  prefill_join_tokens=step, enable_prefix_caching=False)
        model = llm.engine.runner.model
        qkv, head = model.model.layers[0].self_attn.qkv_proj.cpu_quant, model.lm_head.cpu_quant
        assert (qkv is None) == (head is None) == (fmt == "float32")  # the tied head too
        kinds[fmt] = qkv and qkv.kind
        ids = llm.engine.tokenizer.encode(text)
        assert 300 <= len(ids) <= 512
        nll[fmt, step] = mean_nll(llm, ids)
        llm.shutdown()
    assert kinds["auto"] == ("int4" if bf16_kernels() else "int8") and kinds["int8"] == "int8"
    ratios = {f"{fmt} in steps of {step}": math.exp(nll[fmt, step] - nll["float32", 512]) for fmt, step in runs[1:]}
    record_property("perplexity against float32", ", ".join(f"{k}: {r:.4f}x" for k, r in ratios.items()))
    for name, ratio in ratios.items():
        assert abs(ratio - 1) <= PPL_TOL, f"{name}: {ratio:.4f}x float32's perplexity"


def test_serve_option_reaches_the_engine_config():
    from kvship.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["serve"])).cpu_weight_format == "auto"
    args = build_parser().parse_args(["serve", "--cpu-weight-format", "float32"])
    assert config_from_args(args).cpu_weight_format == "float32"


def test_unknown_cpu_weight_format_is_refused():
    with pytest.raises(ValueError, match="cpu_weight_format must be one of auto, int4, int8, float32"):
        EngineConfig(cpu_weight_format="nf4")
