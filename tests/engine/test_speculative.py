"""Speculative decoding on the bundled SmolLM2: every output identical to plain decoding (greedy,
seeded sampling, penalties, logprobs, stop strings, n > 1, max_tokens) while the batch is
chunked, preempted and hits the prefix cache; KV blocks all free afterwards; the verify rule's
distribution checked statistically on its own."""
import pytest
import torch

from kvship.config import EngineConfig
from kvship.core.ngram import NgramProposer
from kvship.llm import LLM
from kvship.runner.rejection import sample_and_verify
from kvship.runner.sampler import Sampler
from kvship.sampling_params import SamplingParams
from kvship.sequence import Sequence

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Copy-heavy texts (n-gram lookup finds their continuations) beside ordinary questions.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return",
    "The cat sat on the mat. The dog sat on the mat. The bird sat on the",
    "Hi",
    "Repeat exactly: red green blue red green blue red green",
    "What is the capital of France?",
    "Monday, Tuesday, Wednesday, Monday, Tuesday,",
    "Write a haiku about the sea.",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14)
# One request of each kind the verify must leave unchanged.
MIXED = [
    GREEDY,
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=14),
    SamplingParams(temperature=0.0, max_tokens=5),  # a cap below k + 1 tokens away
    SamplingParams(temperature=0.0, max_tokens=14, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=14, stop=[" Paris"]),
    SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=10),
    GREEDY,
    SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=14, ignore_eos=True),
]


def engine_options(num_kv_blocks=14, **extra):
    # 14 blocks of 16 tokens cannot hold all ten sequences at once (preemption, in the shortest
    # prompts' order); a budget of 24 tokens a step chunks the longer prompts. float32 weights: the
    # int8 format's product takes another kernel from a few rows on, so a verify step's logprobs
    # would not be a decode's.
    return dict(device="cpu", cpu_weight_format="float32", num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24,
                schedule_policy="shortest-prefill", **extra)


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
            for o in llm.generate(prompts, params)]


def assert_all_blocks_released(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)


@pytest.fixture(scope="module")
def plain():
    return LLM(**engine_options())


@pytest.fixture(scope="module")
def ngram():
    return LLM(**engine_options(speculative_config=NGRAM))


@pytest.fixture(scope="module")
def plain_greedy(plain):
    return outputs(plain, PROMPTS, GREEDY)


@pytest.mark.timeout(1200)
def test_ngram_outputs_identical_to_plain_decoding(plain, ngram, plain_greedy):
    want = outputs(plain, PROMPTS, MIXED)
    got = outputs(ngram, PROMPTS, MIXED)
    for w, g in zip(want, got):
        assert [c[:3] for c in g] == [c[:3] for c in w]
        for (_, _, _, lw), (_, _, _, lg) in zip(w, g):  # logprobs: the same tokens, values to round-off
            assert (lw is None) == (lg is None)
            for (cw, aw), (cg, ag) in zip(lw or [], lg or []):
                assert cg.token_id == cw.token_id and cg.logprob == pytest.approx(cw.logprob, abs=1e-4)
                assert [a.token_id for a in ag] == [a.token_id for a in aw]
    assert [len(c[0]) for c in got[2]] == [5]  # never past max_tokens
    stats = ngram.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]
    assert ngram.engine.scheduler.num_preemptions > 0
    assert_all_blocks_released(ngram)
    # The same prompts again: prefix-cache hits, the same greedy tokens.
    hits = ngram.engine.kv.prefix_hits
    assert outputs(ngram, PROMPTS, GREEDY) == plain_greedy
    assert ngram.engine.kv.prefix_hits > hits
    assert_all_blocks_released(ngram)
    # Prompts that continue the outputs: their hits include blocks that verify steps filled.
    tok = ngram.tokenizer
    longer = [tok.encode(p) + c[0][0] for p, c in zip(PROMPTS, plain_greedy)]
    hits = ngram.engine.kv.prefix_hits
    assert outputs(ngram, longer, GREEDY) == outputs(plain, longer, GREEDY)
    assert ngram.engine.kv.prefix_hits > hits
    assert_all_blocks_released(ngram)


@pytest.mark.timeout(600)
def test_grammar_requests_speculate_within_their_grammar(plain, ngram):
    from kvship.sampling_params import StructuredOutput

    prompts = ["Repeat the digits: 12345 12345 12345 12345", 'Copy: {"a": 1, "b": 2} {"a": 1, "b": 2}']
    params = [SamplingParams(temperature=0, max_tokens=16, structured=StructuredOutput("regex", r"[0-9 ]{1,16}")),
              SamplingParams(temperature=0.7, seed=2, max_tokens=16, structured=StructuredOutput(
                  "json", '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}'))]
    before = ngram.engine.speculator.stats.num_accepted_tokens
    got = outputs(ngram, prompts, params)
    assert got == outputs(plain, prompts, params)
    assert ngram.engine.speculator.stats.num_accepted_tokens > before
    assert all(c[0][0] for c in got)
    assert_all_blocks_released(ngram)


@pytest.mark.timeout(600)
def test_abort_with_speculation_frees_every_block(ngram):
    eng = ngram.engine
    tok = ngram.tokenizer
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"abort-{i}", tok.encode(p), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng.speculator.stats.num_drafts > 0
    for i in range(4):
        eng.abort(f"abort-{i}")
    assert not eng.has_work()
    assert_all_blocks_released(ngram)


@pytest.mark.timeout(1200)
def test_draft_model_drafting_for_itself_accepts_everything(bundled, plain_greedy):
    # fewer blocks: greedy sequences that end early leave room that the mixed set does not
    llm = LLM(**engine_options(8, speculative_config={"model": bundled, "num_speculative_tokens": 3}))
    assert outputs(llm, PROMPTS, GREEDY) == plain_greedy
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # acceptance 1.0
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_released(llm)
    draft = llm.engine.speculator.proposer
    assert not draft.shadows and draft.kv.num_free_blocks == draft.kv.num_blocks


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, bundled):
    from conftest import make_tiny_model

    make_tiny_model(tmp_path / "tiny", "llama-gqa-tied")
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(str(tmp_path / "tiny"), device="cpu", num_kv_blocks=8,
            speculative_config={"model": bundled, "num_speculative_tokens": 2})


def test_verify_keeps_the_target_distribution():
    """A proposal d is kept with probability p(d); the token that comes out is distributed as
    p whatever d is (rejection sampling with q one-hot). 20000 draws: each probability within
    0.015 (about 5 standard deviations of the largest)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    p = torch.softmax(logits, -1)[0]
    params = SamplingParams(temperature=1.0)
    n, draft = 20000, 1
    seqs = []
    for _ in range(n):
        s = Sequence("r", 0, [0], params)
        s.draft_token_ids = [draft]
        seqs.append(s)
    # each sequence's two rows: the proposal's (checked) and the bonus row after it
    rows = torch.cat([logits, torch.zeros(1, 6)]).repeat(n, 1)
    verified = sample_and_verify(Sampler(), rows, seqs)
    first = torch.tensor([v.token_ids[0] for v in verified])
    freq = torch.bincount(first, minlength=6).float() / n
    assert torch.allclose(freq, p, atol=0.015), (freq, p)
    accepted = sum(v.num_accepted for v in verified) / n
    assert accepted == pytest.approx(p[draft].item(), abs=0.015)
    assert all(len(v.token_ids) == v.num_accepted + 1 for v in verified)


def test_seeded_verify_rewinds_to_plain_decoding():
    """A seeded sequence's tokens are the ones plain decoding draws from the same seed."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)
    plain_gen = torch.Generator().manual_seed(5)
    plain = [Sampler()(logits[i:i + 1], [_row(params, plain_gen)]).token_ids[0] for i in range(4)]
    seq = Sequence("r", 0, [0], params, generator=torch.Generator().manual_seed(5))
    seq.draft_token_ids = [plain[0], (plain[1] + 1) % 50, 7]  # the second is wrong
    v = sample_and_verify(Sampler(), logits, [seq])[0]
    assert v.token_ids == plain[:2] and v.num_accepted == 1
    seq.draft_token_ids = []
    # the generator continues as plain decoding's after two tokens
    assert sample_and_verify(Sampler(), logits[2:3], [seq])[0].token_ids == [plain[2]]


def _row(params, gen):
    from kvship.runner.sampler import SamplerRow

    return SamplerRow(params, (), (), gen)


def test_roll_back_never_caches_a_rejected_position():
    """A sequence that ends on the token sampled after a rejected proposal: the block that token
    completes holds the proposal's KV at its position, so it must not enter the prefix cache."""
    from kvship.core.kv_cache_manager import KVCacheManager
    from kvship.core.speculative import roll_back

    kv = KVCacheManager(8, 4)
    seq = Sequence("r", 0, list(range(11)), SamplingParams())  # positions 0..10, 10 is the decode input
    seq.num_computed_tokens = 10
    seq.draft_token_ids = [50, 51, 52]  # positions 11..13
    assert kv.allocate(seq, 4)
    seq.num_computed_tokens += 4  # the verify step launched
    roll_back(kv, seq, 0)  # the first proposal rejected: position 11 gets another token
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3
    seq.token_ids.append(60)
    third = seq.block_table[2]
    kv.free(seq)  # the sequence ends on that token
    assert kv.blocks[third].hash is None
    assert len(kv.cached) == 2


def test_ngram_lookup():
    look = NgramProposer(1, 3)
    assert look.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # the longest suffix that recurs: [1, 2]
    assert look.propose([1, 2, 3], 2) == []
    assert look.propose([5, 6, 5], 4) == [6, 5]  # no more tokens than the text holds


@pytest.mark.parametrize("bad, message", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "nope", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
    ("{not json", "not valid JSON"),
])
def test_bad_config_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=bad)


def test_mtp_without_mtp_layers_is_refused_clearly():
    """The bundled model has no MTP layers (tests/engine/test_mtp.py runs a model with one)."""
    with pytest.raises(ValueError, match="mtp.*no multi-token-prediction layers"):
        LLM(device="cpu", num_kv_blocks=4, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_ngram_outputs_identical(bundled):
    """On the GPU the verify steps replay the verify graphs (the prefill kernels over k + 1 rows a
    sequence) and plain decoding the decode graphs: in float32 the greedy and seeded tokens still agree."""
    with LLM(**GPU_OPTIONS) as plain:
        want = outputs(plain, PROMPTS, MIXED)
    with LLM(**GPU_OPTIONS, speculative_config=NGRAM) as spec:
        assert [[c[:3] for c in o] for o in outputs(spec, PROMPTS, MIXED)] == [[c[:3] for c in o] for o in want]
        assert spec.engine.speculator.stats.num_accepted_tokens > 0
        assert_all_blocks_released(spec)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_draft_model_drafting_for_itself(bundled):
    with LLM(**GPU_OPTIONS) as plain:
        want = outputs(plain, PROMPTS, GREEDY)
    # the draft's cache has as many blocks as the target's, beside the target's share of memory
    with LLM(**GPU_OPTIONS, speculative_config={"model": bundled, "num_speculative_tokens": 3}) as spec:
        assert outputs(spec, PROMPTS, GREEDY) == want
        stats = spec.engine.speculator.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        assert_all_blocks_released(spec)


GPU_OPTIONS = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3)


def test_cli_flag(capsys):
    from kvship.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}'])
    spec = config_from_args(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size) == ("ngram", 3, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'])
    assert "method must be one of" in capsys.readouterr().err


TINY = {
    # every layer over a 16-token window: blocks out of it are given back while proposals come and go
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=16)),
    # multi-head latent attention: the verify's multi-token queries on the latent cache
    "deepseek-v3": ("DeepseekV3Config", dict(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=24, q_lora_rank=24, num_experts_per_tok=3,
        n_group=4, topk_group=2, norm_topk_prob=True)),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", TINY)
def test_tiny_models_identical_with_ngram(tmp_path, arch):
    """Random tiny checkpoints (proposals mostly rejected: every step rolls back), prompts that
    repeat a pattern, block size 4, chunked prefill and preemption."""
    from conftest import make_tiny_model

    make_tiny_model(tmp_path / arch, arch, seed=1, spec=TINY[arch])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 318, (n,), generator=g).tolist() * r for n, r in ((6, 4), (3, 7), (11, 2), (5, 1))]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    opts = dict(device="cpu", block_size=4, num_kv_blocks=15, max_num_batched_tokens=16, max_model_len=256)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path / arch), **opts).generate(prompts, params)]
    spec = LLM(str(tmp_path / arch), **opts, speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections happened
    assert spec.engine.scheduler.num_preemptions > 0
    assert_all_blocks_released(spec)
