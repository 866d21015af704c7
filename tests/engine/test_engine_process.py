"""The engine in a process of its own (core/engine_process.py) on the bundled model: the same
tokens as the engine in a thread, grammars compiled where requests find them, and a process that
dies, fails to load or is shut down. Streams, aborts and refusals: test_async_engine.py, which
runs each engine."""
import asyncio
import os
import signal

import pytest

from kvship.config import EngineConfig
from kvship.core.async_engine import AsyncEngine, EngineDeadError
from kvship.core.engine_process import ProcessEngine
from kvship.sampling_params import InvalidParamsError, SamplingParams, StructuredOutput
from kvship.server.engine_client import EngineClient

pytestmark = pytest.mark.timeout(300)

CONFIG = dict(device="cpu", max_model_len=512, cpu_weight_format="float32")  # exact greedy ties
PROMPTS = ["The capital of France is", "Write a haiku about autumn:", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def engine():
    eng = ProcessEngine(EngineConfig(**CONFIG), start_timeout=240)
    yield eng
    eng.shutdown()


async def collect(engine, ids, params, request_id):
    return [out async for out in engine.generate(ids, params, request_id)]


async def run_all(engine, prompts, params):
    ids = [engine.tokenizer.encode(p) for p in prompts]
    return await asyncio.gather(*(collect(engine, i, params, f"r{n}") for n, i in enumerate(ids)))


def test_same_outputs_as_the_engine_in_a_thread(engine):
    """Every streamed output, cumulative fields and deltas alike, as the engine in a thread gives
    it: the pipe carries only what each output adds (core/output_pipe.py) and the server's side
    adds it back up; two choices, logprobs, the prompt's logprobs and a stop string included."""
    assert isinstance(engine, EngineClient)
    assert engine.max_model_len == 512 and engine.config.max_num_seqs >= 1 and engine.model_name
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1,
                            stop=[" the"])
    here = asyncio.run(asyncio.wait_for(run_all(engine, PROMPTS, params), 120))
    with AsyncEngine.from_config(EngineConfig(**CONFIG)) as threaded:
        there = asyncio.run(asyncio.wait_for(run_all(threaded, PROMPTS, params), 120))

    def split(entries):  # logprob entries: (the token ids exactly, the values to compare within a tolerance)
        flat = [t for chosen, top in entries or [] for t in (chosen, *top)]
        return [t.token_id for t in flat], [t.logprob for t in flat]

    def seen(outs):  # what a reader takes from each output; logprobs apart, as a batch's rows may differ in the last bits
        rows, values = [], []
        for o in outs:
            ids, lps = split(o.prompt_logprobs)
            rows.append((o.finished, o.prompt_token_ids, ids))
            values += lps
            for c in o.outputs:
                (ids, lps), (dids, dlps) = split(c.logprobs), split(c.logprobs_delta)
                rows.append((c.index, c.text, list(c.token_ids), c.text_delta, c.token_ids_delta, ids, dids,
                             c.finish_reason, c.stop_reason))
                values += lps + dlps
        return rows, values

    for a, b in zip(here, there):
        assert a[-1].finished and a[-1].outputs[0].token_ids
        (rows_a, values_a), (rows_b, values_b) = seen(a), seen(b)
        assert rows_a == rows_b
        assert values_a == pytest.approx(values_b, abs=1e-4) and values_a
    assert {o[-1].outputs[0].finish_reason for o in here} >= {"length"}
    stats = engine.stats()
    assert stats.num_requests_running == 0 and stats.num_requests_waiting == 0
    assert stats.generation_tokens_total >= 3


def test_grammar_compiled_in_the_engine_constrains_the_answer(engine):
    spec = StructuredOutput(kind="choice", spec='["yes", "no"]')
    asyncio.run(asyncio.wait_for(engine.prepare_grammar(spec), 60))
    ids = engine.tokenizer.encode("Is the sky blue? Answer:")
    outs = asyncio.run(asyncio.wait_for(collect(engine, ids, SamplingParams(max_tokens=8, structured=spec), "g"), 60))
    assert outs[-1].outputs[0].text in ("yes", "no")
    bad = StructuredOutput(kind="regex", spec="(unclosed")
    with pytest.raises(InvalidParamsError):
        asyncio.run(asyncio.wait_for(engine.prepare_grammar(bad), 60))


def test_a_dead_engine_process_ends_streams_and_says_so():
    eng = ProcessEngine(EngineConfig(**CONFIG), start_timeout=240)
    died: list[BaseException] = []
    eng.add_death_callback(died.append)
    ids = eng.tokenizer.encode("Tell me a long story.")

    async def go():
        async for out in eng.generate(ids, SamplingParams(max_tokens=400, ignore_eos=True), "d"):
            if out.outputs[0].token_ids:
                os.kill(eng._proc.pid, signal.SIGKILL)

    try:
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(go(), 60))
        assert died and "exit code -9" in str(died[0]) and not eng.is_alive()  # reported before the streams end
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(collect(eng, ids, SamplingParams(max_tokens=2), "after"), 10))
    finally:
        eng.shutdown()
    assert not eng._proc.is_alive()


def test_shutdown_ends_the_process_cleanly():
    eng = ProcessEngine(EngineConfig(**CONFIG), start_timeout=240)
    eng.shutdown()
    assert eng._proc.exitcode == 0 and not eng.is_alive()
    eng.shutdown()  # twice is harmless


def test_a_model_that_cannot_load_is_reported(tmp_path):
    with pytest.raises(Exception, match="config.json|not found|No such|does not exist") as e:
        ProcessEngine(EngineConfig(model=str(tmp_path / "missing"), device="cpu"), start_timeout=120)
    assert "Traceback" not in str(e.value)
