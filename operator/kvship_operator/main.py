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
from .webhook import Webhook, no_server


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
    ap.add_argument("--webhook-port", type=int, default=0,
                    help="serve the validating admission webhook on this port (0: no webhook)")
    ap.add_argument("--webhook-addr", default="0.0.0.0", help="the webhook's listening address")
    ap.add_argument("--webhook-cert-dir", default=None,
                    help="folder with the webhook's tls.crt and tls.key (and ca.crt), as the chart mounts it")
    ap.add_argument("--webhook-managed", default=None, metavar="NAME",
                    help="create and keep the ValidatingWebhookConfiguration NAME (a domain: x.y.z) pointing "
                    "at --webhook-host; default: the chart provides it")
    ap.add_argument("--webhook-host", default=None, help="the host in a managed configuration's webhook URL")
    args = ap.parse_args(argv)
    if not args.namespace:
        args.namespace = env.watch_namespaces()
    return args


# Every thread the operator starts carries this prefix in its name, so that a test can check
# that none outlives it.
THREAD_PREFIX = "kvship-operator"


async def operate(*, namespaces: list[str], kubeconfig: str | None = None, liveness: str | None = None,
                  stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
                  pod_address: PodAddress = pod_ip_address, webhook: Webhook | None = None) -> None:
    """Run the operator until it is stopped (a signal, or ``stop_flag``), then wait for the
    threads it started: sync handlers run in a pool of our own that is shut down here, and
    blocking calls made from async code use the loop's default pool, which asyncio.run joins.
    Every call those threads make has its own time limit, so the wait is bounded.
    ``pod_address`` says where the autoscaler scrapes a pod (tests without kubelets point pods
    at servers on loopback). ``webhook``: serve the admission webhook (None: off)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(thread_name_prefix=f"{THREAD_PREFIX}-io"))
    settings = kopf.OperatorSettings()
    settings.execution.executor = ThreadPoolExecutor(thread_name_prefix=f"{THREAD_PREFIX}-handler")
    settings.admission.server = webhook.server() if webhook else no_server
    settings.admission.managed = webhook.managed if webhook else None
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
    webhook = None
    if args.webhook_port:
        webhook = Webhook(port=args.webhook_port, addr=args.webhook_addr, cert_dir=args.webhook_cert_dir,
                          host=args.webhook_host, managed=args.webhook_managed)
    asyncio.run(operate(namespaces=args.namespace, kubeconfig=args.kubeconfig, liveness=args.liveness,
                        webhook=webhook))


if __name__ == "__main__":
    main()
