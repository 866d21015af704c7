"""`kvship router --discover HOST:PORT` (issue 51, in Kubernetes a headless Service of the ready
replicas): the pool follows what the name resolves to, keeping what it knows of the endpoints
that stay, and a discovered endpoint is picked only once its /metrics answered."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvship.router.discovery import Discovery, parse_target, resolve, set_addresses
from kvship.router.pool import Pool, endpoint_from_url
from kvship.router.scrape import Scraper
from test_picker import MetricsPage

pytestmark = pytest.mark.timeout(60)


def test_resolve_every_address_of_a_name():
    assert "127.0.0.1:8000" in resolve("localhost", 8000)
    assert resolve("no-such-host.invalid", 8000) == []  # no replica yet: an empty pool, not an error
    assert parse_target("qwen-serving.team-a.svc:8000") == ("qwen-serving.team-a.svc", 8000)
    for bad in ("qwen-serving", ":8000", "host:port"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_target(bad)


def test_set_addresses_keeps_endpoints_that_stay_and_forgets_those_that_go():
    a = endpoint_from_url("http://10.0.0.1:8000")
    pool = Pool([a], "prefix")
    pick = pool.pick([b"block"])
    assert pick.endpoint is a and pool.index.match(a.address, [b"block"]) == 1

    added, removed = set_addresses(pool, ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert added == ["10.0.0.2:8000"] and removed == []
    assert pool.endpoints[0] is a and a.in_flight == 1  # its load and prefix index are kept
    assert pool.endpoints[1].healthy is False  # picked only after its first good scrape
    assert pool.pick([b"other"]).endpoint is a

    added, removed = set_addresses(pool, ["10.0.0.2:8000"])
    assert removed == ["10.0.0.1:8000"] and [e.address for e in pool.endpoints] == ["10.0.0.2:8000"]
    assert pool.index.match("10.0.0.1:8000", [b"block"]) == 0
    assert pool.pick([b"block"]) is None  # the one left has not answered yet


def test_discovered_replica_is_scraped_then_picked():
    page = MetricsPage(waiting=1, running=2, kv=0.3)
    port = int(page.url.rsplit(":", 1)[1])
    pool = Pool([], "least-load")
    discovery, scraper = Discovery(pool, f"localhost:{port}"), Scraper(pool, 0.5)
    try:
        discovery.refresh()
        assert [e.address for e in pool.endpoints] == [f"127.0.0.1:{port}"] and pool.pick([]) is None
        scraper.scrape_once()
        pick = pool.pick([])
        assert pick.endpoint.address == f"127.0.0.1:{port}" and pick.endpoint.running == 2
    finally:
        scraper.stop()
        page.close()


@pytest.mark.parametrize("args, expect", [
    (["--discover", "qwen-serving"], "HOST:PORT"),
    (["--discover", "localhost:8000", "--endpoint", "http://127.0.0.1:8001"], "takes the place of --endpoint"),
])
def test_cli_refuses_bad_discovery(args, expect):
    proc = subprocess.run([sys.executable, "-m", "kvship.cli", "router", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and expect in proc.stderr, proc.stderr
