"""The KVSHIP_* environment variables: the one module that reads them.

Engine options are EngineConfig fields and CLI flags. What is here is set by whatever starts
the process (the operator, a host's first rank starting the others) or is a CLI default. Each
accessor reads the environment when called; those taking ``env`` read that mapping instead.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

API_KEY = "KVSHIP_API_KEY"
LOG_LEVEL = "KVSHIP_LOG_LEVEL"
NNODES = "KVSHIP_NNODES"
NODE_RANK = "KVSHIP_NODE_RANK"
TP_TIMEOUT = "KVSHIP_TP_TIMEOUT"
TP_HEARTBEAT_TIMEOUT = "KVSHIP_TP_HEARTBEAT_TIMEOUT"
TP_RANK = "KVSHIP_TP_RANK"
TP_LOCAL_RANK = "KVSHIP_TP_LOCAL_RANK"
TP_NPROC_PER_NODE = "KVSHIP_TP_NPROC_PER_NODE"
TP_PARENT_PID = "KVSHIP_TP_PARENT_PID"
TP_CONFIG = "KVSHIP_TP_CONFIG"

VARIABLES = {
    API_KEY: "default of --api-key: the bearer key /v1/* requires",
    LOG_LEVEL: "log level of a tensor-parallel worker process (default INFO)",
    NNODES: "hosts one tensor-parallel group spans (else NNODES; default 1)",
    NODE_RANK: "this host's place in that group (else NODE_RANK, LWS_WORKER_INDEX or a hostname's -N)",
    TP_TIMEOUT: "seconds the tensor-parallel process group waits to form and in a collective (default 600)",
    TP_HEARTBEAT_TIMEOUT: "seconds without a heartbeat before a rank is taken as hung (default 30)",
    # set by a host's first rank for the ranks it starts (runner/tp/launch.py)
    TP_RANK: "a started rank's global rank",
    TP_LOCAL_RANK: "a started rank's rank on its host (its GPU)",
    TP_NPROC_PER_NODE: "ranks on each host",
    TP_PARENT_PID: "the process that started a rank; the rank fails when it is gone",
    TP_CONFIG: "the EngineConfig a started rank builds its model from, as JSON",
}


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# OpenMP's (torch's CPU threads) own variable, given a default by kvship serve and the CPU bench.
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"


def passive_cpu_threads() -> None:
    """Idle OpenMP threads sleep rather than spin, unless OMP_WAIT_POLICY says otherwise; it is
    read once, when torch starts its threads, so this runs before torch is imported. A spinning
    thread holds a core the engine's other threads, the server's event loop and other processes
    need: on a busy 2-core machine, two spinning threads ran a decode step 5x slower than one,
    sleeping ones as fast as one."""
    os.environ.setdefault(OMP_WAIT_POLICY, "PASSIVE")


def api_key() -> str | None:
    return os.environ.get(API_KEY)


def log_level() -> str:
    return os.environ.get(LOG_LEVEL, "INFO").upper()


def nnodes(env: Mapping[str, str] | None = None) -> str | None:
    return _env(env).get(NNODES) or None


def node_rank(env: Mapping[str, str] | None = None) -> str | None:
    return _env(env).get(NODE_RANK) or None


def tp_timeout_s() -> float:
    return _float(TP_TIMEOUT, 600)


def tp_heartbeat_timeout_s() -> float:
    return _float(TP_HEARTBEAT_TIMEOUT, 30.0)


def started_rank(env: Mapping[str, str] | None = None) -> tuple[int, int, int | None] | None:
    """(global rank, local rank, ranks per host or None) of a rank its host's first rank started;
    None for any other process."""
    e = _env(env)
    if not e.get(TP_RANK):
        return None
    nproc = e.get(TP_NPROC_PER_NODE)
    return int(e[TP_RANK]), int(e.get(TP_LOCAL_RANK, "0")), int(nproc) if nproc is not None else None


def started_rank_label() -> str:
    """This worker's rank as its log lines show it ("?" before it is known)."""
    return os.environ.get(TP_RANK, "?")


def parent_pid() -> int:
    """The process that started this rank, 0 if none did."""
    return int(os.environ.get(TP_PARENT_PID, "0") or 0)


def tp_config() -> dict:
    """The EngineConfig fields a started rank was given."""
    return json.loads(os.environ[TP_CONFIG])


def started_rank_env(config: dict, nproc_per_node: int, parent: int, rank: int, local_rank: int) -> dict[str, str]:
    """The variables a host's first rank sets for a rank it starts (read back by the accessors
    above in that process)."""
    return {TP_CONFIG: json.dumps(config), TP_NPROC_PER_NODE: str(nproc_per_node), TP_PARENT_PID: str(parent),
            TP_RANK: str(rank), TP_LOCAL_RANK: str(local_rank)}
