"""A tensor-parallel rank other than 0: builds its shard of the model and runs the forward of
every step rank 0 sends, until rank 0 says stop. No scheduler, sampler or HTTP server.

    python -m kvship.runner.tp.worker      # started by a node leader; reads its place from kvship.envs and MASTER_*

On hosts other than host 0, `kvship serve --tensor-parallel-size N` runs serve_node() instead of
a server (see kvship.runner.tp.launch for the environment it reads).
"""
from __future__ import annotations

import logging
import os
import signal
import sys

import torch

from kvship import envs
from kvship.config import EngineConfig
from kvship.runner.model_runner import ModelRunner
from kvship.runner.model_setup import load_model
from kvship.runner.tp.launch import Placement, TPRuntime, resolve_placement

log = logging.getLogger(__name__)


def build_runner(config: EngineConfig, rt: TPRuntime) -> ModelRunner:
    source, model_config = load_model(config)
    return ModelRunner(config, model_config, None if config.load_format == "dummy" else source.weights(), tp=rt.ctx)


def serve_node(config: EngineConfig, placement: Placement | None = None) -> int:
    """Run this process's rank (and start the host's other ranks) until rank 0 stops. Exit status."""
    placement = placement or resolve_placement(config.tensor_parallel_size)
    if placement.is_driver:
        raise ValueError("rank 0 runs the engine, not the worker loop")
    if config.device != "cpu" and torch.cuda.is_available():
        config.device = f"cuda:{placement.local_rank}"
    rt = TPRuntime.start(config, placement)
    try:
        runner = build_runner(config, rt)
        rt.ready = True
        log.info("tensor-parallel rank %d ready (%s)", rt.rank, runner.device)
        with torch.inference_mode():
            while True:
                step = rt.recv_step(runner.device)
                if step is None:
                    break
                ids, pos, meta, restores, checkpoints, (lora_slots, lora_loads) = step
                if runner.lora is not None:
                    runner.lora.apply_message(lora_slots, lora_loads, ids.shape[0], meta.max_seqlen_q > 1)
                runner.copy_states(restores)
                runner.forward(ids, pos, meta)
                runner.copy_states(checkpoints)
    except Exception:
        if rt._stopping.is_set():
            return 0
        log.exception("tensor-parallel rank %d failed", placement.rank)
        logging.shutdown()
        os._exit(1)  # skip atexit/teardown that could block on a broken group
    log.info("tensor-parallel rank %d stopping", rt.rank)
    runner.release_graphs()
    rt.shutdown()
    # Skip the interpreter's teardown: nothing is left to save, and finalizing with the process
    # group's threads still inside NCCL or gloo can abort (a CPU rank under load once exited with
    # SIGABRT after a clean stop, its gloo teardown still running).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    rank = envs.started_rank_label()
    logging.basicConfig(level=envs.log_level(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig(**envs.tp_config())
    return serve_node(config)


if __name__ == "__main__":
    sys.exit(main())
