"""Quantized weights multiplied as int8 on the CPU (kernels/cpu_int8_linear.py, the default
``cpu_weight_format``): the product against its float reference, the bundled model's perplexity
against the float32 path on a fixed text (perplexity_text.txt, 386 tokens), and the option."""
import math
from pathlib import Path

import pytest
import torch

from kvship.config import EngineConfig
from kvship.kernels.cpu_int8_linear import GEMM_FROM_ROWS, CpuInt8Linear, Int8Rows, int8_linear_reference
from kvship.llm import LLM
from kvship.quant import quantize
from kvship.sampling_params import SamplingParams

TEXT = Path(__file__).with_name("perplexity_text.txt")
# Both paths' outputs are bfloat16 (8 significant bits), summed in their own order: a product
# within 1% of the reference's norm, where a wrong scale or transposed codes miss by 100%.
PRODUCT_TOL = 0.01
PPL_TOL = 0.01  # the bound for the quantized path against float32


@pytest.mark.parametrize("rows", [1, 3, GEMM_FROM_ROWS, 33])  # the int8 kernel, then the GEMM copy
@pytest.mark.parametrize("source", ["float", "int4 groups"])
def test_int8_product_matches_reference(rows, source):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 256, generator=g) * 0.05
    int8 = Int8Rows.of(quantize(w, "int4") if source == "int4 groups" else w)
    x = torch.randn(2, rows, 256, generator=g)
    want = int8_linear_reference(x, int8)
    got = CpuInt8Linear(int8)(x)
    assert got.shape == (2, rows, 96) and got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < PRODUCT_TOL
    # requantizing with a scale per row moves a weight by at most half that scale
    source_w = quantize(w, "int4").dequantize() if source == "int4 groups" else w
    assert ((int8.dequantize() - source_w).abs() <= int8.scales[:, None] / 2 + 1e-7).all()


def mean_nll(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [chosen.logprob for chosen, _ in out.prompt_logprobs]
    assert len(logprobs) == len(ids) - 1
    return -sum(logprobs) / len(logprobs)


@pytest.mark.timeout(600)
def test_bundled_model_int8_perplexity_within_one_percent_of_float32():
    """The prompt in steps of 512 tokens (the GEMM copy) and of 4 (the int8 kernel, as decodes)."""
    text = TEXT.read_text()
    nll = {}
    for fmt, step in (("float32", 512), ("int8", 512), ("int8", 4)):
        llm = LLM(device="cpu", cpu_weight_format=fmt, num_kv_blocks=32, max_num_batched_tokens=step,
                  prefill_join_tokens=step, enable_prefix_caching=False)
        model = llm.engine.runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert (qkv.cpu_int8 is not None) == (fmt == "int8")
        assert (model.lm_head.cpu_int8 is not None) == (fmt == "int8")  # the tied head too
        ids = llm.engine.tokenizer.encode(text)
        assert 300 <= len(ids) <= 512
        nll[fmt, step] = mean_nll(llm, ids)
        llm.shutdown()
    for step in (512, 4):
        ratio = math.exp(nll["int8", step] - nll["float32", 512])
        assert abs(ratio - 1) <= PPL_TOL, f"int8 perplexity in steps of {step}: {ratio:.4f}x float32's"


def test_serve_option_reaches_the_engine_config():
    from kvship.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["serve"])).cpu_weight_format == "float32"
    args = build_parser().parse_args(["serve", "--cpu-weight-format", "float32"])
    assert config_from_args(args).cpu_weight_format == "float32"


def test_unknown_cpu_weight_format_is_refused():
    with pytest.raises(ValueError, match="cpu_weight_format must be one of int8, float32"):
        EngineConfig(cpu_weight_format="int4")
