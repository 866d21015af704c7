"""The engine on a GPU: Triton kernels + CUDA graphs give transformers' greedy tokens on real
weights, and graph replay equals eager execution. Skipped without CUDA (run through the
device tool: `python -m pytest tests/test_gpu_engine.py`)."""
import pytest
import torch

from kvship.core.scheduler import ScheduledBatch
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams

from test_engine import GREEDY, prompts, reference  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_gpu_greedy_matches_transformers(prompts, reference):  # noqa: F811
    llm = LLM(device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=16)
    assert llm.engine.runner.graphs is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == reference
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_cuda_graph_replay_equals_eager(prompts):  # noqa: F811
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=16)
    eng, runner = llm.engine, llm.engine.runner
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()  # all prompts prefilled (well within the token budget): the next step is pure decode
    batch = eng.scheduler.schedule()
    assert set(batch.num_new_tokens) == {1} and len(batch) == len(prompts)
    graphs = runner.graphs
    with_graph = runner.run(batch)
    runner.graphs = None
    eager = runner.run(ScheduledBatch(batch.seqs, batch.num_new_tokens))
    runner.graphs = graphs
    torch.testing.assert_close(with_graph, eager, atol=2e-2, rtol=2e-2)
    assert (with_graph.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.75


def test_gpu_seeded_sampling_reproducible(prompts):  # noqa: F811
    llm = LLM(device="cuda", max_model_len=1024, max_num_seqs=16)
    p = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=16)
    alone = llm.generate([prompts[2]], p)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[:4], [SamplingParams(temperature=1.0, max_tokens=16)] * 2 + [p, GREEDY])
    assert mixed[2].outputs[0].token_ids == alone
