"""`kvship-operator`: run the LLMDeployment operator.

    kvship-operator                      # all namespaces, in-cluster or $KUBECONFIG
    kvship-operator -n team-a -n team-b  # only these namespaces
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import kopf

from . import settings as env
from .handlers import registry
from .metrics_client import PodAddress, pod_ip_address


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvship-operator", description="Run the kvship LLMDeployment operator.")
    ap.add_argument(
        "-n", "--namespace", action="append", default=[],
        help="watch only this namespace (repeatable; globs allowed); default: all namespaces "
        "(env KVSHIP_WATCH_NAMESPACES, comma-separated)",
    )
    ap.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: in-cluster, then $KUBECONFIG)")
    ap.add_argument("--log-level", default=env.log_level(),
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    ap.add_argument("--liveness", default=env.liveness(),
                    help="liveness endpoint URL ('' to disable)")
    args = ap.parse_args(argv)
    if not args.namespace:
        args.namespace = env.watch_namespaces()
    return args


# Every thread the operator starts carries this prefix in its name, so that a test can check
# that none outlives it.
THREAD_PREFIX = "kvship-operator"


async def operate(*, namespaces: list[str], kubeconfig: str | None = None, liveness: str | None = None,
                  stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
                  pod_address: PodAddress = pod_ip_address) -> None:
    """Run the operator until it is stopped (a signal, or ``stop_flag``), then wait for the
    threads it started: sync handlers run in a pool of our own that is shut down here, and
    blocking calls made from async code use the loop's default pool, which asyncio.run joins.
    Every call those threads make has its own time limit, so the wait is bounded.
    ``pod_address`` says where the autoscaler scrapes a pod (tests without kubelets point pods
    at servers on loopback)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(thread_name_prefix=f"{THREAD_PREFIX}-io"))
    settings = kopf.OperatorSettings()
    settings.execution.executor = ThreadPoolExecutor(thread_name_prefix=f"{THREAD_PREFIX}-handler")
    try:
        await kopf.operator(
            registry=registry,
            settings=settings,
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=True,
            liveness_endpoint=liveness or None,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            memo=kopf.Memo(kubeconfig=kubeconfig, pod_address=pod_address),
        )
    finally:
        await asyncio.to_thread(settings.execution.executor.shutdown, wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(operate(namespaces=args.namespace, kubeconfig=args.kubeconfig, liveness=args.liveness))


if __name__ == "__main__":
    main()
