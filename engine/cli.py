"""The `kvship` command.

    kvship serve [MODEL] [--host H] [--port P] [...]   # OpenAI-compatible server
    kvship --version

MODEL is a hub id, a local folder or a .gguf file; without one the bundled SmolLM2 is served.
Options follow vLLM's names, so existing launch scripts carry over.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from typing import Any

import kvship

logger = logging.getLogger("kvship")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2e9', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 2000000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", default=None,
                   help="hub id, local folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--model", dest="model_opt", default=None, metavar="MODEL", help="same as the positional MODEL")
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    g.add_argument("--download-dir", default=None, help="where hub downloads go")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's own)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"],
                   help="weights and activations dtype")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shapes (benchmarks; a config-only folder is enough)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (requests without a seed draw from it)")
    g.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: requests that leave out temperature/top_p/top_k/min_p/repetition_penalty get the "
                        "model's generation_config.json values; none: the OpenAI defaults")

    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-model-len", type=_positive_int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=256, help="most sequences in a batch")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192, help="token budget per step")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block (power of two)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.90,
                   help="fraction of GPU memory the engine may use (weights + activations + KV cache)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for the KV cache, e.g. 4GiB (overrides --gpu-memory-utilization)")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="exact number of KV-cache blocks")
    g.add_argument("--max-waiting-requests", type=_positive_int, default=1024,
                   help="queue length beyond which requests get 503 + Retry-After")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, help="GPUs to shard the model over")
    g.add_argument("--tp-all-reduce", choices=["nccl", "one-shot"], default="nccl",
                   help="all-reduce for small tensors between GPUs (one-shot: peer loads over NVLink)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=os.environ.get("KVSHIP_API_KEY"),
                   help="require this key as 'Authorization: Bearer KEY' on /v1/* (default: $KVSHIP_API_KEY)")
    g.add_argument("--no-chat-page", "--disable-chat-page", dest="chat_page", action="store_false",
                   help="do not serve the built-in chat page")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvship", description="LLM serving with an OpenAI-compatible API.")
    parser.add_argument("--version", action="version", version=f"kvship {kvship.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(serve)
    add_server_args(serve)
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    from kvship.config import EngineConfig

    if args.model and args.model_opt and args.model != args.model_opt:
        raise SystemExit("kvship serve: error: MODEL given twice with different values")
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    return EngineConfig(
        model=args.model or args.model_opt,
        revision=args.revision,
        download_dir=args.download_dir,
        served_model_name=args.served_model_name,
        dtype=dtype,
        load_format=args.load_format,
        device=args.device,
        seed=args.seed,
        generation_defaults=args.generation_config == "auto",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_all_reduce=args.tp_all_reduce,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        max_waiting_requests=args.max_waiting_requests,
    )


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # uvicorn's own start-up chatter is replaced by our single "listening" line.
    if level != "debug":
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


def serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvship serve: error: {exc}", file=sys.stderr)
        return 2

    if config.tensor_parallel_size > 1:  # on hosts other than host 0: only this host's ranks, no server
        from kvship.distributed.launch import resolve_placement

        try:
            placement = resolve_placement(config.tensor_parallel_size)
        except ValueError as exc:
            print(f"kvship serve: error: {exc}", file=sys.stderr)
            return 2
        if placement.node_rank != 0:
            from kvship.distributed.worker import serve_node

            logger.info("tensor-parallel host %d of %d: serving ranks %d..%d for %s:%s", placement.node_rank,
                        placement.nnodes, placement.rank, placement.rank + placement.nproc_per_node - 1,
                        placement.master_addr, placement.master_port)
            return serve_node(config, placement)

    import uvicorn

    from kvship.core.async_engine import AsyncEngine
    from kvship.server.app import build_app

    logger.info("loading %s", config.model or "the bundled SmolLM2-135M-Instruct")
    try:
        engine = AsyncEngine.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a failed load is reported, not a traceback dump
        logger.error("could not load the model: %s", exc, exc_info=args.log_level == "debug")
        return 1

    app = build_app(engine, engine.config, api_key=args.api_key, chat_page=args.chat_page)
    state = app.state.kvship
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=args.access_log,
        # Our own drain (begin_drain) aborts what is left after --shutdown-timeout; uvicorn's
        # timeout is only the backstop.
        timeout_graceful_shutdown=max(0.0, args.shutdown_timeout) + 5,
        timeout_keep_alive=5,
        lifespan="on",
    )
    server = _Server(uv_config, app, args.shutdown_timeout, engine.model_name)
    engine_death: list[BaseException] = []

    def on_engine_death(exc: BaseException) -> None:  # engine thread
        engine_death.append(exc)
        state.draining = True
        server.should_exit = True
        _exit_if_stuck(args.shutdown_timeout + 10, code=1)

    engine.add_death_callback(on_engine_death)

    # uvicorn re-raises the signal that stopped it once it is done; absorb that so a SIGTERM'd
    # server exits 0 after its graceful shutdown instead of dying by the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _exit_if_stuck(15, code=1)  # engine.shutdown() must not keep a dead process alive
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("engine shutdown failed")

    if engine_death:
        logger.error("the engine loop died (%r); exiting so that the process is restarted", engine_death[0])
        return 1
    if not server.started:
        return 1  # e.g. the port was taken; uvicorn has said so
    logger.info("kvship stopped")
    return 0


def _exit_if_stuck(seconds: float, code: int) -> None:
    def fire() -> None:
        logger.error("shutdown did not finish within %.0fs; exiting", seconds)
        os._exit(code)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _make_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: Any, app: Any, grace_s: float, model_name: str):
            super().__init__(config)
            self._app = app
            self._grace_s = grace_s
            self._model_name = model_name
            self._loop: Any = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            from kvship.server.app import begin_drain

            if not self.should_exit:
                logger.info("received %s: draining (in-flight requests get up to %ss)",
                            signal.Signals(sig).name, self._grace_s)
                _exit_if_stuck(self._grace_s + 30, code=1)
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(begin_drain, self._app, self._grace_s)
            self._app.state.kvship.draining = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            import asyncio

            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if self.started and not self.should_exit:
                host, port = self.config.host, self.config.port
                for srv in self.servers:
                    for sock in srv.sockets:
                        host, port = sock.getsockname()[:2]
                        break
                shown = self.config.host if self.config.host not in ("0.0.0.0", "::") else host
                logger.info("kvship listening on http://%s:%s (model %s)", shown, port, self._model_name)

    return Server


def _Server(config: Any, app: Any, grace_s: float, model_name: str) -> Any:
    return _make_server_class()(config, app, grace_s, model_name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
