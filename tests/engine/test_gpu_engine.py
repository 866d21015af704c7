"""The engine on a GPU: Triton kernels + CUDA graphs agree with eager execution and with
transformers. Skipped without CUDA (run through the device tool:
`python -m pytest tests/engine/test_gpu_engine.py tests/models/test_models.py tests/kernels/test_kernels.py`).
Real-size bf16 paths are exercised by bench/latency.py and bench/throughput.py."""
import pytest
import torch

from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from test_models import assert_graph_step_equals_eager, gpu_greedy_agreement

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n=8):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 319, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


def test_gpu_greedy_matches_transformers(tiny_models):
    folder, ref = tiny_models["llama-gqa-tied"]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert llm.engine.runner.graphs is not None
    ps = prompts()
    agree = gpu_greedy_agreement(llm, ref, ps, 12)
    # tf32 dots may flip a near-tie in a random model; nearly all must be identical.
    assert agree >= len(ps) - 1
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_cuda_graph_replay_equals_eager(tiny_models):
    folder, _ = tiny_models["qwen3-qknorm"]
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    assert_graph_step_equals_eager(llm, prompts(11))  # 11 pads to the 16-wide graph


def test_gpu_seeded_sampling_reproducible(tiny_models):
    folder, _ = tiny_models["llama-mha-untied"]
    llm = LLM(str(folder), device="cuda", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    ps = prompts(4)
    p = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=16)
    alone = llm.generate([ps[2]], p)[0].outputs[0].token_ids
    mixed = llm.generate(ps, [SamplingParams(temperature=1.0, max_tokens=16)] * 2 + [p, GREEDY])
    assert mixed[2].outputs[0].token_ids == alone
