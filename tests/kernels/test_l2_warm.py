"""The L2 experiment (kernels/l2_warm.py, layers/prefetch.py; off unless KVSHIP_L2_WARM names a
program count): the warming kernel reads a tensor's words and changes nothing, in the interpreter
on CPU; the matrices it would read are a layer's linear weights (codes and scales when quantized);
nothing is warmed outside a one-token graph capture; and on a GPU a Qwen3-MoE model decoding one
sequence at a time in CUDA graphs with the experiment on gives transformers' greedy tokens."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import l2_warm
from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.quant_linear import pack
from kvship.layers import prefetch
from kvship.layers.linear import QKVParallelLinear, RowParallelLinear
from kvship.parallel import TPContext
from kvship.quant import quantize
from sm90_compile import compile_in_child

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()


def test_warming_reads_every_word_and_writes_nothing():
    t = torch.randn(3, 1000, dtype=torch.bfloat16)  # 1,500 words: a partial last block of 2,048
    before, sink = t.clone(), torch.zeros(1, dtype=torch.int32)
    l2_warm._launch(t, 3, sink)
    l2_warm._launch(torch.ones(3, dtype=torch.bfloat16), 2, sink)  # 6 bytes: left out
    assert torch.equal(t, before) and sink.item() == 0
    l2_warm.warm_l2([t], 4, sink)  # CPU tensors: nothing to warm, no launch
    assert torch.equal(t, before)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        tp = TPContext()
        self.qkv_proj = QKVParallelLinear(64, 16, 4, 2, False, tp)
        self.o_proj = RowParallelLinear(64, 64, False, tp)
        self.q_norm = torch.nn.LayerNorm(16)  # a vector weight: not a matrix


def test_matrices_are_the_linear_weights():
    attn = _Attention()
    assert [w.shape for w in prefetch.matrices(attn)] == [(128, 64), (64, 64)]


def test_matrices_of_quantized_linears_are_codes_and_scales():
    attn = _Attention()
    attn.o_proj.qweight = pack(quantize(torch.randn(64, 64), "fp8"), "cpu")  # as _finish packs it on a GPU
    got = prefetch.matrices(attn)
    assert [(t.dtype, tuple(t.shape)) for t in got] == [
        (torch.float32, (128, 64)), (torch.float8_e4m3fn, (64, 64)), (attn.o_proj.qweight.scales.dtype, (64, 1))]


def test_nothing_is_warmed_outside_a_graph_capture(monkeypatch):
    monkeypatch.setattr(prefetch, "PROGRAMS", 32)
    layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(3))
    assert prefetch.warmers(layers, 1, object()) == [None, None, None]  # (a stream: the experiment on)


@pytest.mark.timeout(600)
def test_warming_kernel_compiles_for_sm90():
    compile_in_child([{"kernel": "kvship.kernels.l2_warm:_warm_kernel",
                       "types": {"w_ptr": "*i32", "n": "i32", "sink_ptr": "*i32"}, "constexprs": {"BLOCK": 2048},
                       "divisible": ["w_ptr"], "options": {"num_warps": 8}}])


@pytest.mark.gpu
def test_moe_model_warming_in_cuda_graphs_matches_transformers(tiny_models, monkeypatch):
    from kvship.llm import LLM
    from kvship.sampling_params import SamplingParams

    monkeypatch.setattr(prefetch, "PROGRAMS", 32)  # before the model is built: its side stream
    folder, ref = tiny_models["qwen3-moe"]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.model.model.warm_stream is not None
    g = torch.Generator().manual_seed(5)
    agree = 0
    for n in (3, 21, 40):  # one sequence at a time: its decode steps replay the one-token graph
        p = torch.randint(0, 319, (n,), generator=g).tolist()
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        agree += out.outputs[0].token_ids == want
    assert agree >= 2
