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
import signal
import sys
import threading
from typing import Any

import kvship
from kvship import envs
from kvship.cli_args import add_engine_args, add_server_args, parse_size
from kvship.config import EngineConfig, KVEventsConfig

# The engine, the server and the tensor-parallel runtime are imported inside `serve` only:
# they pull in torch, and `kvship --help` or a bad flag should answer at once.
logger = logging.getLogger("kvship")

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvship", description="LLM serving with an OpenAI-compatible API.")
    parser.add_argument("--version", action="version", version=f"kvship {kvship.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(serve)
    add_server_args(serve)
    add_connection_args(serve)
    serve.add_argument("--max-stored-responses-size", type=parse_size, default=64 * 2**20, metavar="SIZE",
                       help="text kept of stored /v1/responses conversations (previous_response_id); the oldest go "
                       "first (default: 64MiB; at most 1000 are kept)")
    from kvship.router.main import add_router_args  # standard library only: no torch, no grpc

    router = sub.add_parser("router", help="route requests over several `kvship serve` replicas (Envoy + "
                            "a Gateway API Inference Extension endpoint picker)",
                            description="Envoy in front of several model servers; an ext_proc endpoint picker "
                            "chooses the replica for each request.")
    add_router_args(router)
    return parser


def add_connection_args(p: argparse.ArgumentParser) -> None:
    # The defaults are kvship.server.timeouts' (not imported here: it pulls in the engine).
    g = p.add_argument_group("connection time limits (a client that sends slowly or not at all)")
    g.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="close a keep-alive connection idle this long between requests (default: %(default)s)")
    g.add_argument("--timeout-request-header", type=_positive_float, default=20.0,
                   metavar="SECONDS", help="a request's line and headers must arrive within this time, counted from "
                   "the connection's start or the previous response (408, then close; default: %(default)s)")
    g.add_argument("--timeout-request-body", type=_positive_float, default=60.0,
                   metavar="SECONDS", help="a request's body must arrive within this time of its headers (408, then "
                   "close; default: %(default)s)")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _kv_events(text: str | None) -> KVEventsConfig | None:
    if text is None:
        return None
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise SystemExit(f"kvship serve: error: {exc}") from exc


def config_from_args(args: argparse.Namespace) -> EngineConfig:
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
        quantization=args.quantization,
        cpu_weight_format=args.cpu_weight_format,
        generation_defaults=args.generation_config == "auto",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_join_tokens=args.prefill_join_tokens,
        prefill_beside_decodes=args.prefill_beside_decodes,
        schedule_policy=args.schedule_policy,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_events=_kv_events(args.kv_events_config),
        num_state_checkpoints=args.num_state_checkpoints,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_all_reduce=args.tp_all_reduce,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        cpu_threads=args.cpu_threads,
        max_waiting_requests=args.max_waiting_requests,
        task=args.task,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=args.speculative_config,
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
        from kvship.runner.tp.launch import resolve_placement

        try:
            placement = resolve_placement(config.tensor_parallel_size)
        except ValueError as exc:
            print(f"kvship serve: error: {exc}", file=sys.stderr)
            return 2
        if placement.node_rank != 0:
            from kvship.runner.tp.worker import serve_node

            logger.info("tensor-parallel host %d of %d: serving ranks %d..%d for %s:%s", placement.node_rank,
                        placement.nnodes, placement.rank, placement.rank + placement.nproc_per_node - 1,
                        placement.master_addr, placement.master_port)
            return serve_node(config, placement)

    problem = port_problem(args.host, args.port)
    if problem:  # before loading: a taken port used to cost a whole model load (~30 s) to find out
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, problem)
        return 1

    import uvicorn

    from kvship.core.async_engine import AsyncEngine
    from kvship.core.engine_process import ProcessEngine
    from kvship.server.app import build_app
    from kvship.server.timeouts import timed_h11_protocol

    logger.info("loading %s", config.model or "the bundled SmolLM2-135M-Instruct")
    try:
        engine = ProcessEngine(config) if args.engine_process else AsyncEngine.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a failed load is reported, not a traceback dump
        logger.error("could not load the model: %s", exc, exc_info=args.log_level == "debug")
        return 1

    app = build_app(engine, engine.config, api_key=args.api_key, chat_page=args.chat_page,
                    max_prompts_per_request=args.max_prompts_per_request,
                    max_body_bytes=args.max_request_body_size,
                    tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser, body_timeout_s=args.timeout_request_body,
                    responses_store_bytes=args.max_stored_responses_size,
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    state = app.state.kvship
    try:
        _register_lora_modules(state.loras, engine, args.lora_modules)
    except ValueError as exc:
        logger.error("%s", exc)
        engine.shutdown()
        return 2
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=args.access_log,
        # Our own drain (kvship.server.app.drain) ends what is left after --shutdown-timeout;
        # uvicorn's timeout is only the backstop.
        timeout_graceful_shutdown=max(0.0, args.shutdown_timeout) + 5,
        timeout_keep_alive=args.timeout_keep_alive,
        http=timed_h11_protocol(args.timeout_request_header),
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
        except Exception:
            logger.exception("engine shutdown failed")

    if engine_death:
        logger.error("the engine loop died (%r); exiting so that the process is restarted", engine_death[0])
        return 1
    if not server.started:
        return 1  # e.g. the port was taken; uvicorn has said so
    logger.info("kvship stopped")
    return 0


def _register_lora_modules(loras, engine, modules: list[str]) -> None:
    """--lora-modules: each adapter read and checked now, so that a bad one stops the start."""
    from kvship.server.lora import parse_lora_module

    if modules and not loras.enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    for text in modules:
        name, path = parse_lora_module(text)
        lora = loras.new_request(name, path)
        try:
            engine.add_lora(lora).result()
        except ValueError as exc:
            raise ValueError(f"--lora-modules {name}: {exc}") from None
        loras.adapters[name] = lora
        logger.info("LoRA adapter %s from %s", name, path)


def port_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now (taken, no such address, ...), or None. Binds
    the way uvicorn will (SO_REUSEADDR) and lets go at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _exit_if_stuck(seconds: float, code: int) -> None:
    def fire() -> None:
        logger.error("shutdown did not finish within %.0fs; exiting", seconds)
        os._exit(code)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _make_server_class():
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: Any, app: Any, grace_s: float, model_name: str):
            super().__init__(config)
            self._app = app
            self._grace_s = grace_s
            self._model_name = model_name
            self._loop: Any = None
            self._drain: Any = None  # the drain under way (a handle, then its task)

        def handle_exit(self, sig: int, frame: Any) -> None:
            """The first SIGTERM/SIGINT starts a drain (kvship.server.app.drain) and the server
            keeps listening through it, so /health can answer 503; uvicorn's own shutdown starts
            when the drain is over. A second signal stops at once."""
            if self._drain is None and self._loop is not None and not self.should_exit:
                logger.info("received %s: draining (in-flight requests get up to %ss)",
                            signal.Signals(sig).name, self._grace_s)
                _exit_if_stuck(self._grace_s + 30, code=1)
                self._app.state.kvship.draining = True
                self._drain = self._loop.call_soon_threadsafe(self._start_drain)
                return
            self._app.state.kvship.draining = True
            super().handle_exit(sig, frame)

        def _start_drain(self) -> None:
            from kvship.server.app import drain

            async def drain_then_exit() -> None:
                try:
                    await drain(self._app.state.kvship, self._grace_s)
                finally:
                    self.should_exit = True

            self._drain = asyncio.ensure_future(drain_then_exit())

        async def startup(self, sockets: Any = None) -> None:
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
        envs.passive_cpu_threads()  # before torch is imported
        return serve(args)
    if args.command == "router":
        from kvship.router.main import run

        return run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
