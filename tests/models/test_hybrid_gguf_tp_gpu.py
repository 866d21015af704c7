"""The hybrid models' GGUF files and tensor parallelism on GPUs: a Qwen3.5 file with its
projections in Q8_0 blocks (kept quantized on the device, out_proj's value heads moved in their
blocks) against transformers on the same blocks dequantized, and two ranks (the Triton delta
rule over each rank's key heads, inside the decode graphs) against one. Skipped without CUDA
(two GPUs for the second; run through the device tool:
`python -m pytest tests/models/test_hybrid_gguf_tp_gpu.py`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from test_models import gpu_greedy_agreement
from test_models_qwen3_next import make_hybrid

pytestmark = pytest.mark.gpu
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 319, (n,), generator=g).tolist() for n in (3, 40, 21, 9, 64)]


@pytest.mark.timeout(600)
def test_quantized_gguf_on_gpu_matches_transformers(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    from test_loader_gguf_hybrid import interval_hybrid, write_gguf

    ref = interval_hybrid("qwen3_5", tmp_path / "st", linear_value_head_dim=32)
    path = tmp_path / "tiny-qwen35-Q8_0.gguf"
    write_gguf(path, ref, "qwen35", gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():  # the reference runs the file's blocks
        for name, p in ref.named_parameters():
            if p.dim() == 2 and ".layers." in name and "norm" not in name:
                q = quants.quantize(np.ascontiguousarray(p.numpy()), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).view_as(p))
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, block_size=16)
    assert llm.engine.runner.model.model.layers[0].linear_attn.out_proj.qweight is not None  # kept in blocks
    prompts = _prompts()
    assert gpu_greedy_agreement(llm, ref, prompts, PARAMS.max_tokens) >= len(prompts) - 1


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_two_ranks_equal_one_on_gpus(tmp_path, arch):
    make_hybrid(tmp_path / arch, arch)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, block_size=16)
    prompts = _prompts()
    tokens = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path / arch), tensor_parallel_size=tp, **kw)
        tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
        llm.engine.shutdown()
        del llm
    # tf32 dots and a two-way sum may flip a near-tie in a random model; nearly all must agree
    assert sum(a == b for a, b in zip(tokens[1], tokens[2])) >= len(prompts) - 1
