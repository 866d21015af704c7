"""/metrics carries speculative decoding's counters under vLLM's names, from the engine's stats."""
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvship.config import EngineConfig
from kvship.core.async_engine import EngineStats
from kvship.core.speculative import SpecStats
from kvship.server.metrics import EngineStatsCollector


def scrape(spec):
    stats = EngineStats(1, 0, 10, 2, 8, 0, 0, 0, 5, 7, spec_decode=spec)
    engine = SimpleNamespace(stats=lambda: stats, is_alive=lambda: True, config=EngineConfig())
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(SimpleNamespace(engine=engine, model_name="m")))
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("position")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_spec_decode_counters():
    got = scrape(SpecStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=5, accepted_per_pos=[3, 2, 0]))
    assert got[("kvship:spec_decode_num_drafts_total", None)] == 3
    assert got[("kvship:spec_decode_num_draft_tokens_total", None)] == 9
    assert got[("kvship:spec_decode_num_accepted_tokens_total", None)] == 5
    per_pos = {p: v for (name, p), v in got.items() if name == "kvship:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 3, "1": 2, "2": 0}


def test_no_spec_decode_series_without_speculation():
    assert not [k for k in scrape(None) if k[0].startswith("kvship:spec_decode")]


def test_serving_engine_reports_its_counters(tmp_path):
    """The serving engine's stats carry the speculator's counters, as the requests made them."""
    import asyncio

    from conftest import make_tiny_model
    from kvship.core.async_engine import AsyncEngine
    from kvship.sampling_params import SamplingParams

    make_tiny_model(tmp_path / "m", "llama-gqa-tied")
    engine = AsyncEngine.from_config(EngineConfig(str(tmp_path / "m"), device="cpu", max_model_len=128, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}))
    try:
        async def go():
            async for out in engine.generate([5, 6, 7, 8] * 6, SamplingParams(temperature=0, max_tokens=20,
                                                                                 ignore_eos=True), "r"):
                last = out
            return last

        out = asyncio.run(asyncio.wait_for(go(), timeout=120))
        assert len(out.outputs[0].token_ids) == 20
        spec = engine.stats().spec_decode
        assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_accepted_tokens == sum(spec.accepted_per_pos)
        assert scrape(spec)[("kvship:spec_decode_num_drafts_total", None)] == spec.num_drafts
    finally:
        engine.shutdown()
