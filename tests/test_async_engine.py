"""The async engine (its own process): streams, external abort, rejected requests, and the engine
process dying or outliving its server, on the bundled model."""
import asyncio

import pytest

from kvship.config import EngineConfig
from kvship.core.async_engine import AsyncEngine, EngineDeadError
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


def test_engine_process_death_is_reported():
    """The engine runs in its own process: if it dies, waiting streams fail, new requests are
    refused, and the death callbacks (the server's exit path) fire."""
    import os
    import signal
    import threading

    eng = AsyncEngine.from_config(EngineConfig(device="cpu", max_model_len=256))
    died = threading.Event()
    eng.add_death_callback(lambda exc: died.set())
    ids = eng.tokenizer.encode("Once upon a time")

    async def go():
        async for out in eng.generate(ids, SamplingParams(max_tokens=200, ignore_eos=True), "doomed"):
            os.kill(eng.pid, signal.SIGKILL)

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert died.wait(10) and not eng.is_alive()

    async def again():
        async for _ in eng.generate(ids, SamplingParams(max_tokens=2), "late"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(again())
    eng.shutdown()


def test_engine_process_exits_with_the_server(tmp_path):
    """A server killed outright (SIGKILL: no shutdown code runs) leaves no engine behind."""
    import os
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "pid"
    code = (
        "import time\n"
        "from kvship.config import EngineConfig\n"
        "from kvship.core.async_engine import AsyncEngine\n"
        "if __name__ == '__main__':\n"
        "    eng = AsyncEngine.from_config(EngineConfig(device='cpu', max_model_len=256))\n"
        f"    open({str(pid_file)!r}, 'w').write(str(eng.pid))\n"
        "    time.sleep(600)\n"
    )
    script = tmp_path / "server.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        engine_pid = int(pid_file.read_text())
        os.kill(engine_pid, 0)  # alive
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            # a zombie until reaped by init counts as gone once it stops running
            with open(f"/proc/{engine_pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
            time.sleep(0.2)
        else:
            raise AssertionError("the engine process outlived its server")
    finally:
        proc.kill()
