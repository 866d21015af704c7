"""The hybrid models on a GPU: decode steps replayed from CUDA graphs (the recurrent-state slots
a graph input, padding rows on the scratch slot) give the same greedy tokens as eager steps and
as transformers, and prefix hits resume from state checkpoints through the Triton kernels. Skipped without CUDA (run through the device tool:
`python -m pytest tests/models/test_qwen3_next_gpu.py`)."""
from __future__ import annotations

import pytest
import torch

from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from test_models import gpu_greedy_agreement
from test_models_qwen3_next import make_hybrid

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_graph_decode_matches_eager_and_transformers(tmp_path, arch):
    ref = make_hybrid(tmp_path / arch, arch)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 319, (n,), generator=g).tolist() for n in (3, 40, 21, 9, 64)]  # 5 pad to 8
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, block_size=16, num_kv_blocks=64)

    eager = LLM(str(tmp_path / arch), enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    del eager

    llm = LLM(str(tmp_path / arch), **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.inputs.state_scratch == runner.num_state_slots
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a, **k: replays.append(1) or run(*a, **k)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len(replays) >= params.max_tokens - 2  # the decode steps went through the graphs
    assert got == want
    # a second round on the same slots: what padding rows wrote went to the scratch slot only;
    # its prompts resume from the state checkpoints at their last full blocks (the Triton path)
    again = llm.generate(prompts[:3], params)
    assert [o.num_cached_tokens for o in again] == [0, 32, 16]
    assert [o.outputs[0].token_ids for o in again] == want[:3]
    # tf32 dots may flip a near-tie in a random model; nearly all must be identical
    assert gpu_greedy_agreement(llm, ref, prompts, params.max_tokens) >= len(prompts) - 1
