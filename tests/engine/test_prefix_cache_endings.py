"""Every full block a request computed enters the prefix cache, however the request ends: by
length in its prefill step or in decode, on a stop string, on eos or a stop token, or aborted
after its prefill. A second request with the same prompt then hits every full block of it."""
import pytest

from kvship.llm import LLM
from kvship.sampling_params import SamplingParams

BLOCK = 16
PROMPT_LEN = 53  # 3 full blocks; the last prompt token is always computed, never looked up
FULL = (PROMPT_LEN - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def llm(tiny_models):
    folder, _ = tiny_models["llama-gqa-tied"]
    return LLM(str(folder), device="cpu", block_size=BLOCK, num_kv_blocks=128, max_model_len=256)


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 300 + 1 for i in range(PROMPT_LEN)]


def _hits_of_second_send(llm, prompt: list[int]) -> int:
    """Prefix-cache tokens hit by a fresh request with this prompt."""
    kv = llm.engine.kv
    before = kv.prefix_hits
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return kv.prefix_hits - before


# Seeded sampling: the tiny random model's greedy output repeats one token, and these tests need
# a token that appears for the first time after the first step.
SAMPLED = dict(temperature=1.0, seed=7)


def _sampled(llm, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, ignore_eos=True, **SAMPLED)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_length_in_the_prefill_step(llm):
    p = _prompt(1)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    assert _hits_of_second_send(llm, p) == FULL


def test_length_in_decode(llm):
    p = _prompt(2)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert _hits_of_second_send(llm, p) == FULL


def _ending_in_decode(llm, seed: int) -> tuple[list[int], list[int]]:
    """A prompt, and its sampled tokens up to the first one (after the first) that is new: a
    stop on that token ends the same seeded request in a decode step."""
    for s in range(seed, seed + 50):
        p = _prompt(s)
        ref = _sampled(llm, p, 12)
        i = next((i for i in range(1, len(ref)) if ref[i] not in ref[:i]), None)
        if i is not None:
            _forget(llm)
            return p, ref[:i + 1]
    raise AssertionError("no prompt whose greedy tokens change")


def test_stop_token(llm):
    p, ref = _ending_in_decode(llm, 300)
    out = llm.generate([p], SamplingParams(max_tokens=20, stop_token_ids=[ref[-1]], **SAMPLED))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ref
    assert _hits_of_second_send(llm, p) == FULL


def test_eos(llm):
    p, ref = _ending_in_decode(llm, 400)
    eos = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = eos | {ref[-1]}  # this token ends the sequence as eos would
    try:
        out = llm.generate([p], SamplingParams(max_tokens=20, **SAMPLED))[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = eos
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids == ref
    assert _hits_of_second_send(llm, p) == FULL


def test_stop_string(llm):
    p, ref = _ending_in_decode(llm, 500)
    word = llm.tokenizer.decode([ref[-1]]).strip()
    out = llm.generate([p], SamplingParams(max_tokens=20, stop=[word], **SAMPLED))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert _hits_of_second_send(llm, p) == FULL


def test_abort_after_prefill(llm):
    p = _prompt(6)
    eng = llm.engine
    eng.add_request("aborted", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    while eng.in_flight is None or not eng.outputs.requests["aborted"].choices[0].seq.num_computed_tokens:
        eng.step()  # until its prefill step is launched
    final = eng.abort("aborted")
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    while eng.has_work():
        eng.step()
    assert _hits_of_second_send(llm, p) == FULL


def _forget(llm) -> None:
    """Empty the prefix cache (the counters stay): the measured request computes its blocks itself."""
    kv = llm.engine.kv
    kv.cached.clear()
    for b in kv.blocks:
        b.hash = None
