"""The prefix cache of the hybrid models (core/state_checkpoints.py): a hit resumes from a
recurrent-state checkpoint and gives transformers' greedy tokens; a shared prefix whose state was
not checkpointed is hit only up to the last checkpoint before it (or not at all); preempted
sequences come back through their own checkpoints; a hit over two tensor-parallel ranks. On CPU,
tiny random Qwen3.5 against transformers; the pool's bookkeeping and the chunk policy on their own."""
from __future__ import annotations

import pytest
import torch

from kvship.core.state_checkpoints import StateCheckpoints, aligned_chunk
from kvship.sampling_params import SamplingParams
from test_models_qwen3_next import greedy_reference, make_hybrid

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid-prefix") / "qwen3_5"
    return folder, make_hybrid(folder, "qwen3_5")


def test_checkpoint_pool_is_bounded_lru():
    pool = StateCheckpoints(first_slot=9, num_slots=2)
    a, b = pool.keep(101), pool.keep(102)
    assert sorted([a, b]) == [9, 10] and pool.keep(101) is None  # kept already: nothing to copy
    assert pool.take(101) == a  # 101 used last: 102 is the least recently used
    assert pool.keep(103) == b and 102 not in pool and 101 in pool and len(pool) == 2
    assert StateCheckpoints(first_slot=3, num_slots=0).keep(7) is None


@pytest.mark.parametrize("start,n,num_tokens,want", [
    (0, 16, 45, 16),  # a chunk of a long prompt: ends on a block boundary already
    (0, 14, 45, 12),  # ... cut back to one
    (32, 13, 45, 12),  # the prompt's rest: stops at its last full block (44), the tail next step
    (44, 1, 45, 1),  # the tail
    (0, 3, 45, 3),  # no boundary inside the step
    (0, 4, 4, 4),  # a one-block prompt: its last token is computed in the step anyway
])
def test_prefill_chunks_end_on_block_boundaries(start, n, num_tokens, want):
    assert aligned_chunk(start, n, num_tokens, 4) == want


def _llm(folder, **kw):
    from kvship.llm import LLM

    return LLM(str(folder), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16,
               max_model_len=128, **kw)


@pytest.mark.timeout(300)
def test_prefix_hit_resumes_from_a_checkpoint(qwen3_5):
    """A's 45-token prompt is prefilled 16 a step: checkpoints at 16, 32 and 44 (its last full
    block). B shares A's first 40 tokens: its KV blocks are cached to 40, the state only at 32.
    C shares 12 tokens (no checkpoint): no hit. D continues A's prompt: a hit at 44."""
    folder, ref = qwen3_5
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 320, (45,), generator=g).tolist()
    b = a[:40] + torch.randint(0, 320, (7,), generator=g).tolist()
    c = a[:12] + torch.randint(0, 320, (18,), generator=g).tolist()
    d = a + torch.randint(0, 320, (6,), generator=g).tolist()
    llm = _llm(folder, num_kv_blocks=128)
    assert llm.engine.config.enable_prefix_caching and llm.engine.kv.checkpoints is not None
    runner = llm.engine.runner
    assert runner.model.state_layers()[0].conv_state.shape[0] == runner.num_state_slots + 1 + runner.num_state_checkpoints
    cached, tokens = [], []
    for prompt in (a, b, c, d):  # one at a time: each sees what the ones before left
        out = llm.generate([prompt], GREEDY)[0]
        cached.append(out.num_cached_tokens)
        tokens.append(out.outputs[0].token_ids)
    assert cached == [0, 32, 0, 44]
    assert tokens == greedy_reference(ref, [a, b, c, d], GREEDY.max_tokens)
    kv = llm.engine.kv
    assert sorted(kv.free_state_slots) == list(range(kv.num_state_slots))
    assert set(kv.checkpoints.by_hash.values()) <= set(runner.state_checkpoint_slots)


@pytest.mark.timeout(300)
def test_evicted_checkpoints_shorten_the_hit(qwen3_5):
    """One checkpoint slot: A's last one (44) pushes its earlier ones out, so B (sharing 40
    tokens) finds cached KV blocks but no state to resume from, and computes everything."""
    folder, ref = qwen3_5
    g = torch.Generator().manual_seed(6)
    a = torch.randint(0, 320, (45,), generator=g).tolist()
    b = a[:40] + torch.randint(0, 320, (7,), generator=g).tolist()
    llm = _llm(folder, num_kv_blocks=128, num_state_checkpoints=1)
    outs = [llm.generate([p], GREEDY)[0] for p in (a, b)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks and len(llm.engine.kv.cached) >= 10
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference(ref, [a, b], GREEDY.max_tokens)


@pytest.mark.timeout(300)
def test_preempted_sequences_resume_from_their_checkpoints(qwen3_5):
    """Too few KV blocks for all three: the newest are preempted and, admitted again, hit their
    own cached prefix, their state restored from a checkpoint; greedy tokens as transformers'."""
    folder, ref = qwen3_5
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (20, 24, 18)]
    llm = _llm(folder, num_kv_blocks=22, max_num_seqs=4, num_state_checkpoints=8)
    runner = llm.engine.runner
    restores = []
    copy = runner.copy_states
    runner.copy_states = lambda copies: (restores.extend(copies), copy(copies))  # counts restores and saves
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    restored = [(src, dst) for src, dst in restores if src in runner.state_checkpoint_slots]
    assert restored, "no preempted sequence resumed from a checkpoint"
    assert ours == greedy_reference(ref, prompts, 12)
    assert sorted(llm.engine.kv.free_state_slots) == list(range(llm.engine.kv.num_state_slots))


@pytest.mark.timeout(300)
def test_prefix_hit_with_tensor_parallelism(qwen3_5):
    """Two ranks, each holding its heads' share of every state slot: the checkpoint copies go to
    the other rank with the step, so B resumes at A's checkpoint (32) on both."""
    folder, ref = qwen3_5
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 320, (45,), generator=g).tolist()
    b = a[:40] + torch.randint(0, 320, (7,), generator=g).tolist()
    llm = _llm(folder, num_kv_blocks=64, max_num_seqs=4, num_state_checkpoints=4, tensor_parallel_size=2)
    try:
        outs = [llm.generate([p], GREEDY)[0] for p in (a, b)]
    finally:
        llm.engine.shutdown()
    assert [o.num_cached_tokens for o in outs] == [0, 32]
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference(ref, [a, b], GREEDY.max_tokens)
