"""`kvship-operator`: run the LLMDeployment operator.

    kvship-operator                      # all namespaces, in-cluster or $KUBECONFIG
    kvship-operator -n team-a -n team-b  # only these namespaces
"""
from __future__ import annotations

import argparse
import logging
import os

import kopf

from .handlers import registry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvship-operator", description="Run the kvship LLMDeployment operator.")
    ap.add_argument(
        "-n", "--namespace", action="append", default=[],
        help="watch only this namespace (repeatable; globs allowed); default: all namespaces "
        "(env KVSHIP_WATCH_NAMESPACES, comma-separated)",
    )
    ap.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: in-cluster, then $KUBECONFIG)")
    ap.add_argument("--log-level", default=os.environ.get("KVSHIP_LOG_LEVEL", "INFO"),
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    ap.add_argument("--liveness", default=os.environ.get("KVSHIP_LIVENESS", "http://0.0.0.0:8080/healthz"),
                    help="liveness endpoint URL ('' to disable)")
    args = ap.parse_args(argv)
    if not args.namespace and os.environ.get("KVSHIP_WATCH_NAMESPACES"):
        args.namespace = [n.strip() for n in os.environ["KVSHIP_WATCH_NAMESPACES"].split(",") if n.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kopf.run(
        registry=registry,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=True,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(kubeconfig=args.kubeconfig),
    )


if __name__ == "__main__":
    main()
