"""The engine process's side of core/engine_process.py: build the LLMEngine, say so, then serve the
pipe (the messages are listed there) until the server says stop or is gone."""
from __future__ import annotations

import logging
import pickle
import signal
import threading
from collections.abc import Callable

import numpy as np

from kvship.config import EngineConfig
from kvship.core.async_engine import engine_stats
from kvship.core.engine import LLMEngine
from kvship.core.output_pipe import OutputPacker
from kvship.sampling_params import StructuredOutput

log = logging.getLogger(__name__)


def engine_main(config: EngineConfig, conn, log_level: int) -> None:
    """Build the engine, say so, then serve the pipe until told to stop or the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which says why it cannot start
        conn.send(("failed", portable(exc)))
        return
    conn.send(("ready", dict(config=engine.config, tokenizer=engine.tokenizer, model_name=engine.model_name,
                             max_model_len=engine.max_model_len, sampling_defaults=engine.sampling_defaults,
                             task=engine.task, pooling=engine.pooling,
                             embedding_size=engine.model_config.hidden_size, stats=engine_stats(engine, 0))))
    try:
        EngineLoop(engine, conn).run()
    finally:
        engine.shutdown()


class EngineLoop:
    def __init__(self, engine, conn):
        self.engine = engine
        self.conn = conn
        self.send_lock = threading.Lock()  # grammar threads answer too
        self.adds_seen = 0
        self.packer = OutputPacker()

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def run(self) -> None:
        try:
            self.loop()
        except EOFError:
            log.warning("the server's process is gone; the engine stops")

    def loop(self) -> None:
        engine = self.engine
        while True:
            changed = False
            if self.conn.poll(None if not engine.has_work() else 0):
                while True:
                    message = self.conn.recv()  # EOFError: the server is gone, and so is this process
                    if message[0] == "stop":
                        return
                    self.handle(message)
                    changed = True
                    if not self.conn.poll(0):
                        break
            outputs = engine.step() if engine.has_work() else []
            if outputs or changed:
                self.send_outputs(outputs)

    def send_outputs(self, outputs: list) -> None:
        self.send(("step", [self.packer.pack(o) for o in outputs], engine_stats(self.engine, 0), self.adds_seen))

    def handle(self, message: tuple) -> None:
        kind, engine = message[0], self.engine
        if kind == "add":
            _, request_id, ids, params, arrival_time, lora_request, final_only = message
            self.adds_seen += 1
            try:
                engine.add_request(request_id, ids, params, arrival_time, lora_request, final_only)
            except Exception as exc:  # a client mistake: handed back to the caller
                self.send(("rejected", request_id, portable(exc)))
        elif kind == "abort":
            final = engine.abort(message[1])
            if final is not None:  # a reader is still waiting: end its stream
                self.send_outputs([final])
        elif kind == "grammar":  # compiled beside the loop, as AsyncEngine does in a worker thread
            threading.Thread(target=self.answer, args=(message[1], self.prepare_grammar, message[2]),
                             daemon=True).start()
        elif kind == "lora":
            self.answer(message[1], engine.add_lora, message[2])
        elif kind == "embed":
            self.answer(message[1], self.embed, message[2])

    def prepare_grammar(self, spec: StructuredOutput) -> None:
        self.engine.grammars.prepare(spec)  # kept in the engine's cache; nothing goes back

    def embed(self, prompts: list[list[int]]) -> list[np.ndarray]:
        return [t.float().cpu().numpy() for t in self.engine.embed(prompts)]

    def answer(self, call: int, fn: Callable, arg: object) -> None:
        """``fn(arg)``'s value, or the error it raised, to the server's caller ``call``."""
        try:
            value, error = fn(arg), None
        except Exception as exc:  # InvalidParamsError and the like: the caller's to report
            value, error = None, portable(exc)
        self.send(("done", call, value, error))


def portable(exc: BaseException) -> BaseException:
    """An error the server's process can unpickle as it is (InvalidParamsError with its param, and
    the like), else a RuntimeError naming it: one that fails to unpickle there would end the
    server's pipe reader."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to cross means: send its words instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")
