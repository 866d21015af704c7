"""bench/serve_model.py end to end on the CPU: the real server with its runner replaced by the
step cost model. Its streams must keep the model's pace (a runner that stopped being replaced,
or stopped waiting for the modelled device, would stream far faster than the model's steps)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_server_keeps_the_cost_models_pace():
    path = [str(ROOT / "engine"), *filter(None, [os.environ.get("PYTHONPATH")])]
    # its own process group: on a timeout the bench's server goes with it
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve_model.py"), "--concurrency", "4",
                             "--prompt", "64", "--output", "16", "--ramp", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    row = next(line for line in stdout.splitlines() if line.startswith("| 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    tpot, model_tpot = float(cells[3]), float(cells[9])
    # each decode step of the modelled 8B shape reads its weights: ~5 ms at 3 TB/s
    assert model_tpot > 4.0
    assert tpot >= 0.8 * model_tpot, (tpot, model_tpot)


@pytest.mark.timeout(120)
def test_serve_bench_reads_the_compiles_a_server_logs_per_level():
    """bench/serve.py's compiles column: the lines the runner logs for a compile after start-up
    (runner/model_runner.py's own message, WARNING from 100 ms), read from where the level
    before stopped reading."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import serve
    finally:
        sys.path.remove(str(ROOT / "bench"))
    child = ("import logging; logging.basicConfig(); from kvship.runner.model_runner import _log_compile; "
             "_log_compile('_prefill_kernel', 1.5, 'q_ptr *i32 divisibility 16 -> *i32'); "
             "_log_compile('_rms_norm_kernel', 0.01, '')")
    proc = serve.popen_logged([sys.executable, "-c", child])
    assert proc.wait(timeout=60) == 0, serve.server_log_tail(proc)
    compiles, end = serve.server_compiles(proc, 0)
    assert compiles == [("_prefill_kernel", 1500)] and end > 0
    assert serve.server_compiles(proc, end) == ([], end)
