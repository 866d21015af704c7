"""`spec.engine.args`, checked with the engine's own parser (kvship.cli_args, torch-free): one
source of truth for the flags. Refused: unknown flags, abbreviations (`--po` for `--port`:
the engine's parser would take them), values the engine would refuse, and every spelling of
the flags the operator sets from the spec (`-tp 4` as much as `--tensor-parallel-size=4`)."""
from __future__ import annotations

import argparse

from kvship.cli_args import add_engine_args, add_server_args

from .schema import SpecError

# parser destination -> what sets it instead
OWNED = {
    "model": "spec.model",
    "model_opt": "spec.model",
    "host": "the operator (0.0.0.0)",
    "port": "the operator (the probes check 8000)",
    "tensor_parallel_size": "spec.tensorParallelSize",
    "served_model_name": "spec.servedModelName",
    "shutdown_timeout": "spec.shutdownTimeoutSeconds",
}
WHERE = "spec.engine.args"


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _Refused(message)

    def exit(self, status: int = 0, message: str | None = None):  # type: ignore[override]
        raise _Refused(message or "not a serving flag")


def _parser() -> _Parser:
    p = _Parser(prog="kvship serve", allow_abbrev=False, add_help=False)
    add_engine_args(p)
    add_server_args(p)
    for action in p._actions:  # only what the args set shows up in the result
        action.default = argparse.SUPPRESS
    return p


def given(args: list[str]) -> dict[str, object]:
    """The parser destinations ``args`` set (args already passed ``check``)."""
    try:
        return vars(_parser().parse_args(list(args)))
    except _Refused:
        return {}


def check(args: list[str], also_owned: dict[str, str] | None = None) -> None:
    """Raise SpecError (path spec.engine.args) naming the first problem. ``also_owned``: more
    parser destinations the spec sets in this case (dest -> what sets it)."""
    owned = {**OWNED, **(also_owned or {})}
    parser = _parser()
    try:
        given = vars(parser.parse_args(list(args)))
    except _Refused as e:
        hint = " (abbreviations are not accepted: spell flags out; see `kvship serve --help`)" \
            if "unrecognized arguments" in str(e) else ""
        raise SpecError(WHERE, f"{e}{hint}") from None
    for dest in given:
        if dest in owned:
            flags = next((a.option_strings for a in parser._actions if a.dest == dest), [])
            shown = "/".join(flags) or "a positional MODEL"
            raise SpecError(WHERE, f"may not set {shown}: it comes from {owned[dest]}")
