"""Every KVSHIP_* environment variable the operator reads, with its meaning; nothing else in
the operator reads them. Each one is the default of a command-line option (see main)."""
from __future__ import annotations

import os

# The namespaces to watch, comma-separated (globs allowed); empty: all namespaces.
WATCH_NAMESPACES = "KVSHIP_WATCH_NAMESPACES"
# The log level: DEBUG, INFO, WARNING or ERROR.
LOG_LEVEL = "KVSHIP_LOG_LEVEL"
# The liveness endpoint's URL ('' turns it off).
LIVENESS = "KVSHIP_LIVENESS"


def watch_namespaces() -> list[str]:
    return [n.strip() for n in os.environ.get(WATCH_NAMESPACES, "").split(",") if n.strip()]


def log_level() -> str:
    return os.environ.get(LOG_LEVEL, "INFO")


def liveness() -> str:
    return os.environ.get(LIVENESS, "http://0.0.0.0:8080/healthz")
