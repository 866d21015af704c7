"""The benchmarks' hybrid shapes (bench/common.py, bench/latency.py --context) on the CPU with
their tiny variants: random weights (load_format "dummy") in 16 bits and in-situ FP8, the
parameter, KV and recurrent-state counts the rooflines use against the model the engine builds,
and the long-context script end to end, as the GPU session runs it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import SHAPES, kv_bytes_per_token, param_count, state_bytes_per_token, write_shape_folder  # noqa: E402
from kvship.sampling_params import SamplingParams  # noqa: E402
from latency import bytes_per_token, main, start_engine  # noqa: E402


def engine(shape: str, fmt: str | None, root: Path):
    return start_engine(write_shape_folder(shape, root), 128, eager=True, quantization=fmt, device="cpu",
                        cpu_weight_format="float32")  # quantized weights held dequantized: the reference path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["hybrid-tiny", "hybrid-moe-tiny"])
def test_counts_match_the_built_model(shape, tmp_path):
    c = SHAPES[shape]
    llm = engine(shape, None, tmp_path)
    model = llm.engine.runner.model
    held = sum(p.numel() for p in model.parameters())
    unused = 0  # param_count counts the experts a token picks; the model holds them all
    if c.get("num_experts"):
        unused = (c["num_hidden_layers"] * 3 * c["hidden_size"] * c["moe_intermediate_size"]
                  * (c["num_experts"] - c["num_experts_per_tok"]))
    assert param_count(shape) == held - unused
    # a KV cache on the one full-attention layer of four; per DeltaNet layer 3 conv inputs in
    # bf16 and a float32 delta-rule matrix per value head, read and written
    assert kv_bytes_per_token(shape) == 1 * c["num_key_value_heads"] * 2 * c["head_dim"] * 2
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    delta = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    assert state_bytes_per_token(model, torch.bfloat16) == 2 * 3 * (3 * conv_dim * 2 + delta * 4)
    assert bytes_per_token(llm)[1] == state_bytes_per_token(model, torch.bfloat16)


def test_real_shapes_counts():
    """Qwen3.6-27B is 27B with its vision tower (26.9B without), Qwen3.6-35B-A3B 3B active."""
    assert 26.5e9 < param_count("qwen3.6-27b") < 27.5e9
    assert 3.0e9 < param_count("qwen3.6-35b-a3b") < 3.8e9
    assert kv_bytes_per_token("qwen3.6-27b") == 16 * 4 * 256 * 2 * 2  # 16 attention layers of 64
    assert kv_bytes_per_token("qwen3-32b") == 64 * 8 * 128 * 2 * 2


@pytest.mark.timeout(120)
def test_fp8_random_weights_quantize_every_projection(tmp_path):
    """The same seeded random weights, in 16 bits and in-situ FP8 (held dequantized on the CPU,
    the reference path): every projection of the DeltaNet, attention and MLP layers moved by
    the FP8 rounding, and no more than it allows; greedy decoding runs."""
    bf16, fp8 = engine("hybrid-tiny", None, tmp_path), engine("hybrid-tiny", "fp8", tmp_path)
    want = dict(bf16.engine.runner.model.named_parameters())
    checked = 0
    for name, p in fp8.engine.runner.model.named_parameters():
        if name.endswith("proj.weight") and "embed" not in name:
            ref = want[name].float()
            err = (p.float() - ref).abs().max() / ref.abs().max()
            assert 0 < err < 0.08, name
            checked += 1
    assert checked == 4 * 2 + 2 + 3 * 2  # mlp x 4, attention qkv/o, DeltaNet in/out x 3
    out = fp8.generate([list(range(2, 60))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_long_context_script(device, tmp_path, monkeypatch, capsys):
    """bench/latency.py --context as the GPU session calls it, on the tiny shapes (on the GPU:
    FP8 kernels, CUDA graphs and the roofline): one row per shape and context, each with a rate."""
    monkeypatch.setattr(sys, "argv", ["latency.py", "--shape", "hybrid-tiny", "--dense", "hybrid-moe-tiny",
                                      "--quantization", "fp8", "--context", "48", "20", "--output", "4",
                                      "--device", device])
    main()
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| hybrid")]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [("hybrid-tiny fp8", 20), ("hybrid-tiny fp8", 48),
                                                       ("hybrid-moe-tiny fp8", 20), ("hybrid-moe-tiny fp8", 48)]
    assert all(float(r[6]) > 0 for r in rows)
    if device == "cuda":  # a roofline from the bandwidth measured in the run
        assert all(float(r[5]) > 0 for r in rows)


def test_throughput_limit_counts_the_recurrent_state():
    """bench/throughput.py's workload limit: every generated token reads and writes its state."""
    from throughput import limit_seconds

    prompts, outs = [[5] * 10] * 3, [4, 5, 6]
    base = limit_seconds("qwen3.6-27b", prompts, outs, 8, 1e12, 1e15)
    with_state = limit_seconds("qwen3.6-27b", prompts, outs, 8, 1e12, 1e15, state_bytes=10**9)
    assert with_state - base == pytest.approx(15 * 1e9 / 1e12)
