"""On a GPU: loading streams each checkpoint tensor into its place (the peak stays within 1 GiB
of the weights, for a mixture-of-experts shape in 16 bits and quantized to FP8 while loading),
and FP8 weights multiply on the FP8 tensor cores at every row count the engine runs (decode
batches, mixed steps, prefill chunks), never through a 16-bit copy of the matrix."""
import json

import pytest
import torch

from conftest import write_word_tokenizer
from kvship.kernels import quant_linear
from kvship.kernels.quant_linear import pack, quant_linear_torch, quant_linear_triton
from kvship.llm import LLM
from kvship.quant.insitu import quantize, quantize_fp8_blocks
from kvship.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# Qwen3-30B-A3B's layer (128 experts of 768, hidden 2048), 6 layers of its 48
A3B_LAYERS = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                  intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=6,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                  rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_moe_loading_peak_stays_within_a_gib_of_the_weights(tmp_path, quantization, record_property):
    (tmp_path / "config.json").write_text(json.dumps(A3B_LAYERS))
    write_word_tokenizer(tmp_path, A3B_LAYERS["vocab_size"])
    with LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", quantization=quantization, max_model_len=512,
             num_kv_blocks=64, max_num_seqs=8) as llm:
        runner = llm.engine.runner
        weights, peak = runner.weight_bytes, runner.loading_peak_bytes
        record_property(f"loading peak over weights ({quantization or 'bf16'})", f"{(peak - weights) / 2**30:.3f} GiB "
                        f"of {weights / 2**30:.2f} GiB")
        assert weights > ((2 << 30) if quantization else (4 << 30))  # the experts are there
        assert peak <= weights + (1 << 30), f"peak {peak / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB of weights"
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["per-row", "block"])
@pytest.mark.parametrize("rows", [2, 16, 100, 256, 300, 1024, 8192])
def test_fp8_weights_take_the_fp8_tensor_cores_at_every_row_count(monkeypatch, layout, rows):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 2048, generator=g) * 0.05
    qw = pack(quantize_fp8_blocks(w, 128) if layout == "block" else quantize(w, "fp8"), "cuda")
    x = torch.randn(rows, 2048, generator=g).to("cuda", torch.bfloat16)

    def no_copy(*a, **kw):
        raise AssertionError("an FP8 matrix was expanded to 16 bits")

    monkeypatch.setattr(quant_linear, "dequantize_triton", no_copy)
    got = quant_linear_triton(x, qw).float()
    ref = quant_linear_torch(x.float(), qw).float()
    # the activations' FP8 rounding is the difference (a few 1e-2 on such matrices)
    assert (got - ref).norm() / ref.norm() < 4e-2
