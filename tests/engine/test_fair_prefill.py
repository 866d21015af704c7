"""Chunked prefill shares each step's token budget: a short request that arrives while a long
prompt is part-way through its prefill starts in the next step and can finish before the long
prompt's prefill does, and neither's greedy output changes for it. Prompts finish one a step,
shortest remaining first, once a step is past the join size (prefill_join_tokens)."""
import pytest

from kvship.cli import build_parser, config_from_args
from kvship.config import (
    CPU_TOKEN_BUDGET,
    GPU_TOKEN_BUDGET,
    OFFLINE_SCHEDULE_POLICY,
    SERVE_PREFILL_JOIN_TOKENS,
    EngineConfig,
    default_token_budget,
)
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.core.scheduler import Scheduler
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from kvship.sequence import Sequence

BUDGET = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
LONG_TEXT = ("The history of clockmaking runs from water clocks and sundials to the pendulum, the "
             "balance spring and the quartz crystal; each step made time a little more exact. ") * 20


def _planned(batch) -> list[tuple[str, int]]:
    """(request id, tokens this step) of each sequence in the batch, in its order."""
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def _seq(request_id: str, n: int) -> Sequence:
    return Sequence(request_id, 0, list(range(1, n + 1)), SamplingParams())


def test_short_prompt_shares_the_budget_with_a_long_prefill():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=BUDGET)
    long, decode = _seq("long", 500), _seq("decode", 5)
    sched.add(decode)
    sched.add(long)
    batch = sched.schedule()  # the short prompt first, the long one takes the rest
    assert _planned(batch) == [("decode", 5), ("long", 59)]
    sched.commit(batch)
    short = _seq("short", 3)
    sched.add(short)
    batch = sched.schedule(in_flight={decode})  # decode's sampled token is still in flight
    # decodes first, then the waiting short prompt whole, then the long prompt's next chunk
    assert _planned(batch) == [("decode", 1), ("short", 3), ("long", BUDGET - 4)]
    sched.commit(batch)
    assert long.num_computed_tokens == 59 + BUDGET - 4 < long.num_prompt_tokens


def test_long_prefills_beside_decodes_take_at_most_their_share():
    """Beside a decode, a long prompt's chunk (more than four budgets left) is cut to
    prefill_beside_decodes while a shorter prompt still takes what it needs; alone, the long
    prompt takes the whole budget again."""
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=BUDGET, prefill_beside_decodes=16)
    chat, long = _seq("chat", 5), _seq("long", 500)
    sched.add(chat)
    sched.add(long)
    batch = sched.schedule()  # no decode yet: the whole budget
    assert _planned(batch) == [("chat", 5), ("long", 59)]
    sched.commit(batch)
    other = _seq("other", 40)
    sched.add(other)
    batch = sched.schedule(in_flight={chat})  # chat's first token is its next input
    assert _planned(batch) == [("chat", 1), ("other", 40), ("long", 16)]
    sched.commit(batch)
    for seq in (chat, other):
        sched.finish(seq, "stop")
    batch = sched.schedule()  # the long prompt alone again
    assert _planned(batch) == [("long", BUDGET)]


def test_cpu_default_share_beside_decodes():
    from kvship.config import default_prefill_beside_decodes

    assert default_prefill_beside_decodes("cpu", CPU_TOKEN_BUDGET) == 8
    assert default_prefill_beside_decodes("cuda", 8192) == 8192


def test_two_long_prefills_go_shortest_remaining_first():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=BUDGET)
    first, second = _seq("first", 300), _seq("second", 200)
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert _planned(batch) == [("second", BUDGET)]
    sched.commit(batch)
    while second.num_computed_tokens < second.num_prompt_tokens:  # second keeps the lead to its end
        batch = sched.schedule()
        assert batch.seqs[0] is second
        sched.commit(batch)
    assert 0 < first.num_computed_tokens  # the step that finished second's prompt gave first the rest


def _prefill_end_steps(sched: Scheduler, seqs: list[Sequence], steps: int = 10) -> dict[str, int]:
    """The step in which each sequence's prefill ends, its sampled token fed back as the next
    step's in-flight input (as the engine's overlapped loop does)."""
    ends: dict[str, int] = {}
    in_flight: set[Sequence] = set()
    for step in range(steps):
        batch = sched.schedule(in_flight)
        sampled = {s for s, n in zip(batch.seqs, batch.num_new_tokens)
                   if s.num_computed_tokens + n >= s.num_tokens + (s in in_flight)}
        sched.commit(batch)
        for s in in_flight:
            s.token_ids.append(7)
        for s in sampled:
            ends.setdefault(s.request_id, step)
        in_flight = sampled
        if len(ends) == len(seqs):
            break
    return ends


@pytest.mark.parametrize("join, want", [
    # one prompt ends a step, shortest first, equals in arrival order; the rest wait for the next
    (16, {"b": 0, "a": 1, "c": 2}),
    # sharing the whole budget: a and b end together in step 0, a's first token no sooner
    (None, {"b": 0, "a": 0, "c": 1}),
])
def test_prompts_finish_one_a_step_shortest_first(join, want):
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256, prefill_join_tokens=join)
    seqs = [_seq("a", 100), _seq("b", 60), _seq("c", 100)]
    for s in seqs:
        sched.add(s)
    assert _prefill_end_steps(sched, seqs) == want


def test_a_short_prompt_ends_first_and_a_long_one_fills_the_step_to_the_join_size():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=BUDGET, prefill_join_tokens=16)
    long, short = _seq("long", 500), _seq("short", 5)
    sched.add(long)
    batch = sched.schedule()  # alone, the long prompt takes the whole budget: no prompt ends here
    assert batch.num_new_tokens == [BUDGET]
    sched.commit(batch)
    sched.add(short)
    batch = sched.schedule()  # the short prompt ends: the long one goes on only up to 16 tokens in all
    assert _planned(batch) == [("short", 5), ("long", 11)]


@pytest.mark.parametrize("join", [None, 512])
def test_at_the_gpu_budget_64_decodes_run_beside_the_prompts_the_join_limit_lets_in(join):
    """serve.py's c=64 case at the GPU's budget: with 64 decodes running and three 1024-token
    prompts waiting, a step holds the decodes and all three prompts by default (they share the
    budget), and one whole prompt under a join limit (the next starts in the next step)."""
    config = EngineConfig(prefill_join_tokens=join)
    kv = KVCacheManager(num_blocks=8192, block_size=16)
    sched = Scheduler(kv, max_num_seqs=256, max_num_batched_tokens=default_token_budget("cuda"),
                      prefill_join_tokens=config.prefill_join_tokens)
    decodes = [_seq(f"d{i}", 8) for i in range(64)]
    for s in decodes:
        sched.add(s)
    sched.commit(sched.schedule())  # their prompts; their first tokens are now in flight
    for i in range(3):
        sched.add(_seq(f"p{i}", 1024))
    batch = sched.schedule(in_flight=set(decodes))
    prompts = 3 if join is None else 1
    assert batch.num_new_tokens == [1] * 64 + [1024] * prompts
    assert [s.request_id for s in batch.seqs[64:]] == [f"p{i}" for i in range(prompts)]


def test_longest_output_first_admits_by_max_tokens_after_the_prompts_under_way():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=BUDGET, schedule_policy="longest-output")
    begun = Sequence("begun", 0, list(range(1, 101)), SamplingParams(max_tokens=1))
    sched.add(begun)
    sched.commit(sched.schedule())  # part-way through its prompt: it goes on first
    outs = {"short": 5, "long": 300, "none": None, "mid": 40}
    for name, max_tokens in outs.items():
        sched.add(Sequence(name, 0, [1, 2, 3], SamplingParams(max_tokens=max_tokens)))
    batch = sched.schedule()
    # two free slots: no limit counts as the longest, then the most max_tokens; short and mid wait
    assert [s.request_id for s in batch.seqs] == ["begun", "none", "long"]
    assert [s.request_id for s in sched.waiting] == ["short", "mid"]


def test_default_budget_by_device():
    assert EngineConfig().max_num_batched_tokens is None
    assert default_token_budget("cpu") == CPU_TOKEN_BUDGET < default_token_budget("cuda")
    # offline, prompts share a step's whole budget; `kvship serve` limits what joins a step
    assert EngineConfig().prefill_join_tokens is None
    serve = build_parser().parse_args(["serve", "m"])
    assert config_from_args(serve).prefill_join_tokens == SERVE_PREFILL_JOIN_TOKENS < GPU_TOKEN_BUDGET
    # and admits by the shortest prefill (time to first token); `LLM` by the longest output
    assert config_from_args(serve).schedule_policy == "shortest-prefill" != OFFLINE_SCHEDULE_POLICY
    everything = build_parser().parse_args(["serve", "m", f"--prefill-join-tokens={GPU_TOKEN_BUDGET}"])
    assert config_from_args(everything).prefill_join_tokens == GPU_TOKEN_BUDGET


@pytest.fixture(scope="module")
def llm():
    # the serving order (`kvship serve`'s default): the offline one runs the prompt under way first
    return LLM(device="cpu", max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
               schedule_policy="shortest-prefill")


def test_short_request_finishes_while_a_long_prompt_is_in_prefill(llm):
    eng = llm.engine
    tok = llm.tokenizer
    long_ids = tok.encode(LONG_TEXT)
    short_ids = tok.encode("Hi there")
    assert len(long_ids) > 8 * BUDGET and len(short_ids) < 8
    long_alone = llm.generate([long_ids], GREEDY)[0].outputs[0].token_ids
    short_alone = llm.generate([short_ids], GREEDY)[0].outputs[0].token_ids

    eng.add_request("long", long_ids, GREEDY)
    events = [("long", out.finished, len(out.outputs[0].token_ids)) for out in eng.step()]
    long_seq = eng.outputs.requests["long"].choices[0].seq
    assert 0 < long_seq.num_computed_tokens < len(long_ids)  # part-way through its prefill
    eng.add_request("short", short_ids, GREEDY)
    finals = {}
    for _ in range(200):
        if not eng.has_work():
            break
        for out in eng.step():
            events.append((out.request_id, out.finished, len(out.outputs[0].token_ids)))
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
                if out.request_id == "short":  # the long prompt has not produced a token yet
                    assert long_seq.num_computed_tokens < len(long_ids), events
    assert not eng.has_work()
    first_long = next(i for i, (rid, _, n) in enumerate(events) if rid == "long" and n > 0)
    short_done = events.index(("short", True, len(short_alone)))
    assert short_done < first_long, events
    assert finals == {"long": long_alone, "short": short_alone}
    kv = eng.kv
    assert kv.num_free_blocks == kv.num_blocks
