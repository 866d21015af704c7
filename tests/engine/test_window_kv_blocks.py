"""A window-only model (every layer slides over the same window, as Mistral v0.1) gives back
the KV blocks out of its window while it runs: greedy tokens equal to transformers and, with
their log-probabilities, to the same engine keeping every block; the blocks a sequence holds
stay bounded through chunked prefill and a long generation, batched with other requests, on a
prefix-cache hit and under preemption. Gemma (global layers among the local ones) keeps all."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from kvship.llm import LLM
from kvship.models.config import ModelConfig
from kvship.sampling_params import InvalidParamsError, SamplingParams

WINDOW, BLOCK, CHUNK = 16, 4, 16
NEW_TOKENS = 60
# A decode step reads its last WINDOW positions: at most WINDOW / BLOCK + 1 blocks. A prefill
# chunk from position p reads p - WINDOW + 1 .. p + CHUNK - 1.
DECODE_BLOCKS = WINDOW // BLOCK + 1
CHUNK_BLOCKS = -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
pytestmark = pytest.mark.timeout(300)  # each test takes seconds on two idle cores, the reference included


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral-window") / "m"
    ref = make_tiny_model(folder, "mistral", seed=3,
                          spec=("MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW)))
    return folder, ref


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, 319, (n,), generator=g).tolist() for n in (5, 23, 50)]  # the last: 4 chunks


@pytest.fixture(scope="module")
def reference(mistral, prompts):
    _, ref = mistral
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def engine(folder, num_kv_blocks=128, keep_all_blocks=False, **config):
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=num_kv_blocks,
              max_num_batched_tokens=CHUNK, max_model_len=256, **config)
    assert llm.engine.kv.window == WINDOW
    if keep_all_blocks:
        llm.engine.kv.window = None
    return llm


def run(llm, prompts, params=GREEDY):
    """Outputs in prompt order, and the most blocks any one sequence held after a step (with
    the position it had computed up to then)."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done, most = {}, (0, 0)
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        for s in eng.scheduler.running:
            most = max(most, (len(s.block_table), s.num_computed_tokens))
    return [done[f"r{i}"] for i in range(len(prompts))], most


def assert_all_blocks_free(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and all(b.ref_count == 0 for b in kv.blocks)


def test_greedy_matches_transformers_and_keeping_every_block(mistral, prompts, reference):
    folder, _ = mistral
    llm = engine(folder)
    outs, (held, _) = run(llm, prompts)
    assert [o.token_ids for o in outs] == reference
    assert held <= CHUNK_BLOCKS  # a sequence of 110 tokens (28 blocks) held at most 9
    assert_all_blocks_free(llm)
    kept, (kept_held, _) = run(engine(folder, keep_all_blocks=True), prompts)
    assert kept_held > 3 * held  # 27 blocks
    # The masked positions contribute exactly nothing: the log-probabilities agree to the bit.
    assert [o.logprobs for o in outs] == [o.logprobs for o in kept]


def test_decode_holds_the_window_and_prefix_hit(mistral, prompts, reference):
    """One long prompt alone: once its prefill is done, it holds DECODE_BLOCKS at the most.
    Sent again, the prefix cache serves the blocks its last chunk reads (48 tokens computed)."""
    folder, _ = mistral
    llm = engine(folder)
    kv = llm.engine.kv
    outs, _ = run(llm, prompts[2:], SamplingParams(temperature=0, max_tokens=1))
    hits = kv.prefix_hits
    peak = 0
    eng = llm.engine
    eng.add_request("again", prompts[2], GREEDY)
    out = None
    while eng.has_work():
        for o in eng.step():
            out = o.outputs[0] if o.finished else out
        for s in eng.scheduler.running:
            if s.num_computed_tokens >= s.num_prompt_tokens:
                peak = max(peak, len(s.block_table))
                assert kv.num_used_blocks == len(s.block_table)  # the used-blocks metric counts only those
    assert kv.prefix_hits - hits == 48
    assert out.token_ids == reference[2] and peak == DECODE_BLOCKS
    assert_all_blocks_free(llm)


def test_longer_than_the_cache_and_preemption(mistral, prompts, reference):
    """12 blocks (48 tokens) run three sequences of up to 110 tokens: each gives back what left
    its window, and when the three outgrow the cache the newest is preempted and recomputed.
    Keeping every block, the 50-token prompt would not even be accepted."""
    folder, _ = mistral
    for caching in (False, True):
        llm = engine(folder, num_kv_blocks=12, enable_prefix_caching=caching)
        outs, (held, _) = run(llm, prompts)
        assert [o.token_ids for o in outs] == reference
        assert llm.engine.scheduler.num_preemptions > 0 and held <= CHUNK_BLOCKS
        assert_all_blocks_free(llm)
    with pytest.raises(InvalidParamsError, match="does not fit in the KV cache"):
        run(engine(folder, num_kv_blocks=12, keep_all_blocks=True), prompts[2:])


def test_only_a_window_on_every_layer_frees_blocks():
    base = dict(architectures=["MistralForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=10)
    assert ModelConfig.from_hf({**base, "sliding_window": 32}).kv_window == 32
    assert ModelConfig.from_hf(base).kv_window is None
    gemma = dict(base, architectures=["Gemma2ForCausalLM"], sliding_window=32)  # local and global layers
    assert ModelConfig.from_hf(gemma).kv_window is None


@pytest.mark.gpu
def test_on_the_gpu_kernels_read_only_held_blocks(mistral, prompts, reference):
    """The Triton kernels (decode in CUDA graphs) with blocks given back: the table entries before
    the held ones point at a held block, and the tokens stay transformers' (fp32; one near-tie
    flip tolerated, as in the other GPU comparisons). Blocks of 16, the kernels' size."""
    folder, _ = mistral
    llm = LLM(str(folder), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=CHUNK, max_model_len=256)
    assert llm.engine.kv.window == WINDOW and llm.engine.runner.graphs is not None
    outs, (held, _) = run(llm, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert sum(o.token_ids == want for o, want in zip(outs, reference)) >= len(prompts) - 1
    assert held <= -(-(WINDOW - 1 + CHUNK) // 16) + 1  # the chunked prefill's bound, in blocks of 16
    assert_all_blocks_free(llm)
