"""cpu_latency.py's served rows: the bundled model through a real `kvship serve` on loopback.

served_decode: one streamed completion, its decode tok/s (first to last token), TTFT and the
server's CPU time a token. The streaming clients are the tests' (tests/server_utils.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from serve import free_port, popen_logged, wait_ready
from server_utils import stream_completion


class Served:
    """`kvship serve` (the bundled model, CPU, no prefix cache: every request prefills) for a `with` block."""

    def __init__(self, max_model_len: int, threads: int | None, weight_format: str):
        self.base = f"http://127.0.0.1:{free_port()}"
        extra = ["--cpu-weight-format", weight_format] + (["--cpu-threads", str(threads)] if threads else [])
        self.proc = popen_logged([sys.executable, "-m", "kvship.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                                  "--port", self.base.rsplit(":", 1)[1], "--no-enable-prefix-caching",
                                  "--max-model-len", str(max_model_len), *extra])

    def __enter__(self) -> "Served":
        wait_ready(self.proc, self.base)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def log(self) -> str:
        self.proc.log.seek(0)
        return self.proc.log.read()


def served_decode(server: Served, ids: list[int], out: int) -> tuple[float, float, float]:
    """(TTFT s, decode tok/s, the server's CPU ms a decoded token) of one streamed request, after
    a warm-up one; CPU time as cpu_latency.time_kvship counts it (a run of 1 + out tokens less
    one of 1)."""
    proc = psutil.Process(server.proc.pid)

    def run(n: int) -> tuple[float, list[float], float]:
        before = sum(proc.cpu_times()[:2])
        sent, times = stream_completion(server.base, ids, n)
        assert len(times) == n, len(times)
        return sent, times, sum(proc.cpu_times()[:2]) - before

    run(4)
    _, _, first_cpu = run(1)
    sent, times, whole_cpu = run(1 + out)
    return times[0] - sent, out / (times[-1] - times[0]), (whole_cpu - first_cpu) / out * 1e3
