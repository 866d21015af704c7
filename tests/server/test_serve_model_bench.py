"""bench/serve_model.py end to end on the CPU: the real server with its runner replaced by the
step cost model. Its streams must keep the model's pace (a runner that stopped being replaced,
or stopped waiting for the modelled device, would stream far faster than the model's steps)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_server_keeps_the_cost_models_pace():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "engine"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_model.py"), "--concurrency", "4",
                          "--prompt", "64", "--output", "16", "--ramp", "0.2"],
                         capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    tpot, model_tpot = float(cells[3]), float(cells[9])
    # each decode step of the modelled 8B shape reads its weights: ~5 ms at 3 TB/s
    assert model_tpot > 4.0
    assert tpot >= 0.8 * model_tpot, (tpot, model_tpot)
