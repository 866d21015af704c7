"""The async engine: streams, external abort, and rejected requests, on the bundled model."""
import asyncio

import pytest

from kvship.config import EngineConfig
from kvship.core.async_engine import AsyncEngine
from kvship.sampling_params import InvalidParamsError, SamplingParams


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine.from_config(EngineConfig(device="cpu", max_model_len=512))
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

    with pytest.raises(InvalidParamsError, match="maximum context length"):
        asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert engine.is_alive()


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
