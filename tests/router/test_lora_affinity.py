"""LoRA affinity in the picker (issue 52): a request for an adapter goes to an engine holding it,
within the load bound, else by load; an engine using it (in a GPU slot) comes first. Against two
real `kvship serve` engines on a tiny model, one started with the adapter."""
from __future__ import annotations

import httpx
import pytest

from conftest import make_tiny_model
from kvship.router.pool import Adapters, Endpoint, Pool, endpoint_from_url
from kvship.router.scrape import Scraper, parse_lora_info
from lora_adapters import make_adapter
from server_utils import start_server

SERVE = ("--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
         "--num-kv-blocks", "32", "--enable-lora", "--allow-runtime-lora-updating")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-affinity")
    base = make_tiny_model(root / "base", "llama-gqa-tied")
    make_adapter(root / "sql", base, rank=4, alpha=8, seed=1)
    holding = start_server(str(root / "base"), *SERVE, "--lora-modules", f"sql={root / 'sql'}")
    try:
        other = start_server(str(root / "base"), *SERVE)
    except BaseException:
        holding.stop()
        raise
    yield holding, other, root
    other.stop()
    holding.stop()


def _scraped_pool(*servers) -> Pool:
    pool = Pool([endpoint_from_url(s.url) for s in servers], "least-load", load_epsilon=0.25)
    scraper = Scraper(pool, 0.5)
    scraper.scrape_once()
    scraper.stop()
    return pool


@pytest.mark.timeout(300)
def test_adapter_requests_prefer_the_engine_holding_it(engines):
    holding, other, root = engines
    pool = _scraped_pool(holding, other)
    a, b = pool.endpoints
    assert a.adapters.held == {"sql"} and b.adapters.held == frozenset()
    # the holder takes them while within the bound (load + 1 <= 1.25 x the mean), then load decides
    picks = [pool.pick([], model="sql") for _ in range(3)]
    assert [p.endpoint for p in picks] == [a, a, b]
    for p in picks:
        pool.done(p.endpoint)
    a.in_flight = 1  # the base model, or an adapter nobody holds: least load
    assert pool.pick([], model="tiny").endpoint is b
    pool.done(b)  # else the two tie and the addresses (random ports) decide
    assert pool.pick([], model="nope").endpoint is b
    a.in_flight = b.in_flight = 0

    load = httpx.post(other.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")})
    assert load.status_code == 200, load.text
    pool = _scraped_pool(holding, other)
    assert all(e.adapters.held == {"sql"} for e in pool.endpoints)
    assert {pool.pick([], model="sql").endpoint.address for _ in range(2)} == {e.address for e in pool.endpoints}
    assert httpx.post(other.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200


def test_lora_info_labels_give_the_adapters_in_use():
    text = ('# TYPE kvship:lora_requests_info gauge\n'
            'kvship:lora_requests_info{max_lora="4",model_name="m",running_lora_adapters="sql,fr",'
            'waiting_lora_adapters="de"} 1.7e9\nkvship:num_requests_running{model_name="m"} 3\n')
    assert parse_lora_info(text) == {"sql", "fr", "de"}
    assert parse_lora_info('kvship:num_requests_running{model_name="m"} 3\n') is None  # no LoRA there


def test_an_engine_using_the_adapter_comes_before_one_that_only_holds_it():
    using = Endpoint("a:1", "http://a:1", adapters=Adapters(frozenset({"sql"}), frozenset({"sql"})))
    holding = Endpoint("b:1", "http://b:1", adapters=Adapters(frozenset({"sql"}), frozenset()))
    pool = Pool([holding, using], "round-robin")
    assert [pool.pick([], model="sql").endpoint for _ in range(2)] == [using, using]
