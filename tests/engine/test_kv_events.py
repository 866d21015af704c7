"""KV-cache events in vLLM's wire format from a real engine: a ZMQ subscriber sees each block
that enters the prefix cache (hashes chained as a subscriber can recompute them from the tokens,
the tokens themselves, the parent), each evicted block, and the cache cleared at shutdown."""
from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest
import zmq

from conftest import make_tiny_model
from kvship.config import KVEventsConfig
from kvship.core.kv_events import block_hashes
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def test_config_is_vllms_json_and_refuses_what_it_does_not_do():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}')
    assert config.publishing and config.publisher == "zmq" and config.topic == "kv"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').publishing
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishing
    for bad, message in (('{"enable_kv_cache_events": true, "colour": 1}', "unknown field"),
                         ('{"replay_endpoint": "tcp://*:5558"}', "not implemented"),
                         ('{"publisher": "kafka"}', "zmq or null"), ("[1]", "JSON object"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.from_json(bad)


def test_block_hashes_are_the_same_in_another_process():
    code = "from kvship.core.kv_events import block_hashes; print(block_hashes(list(range(40)), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(block_hashes(list(range(40)), 16))


class Subscriber:
    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.setsockopt(zmq.RCVTIMEO, 2000)
        self.sock.connect(endpoint)
        self.seqs: list[int] = []

    def batches(self, until) -> list[list]:
        """Event lists of the batches received until `until(events so far)` holds (or 2 s pass)."""
        events: list[list] = []
        while not until(events):
            try:
                topic, seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                break
            assert topic == b"kv"
            self.seqs.append(int.from_bytes(seq, "big"))
            ts, batch = msgpack.unpackb(payload)
            assert ts > 0 and batch
            events += batch
        return events

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_engine_publishes_stored_removed_and_cleared(tmp_path):
    make_tiny_model(tmp_path / "m", "llama-gqa-tied")
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:0", topic="kv")
    llm = LLM(str(tmp_path / "m"), device="cpu", max_model_len=128, num_kv_blocks=8, kv_events=config,
              max_num_batched_tokens=256)
    sub = Subscriber(llm.engine.kv_events.endpoint)
    try:
        llm.generate([[5, 6]], SamplingParams(max_tokens=1))  # no full block: nothing to publish
        sub.batches(lambda ev: False)  # let the subscription settle (a PUB drops what comes before)
        prompt = [(7 * i) % 300 + 1 for i in range(40)]
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        events = sub.batches(lambda ev: ev)
        stored = [e for e in events if e[0] == "BlockStored"]
        assert len(stored) == 1, events  # two consecutive blocks of one prompt: one event
        _, hashes, parent, tokens, block_size, lora_id, medium = stored[0]
        assert hashes == block_hashes(prompt, 16)[:2] and parent is None
        assert tokens == prompt[:32] and block_size == 16 and lora_id is None and medium is None

        # Two prompts of seven blocks each: the cache (8 blocks) evicts the first prompt's blocks.
        others = [[(11 * i + k) % 300 + 1 for i in range(112)] for k in (1, 2)]
        for other in others:
            llm.generate([other], SamplingParams(temperature=0, max_tokens=1))
        events = sub.batches(lambda ev: any(e[0] == "BlockRemoved" and set(hashes) <= set(e[1]) for e in ev))
        removed = {h for e in events if e[0] == "BlockRemoved" for h in e[1]}
        assert set(hashes) <= removed, events
        later = {h for e in events if e[0] == "BlockStored" for h in e[1]}
        assert later >= set(block_hashes(others[0], 16)[:6])  # the last block holds the generated token
        assert llm.engine.kv.take_events() == []  # every step's events went out

        llm.shutdown()
        assert sub.batches(lambda ev: ev) == [["AllBlocksCleared"]]
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no batch lost
    finally:
        llm.shutdown()
        sub.close()
