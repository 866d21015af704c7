"""`kvship router`: the picker (gRPC ext_proc + its HTTP port) and, unless --picker-only, Envoy
in front of it; SIGTERM or SIGINT stops both."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures

from kvship.ports import free_port
from kvship.router.discovery import parse_target
from kvship.router.discovery_k8s import parse_k8s_target
from kvship.router.pool import POLICIES, Endpoint, Pool, endpoint_from_url


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", action="append", default=[], metavar="URL",
                   help="a model server (`kvship serve`) to route to, e.g. http://10.0.0.5:8000; repeat or "
                   "comma-separate for several")
    p.add_argument("--discover", metavar="HOST:PORT",
                   help="the model servers are every address HOST resolves to, read again every 2 s (in "
                   "Kubernetes: a headless Service of the ready replicas); instead of --endpoint")
    p.add_argument("--discover-k8s", metavar="NAMESPACE/SERVICE:PORT",
                   help="the model servers are the ready endpoints of SERVICE's EndpointSlices, watched through "
                   "the Kubernetes API (in-cluster service account, else $KUBECONFIG; no cluster DNS needed); "
                   "PORT is the pods' port number or the Service port's name; instead of --endpoint")
    p.add_argument("--host", default="0.0.0.0", help="Envoy's listening address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="Envoy's listening port (default: %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default="prefix",
                   help="prefix: the endpoint that served the prompt's leading blocks, within a load bound; "
                   "least-load: fewest queued; round-robin (default: %(default)s)")
    p.add_argument("--picker-only", action="store_true",
                   help="run only the endpoint picker, for a gateway that already runs Envoy")
    p.add_argument("--picker-host", default="127.0.0.1",
                   help="the picker's gRPC address (default: %(default)s; 0.0.0.0 with --picker-only)")
    p.add_argument("--picker-port", type=int, default=9002, help="the picker's gRPC port (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="the picker's /health and /metrics port (default: %(default)s)")
    p.add_argument("--envoy-admin-port", type=int, default=0,
                   help="Envoy's admin port on 127.0.0.1 (default: a free one)")
    p.add_argument("--prefix-block-chars", type=int, default=64,
                   help="characters of the rendered prompt in one prefix block (default: %(default)s)")
    p.add_argument("--load-epsilon", type=float, default=0.25,
                   help="prefix policy: an endpoint takes a request while its load stays within (1 + this) x "
                   "the mean (default: %(default)s)")
    p.add_argument("--scrape-interval", type=float, default=0.5,
                   help="seconds between reads of each endpoint's /metrics (default: %(default)s)")
    p.add_argument("--envoy-cluster", choices=("original-dst", "endpoints"), default="original-dst",
                   help="original-dst: Envoy dials whatever address the picker names (a retry goes to the same "
                   "one); endpoints: a cluster of the --endpoint replicas, a retry going to the picker's next "
                   "fallback (default: %(default)s)")
    p.add_argument("--no-endpoint-header", dest="endpoint_header", action="store_false",
                   help="do not add the response header x-kvship-endpoint naming the replica that served")
    p.add_argument("--kv-events", action="append", default=[], metavar="ZMQ_ADDRESS",
                   help="an endpoint's KV-cache events (its `kvship serve --kv-events-config` endpoint), e.g. "
                   "tcp://10.0.0.5:5557: one per --endpoint, in the same order; the prefix policy then scores "
                   "what each engine reports caching")
    p.add_argument("--kv-events-port", type=int, default=None, metavar="PORT",
                   help="every endpoint publishes its KV-cache events on this port of its own host")
    p.add_argument("--kv-events-topic", default="", help="the events' ZMQ topic (default: all)")
    p.add_argument("--hold-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="scale from zero: with no ready endpoint, hold a request up to this long for one to become "
                   "ready before answering 503 (default: 0, answer at once)")
    p.add_argument("--hold-max-pending", type=int, default=256,
                   help="most requests held at once; more get 503 at once (default: %(default)s)")
    p.add_argument("--demand-command", default=None, metavar="CMD",
                   help="run this command (no shell; KVSHIP_ROUTER_PENDING in its environment) when a request "
                   "starts waiting with none before it: the signal that starts a replica")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def kv_event_sources(endpoints: list[Endpoint], addresses: list[str], port: int | None,
                     discover: bool) -> Callable[[Pool], dict[str, str]] | None:
    """What the subscriber connects to, read again as the pool changes: endpoint address -> its
    KV-event ZMQ address, from --kv-events (one per --endpoint) or --kv-events-port (any host)."""
    if addresses and port is not None:
        raise ValueError("give --kv-events or --kv-events-port, not both")
    if port is not None:
        return lambda pool: {e.address: f"tcp://{e.address.rpartition(':')[0]}:{port}" for e in pool.endpoints}
    if not addresses:
        return None
    if discover:
        raise ValueError("--discover finds endpoints as they come: give their events' port (--kv-events-port)")
    if len(addresses) != len(endpoints):
        raise ValueError(f"--kv-events: one per --endpoint, in order ({len(endpoints)} endpoints, "
                         f"{len(addresses)} event addresses)")
    for a in addresses:
        if "://" not in a:
            raise ValueError(f"--kv-events: not a ZMQ address such as tcp://10.0.0.5:5557: {a!r}")
    fixed = {e.address: a for e, a in zip(endpoints, addresses)}
    return lambda pool: fixed


def run(args: argparse.Namespace) -> int:
    import grpc

    from kvship.router.discovery import Discovery
    from kvship.router.discovery_k8s import KubernetesDiscovery
    from kvship.router.envoy import EnvoyProcess, bootstrap
    from kvship.router.extproc import Picker, add_to_server
    from kvship.router.hold import Holding, demand_command
    from kvship.router.kv_events import CachedBlocks, EventSubscriber
    from kvship.router.scrape import Scraper
    from kvship.router.stats import RouterStats, StatsServer
    from kvship.router.tracing import PickTracer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    log = logging.getLogger("kvship.router")
    try:
        urls = [u.strip() for item in args.endpoint for u in item.split(",") if u.strip()]
        endpoints = [endpoint_from_url(u) for u in urls]
        if args.discover and args.discover_k8s:
            raise ValueError("give --discover or --discover-k8s, not both")
        if args.discover:
            parse_target(args.discover)
        if args.discover_k8s:
            parse_k8s_target(args.discover_k8s)
        discovering = bool(args.discover or args.discover_k8s)
        if discovering and (endpoints or args.envoy_cluster == "endpoints"):
            raise ValueError("--discover (or --discover-k8s) takes the place of --endpoint "
                             "(and of --envoy-cluster endpoints)")
        if args.prefix_block_chars < 1 or args.load_epsilon < 0 or args.scrape_interval <= 0:
            raise ValueError("--prefix-block-chars must be >= 1, --load-epsilon >= 0, --scrape-interval > 0")
        if args.hold_timeout < 0 or args.hold_max_pending < 1:
            raise ValueError("--hold-timeout must be >= 0 and --hold-max-pending >= 1")
        event_sources = kv_event_sources(endpoints, args.kv_events, args.kv_events_port, discovering)
    except ValueError as exc:
        print(f"kvship router: error: {exc}", file=sys.stderr)
        return 2
    if not endpoints and not discovering:
        log.warning("no --endpoint: every request gets 503 until endpoints are configured")

    cached = CachedBlocks() if event_sources else None
    pool = Pool(endpoints, args.policy, args.load_epsilon, cached=cached)
    subscriber = (EventSubscriber(cached, lambda: event_sources(pool), args.kv_events_topic)
                  if event_sources else None)
    holding = Holding(pool, args.hold_timeout, args.hold_max_pending,
                      demand_command(args.demand_command) if args.demand_command else None)
    stats = RouterStats(pool, holding)
    scraper = Scraper(pool, args.scrape_interval)
    tracer = PickTracer.from_env()
    discovery = (Discovery(pool, args.discover) if args.discover
                 else KubernetesDiscovery(pool, args.discover_k8s) if args.discover_k8s else None)
    # Held requests each keep a worker: room for all of them besides the ones being picked.
    executor = futures.ThreadPoolExecutor(max_workers=64 + args.hold_max_pending, thread_name_prefix="kvship-extproc")
    grpc_server = grpc.server(executor)
    add_to_server(Picker(pool, stats, args.prefix_block_chars, holding, tracer), grpc_server)
    picker_port = grpc_server.add_insecure_port(f"{args.picker_host}:{args.picker_port}")
    http = StatsServer(stats, args.picker_host if not args.picker_only else "0.0.0.0", args.metrics_port)
    envoy = None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if discovery is not None:
            discovery.start()
        scraper.start()
        if subscriber is not None:
            subscriber.start()
        grpc_server.start()
        http.start()
        log.info("endpoint picker on %s:%d (gRPC ext_proc), /health and /metrics on :%d, policy %s, %d endpoints",
                 args.picker_host, picker_port, http.port, args.policy, len(endpoints))
        if not args.picker_only:
            picker_host = "127.0.0.1" if args.picker_host in ("0.0.0.0", "") else args.picker_host
            config = bootstrap(args.host, args.port, picker_host, picker_port,
                               args.envoy_admin_port or free_port(), endpoint_header=args.endpoint_header,
                               picker_timeout_s=10.0 + args.hold_timeout,
                               static_endpoints=[e.address for e in endpoints]
                               if args.envoy_cluster == "endpoints" else None)
            envoy = EnvoyProcess(config, log_level="warning" if args.log_level != "debug" else "info")
            envoy.start()
            log.info("kvship router listening on http://%s:%d (envoy)", args.host, args.port)
        while not stop.wait(0.5):
            if envoy is not None and envoy.poll() is not None:
                log.error("envoy exited with %s", envoy.poll())
                return 1
        return 0
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        if envoy is not None:
            envoy.stop()
        grpc_server.stop(grace=2).wait(5)
        executor.shutdown(wait=False, cancel_futures=True)
        http.stop()
        scraper.stop()
        if subscriber is not None:
            subscriber.stop()
        if tracer is not None:
            tracer.shutdown()
        if discovery is not None:
            discovery.stop()
