"""The serving engines, in a thread (AsyncEngine) and in a process of its own (ProcessEngine):
streams, external abort, and rejected requests, on the bundled model."""
import asyncio

import pytest

from kvship.config import EngineConfig
from kvship.core.async_engine import AsyncEngine
from kvship.core.engine_process import ProcessEngine
from kvship.sampling_params import InvalidParamsError, SamplingParams


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request):
    config = EngineConfig(device="cpu", max_model_len=512)
    eng = AsyncEngine.from_config(config) if request.param == "thread" else ProcessEngine(config, start_timeout=240)
    yield eng
    eng.shutdown()


def test_external_abort_ends_the_stream_and_frees_blocks(engine):
    ids = engine.tokenizer.encode("Count from one to one hundred:")

    async def go():
        outs = []
        async for out in engine.generate(ids, SamplingParams(max_tokens=100, ignore_eos=True), "r1"):
            outs.append(out)
            if len(outs) == 2:
                engine.abort("r1")
        return outs

    outs = asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 100
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_requests_running == 0


def test_invalid_request_raises_in_caller(engine):
    async def go():
        async for _ in engine.generate(list(range(600)), SamplingParams(), "too-long"):
            pass

    with pytest.raises(InvalidParamsError, match="maximum context length") as e:
        asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert e.value.param == "prompt"  # the engine knows prompts only, whatever the API called them
    assert engine.is_alive()


def test_async_engine_is_the_servers_engine_client(engine):
    from kvship.server.engine_client import EngineClient

    assert isinstance(engine, EngineClient)
    assert engine.max_model_len == 512 and engine.config.max_num_seqs >= 1


def test_consumer_leaving_aborts(engine):
    ids = engine.tokenizer.encode("Tell me a long story.")

    async def go():
        async for out in engine.generate(ids, SamplingParams(max_tokens=200, ignore_eos=True), "r2"):
            break  # the consumer walks away after the first output

    asyncio.run(go())
    for _ in range(100):
        if engine.stats().num_kv_blocks_used == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize("engine", ["thread"], indirect=True)  # it holds the thread's step
def test_queue_time_and_ttft_count_the_wait_for_the_engine_thread(engine):
    """A request submitted while the engine thread is busy in a step waits in the inbox; its
    arrival is when it was submitted, so its queue time and time to first token include that
    wait (the latency histograms and the autoscaler read these)."""
    import threading
    import time

    ids = engine.tokenizer.encode("Hello there")
    inner, entered, release = engine.engine.step, threading.Event(), threading.Event()

    def held_step():  # the engine thread is busy in this step until the test releases it
        entered.set()
        release.wait(30)
        return inner()

    async def first(request_id: str):
        async for out in engine.generate(ids, SamplingParams(max_tokens=2, ignore_eos=True), request_id):
            if out.finished:
                return out

    async def go():
        busy = asyncio.ensure_future(first("keeps-the-loop-busy"))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        t_submit = time.monotonic()
        waiting = asyncio.ensure_future(first("waits-in-the-inbox"))
        await asyncio.sleep(0.5)
        assert engine.stats().num_requests_waiting >= 1  # counted as waiting meanwhile
        engine.engine.step = inner
        release.set()
        return t_submit, await waiting, await busy

    engine.engine.step = held_step
    try:
        t_submit, out, _ = asyncio.run(asyncio.wait_for(go(), timeout=60))
    finally:
        engine.engine.step = inner
        release.set()
    # arrival: when generate() took the request (within 50 ms of the client's clock)
    assert abs(out.arrival_time - t_submit) < 0.05, (out.arrival_time, t_submit)
    assert out.first_scheduled_time - out.arrival_time >= 0.45
    assert out.first_token_time - out.arrival_time >= 0.45


def test_final_only_request_streams_one_finished_output(engine):
    """What a server asks for an answer sent whole (stream false): the final output alone, the
    same text and tokens as a streamed request's last one; an abort still ends it with its text."""
    ids = engine.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def collect(request_id: str, final_only: bool, params=greedy, abort_after: float | None = None):
        if abort_after is not None:
            asyncio.get_running_loop().call_later(abort_after, engine.abort, request_id)
        return [out async for out in engine.generate(ids, params, request_id, final_only=final_only)]

    streamed = asyncio.run(asyncio.wait_for(collect("s", False), timeout=60))
    final = asyncio.run(asyncio.wait_for(collect("f", True), timeout=60))
    assert len(streamed) > 1 and len(final) == 1 and final[0].finished
    assert (final[0].outputs[0].text, final[0].outputs[0].token_ids) == (
        streamed[-1].outputs[0].text, streamed[-1].outputs[0].token_ids)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    aborted = asyncio.run(asyncio.wait_for(collect("a", True, long, abort_after=0.5), timeout=60))
    assert len(aborted) == 1 and aborted[0].outputs[0].finish_reason == "abort"
    assert len(aborted[0].outputs[0].token_ids) < 400
    assert engine.stats().num_kv_blocks_used == 0
