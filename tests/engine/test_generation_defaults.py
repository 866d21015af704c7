"""Requests that leave sampling fields out get the model's generation_config.json values."""
import json
import shutil
from types import SimpleNamespace

from kvship.config import EngineConfig
from kvship.core.engine import LLMEngine, sampling_defaults
from kvship.server.params import sampling_params
from kvship.server.protocol import CompletionRequest


def test_defaults_taken_from_generation_config():
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5, "eos_token_id": 2}
    assert sampling_defaults(gen) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert sampling_defaults({"do_sample": False, "temperature": 0.6}) == {}


class _Limits:
    """The parts of an engine client that sampling_params reads."""

    def __init__(self, defaults: dict[str, float]):
        self.sampling_defaults = defaults
        self.config = EngineConfig(max_num_seqs=8)
        self.tokenizer = SimpleNamespace(vocab_size=49152)  # stop_token_ids / logit_bias are checked against it


def test_request_fields_override_defaults():
    engine = _Limits({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1})
    left_out = sampling_params(CompletionRequest(model="m", prompt="x", max_tokens=4), engine)
    assert (left_out.temperature, left_out.top_p, left_out.repetition_penalty) == (0.6, 0.9, 1.1)
    given = sampling_params(CompletionRequest(model="m", prompt="x", max_tokens=4, temperature=0.0, top_p=1.0), engine)
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0.0, 1.0, 1.1)


def test_engine_reads_the_models_generation_config(tiny_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama-gqa-tied"][0], folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 40}))
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=16))
    assert engine.sampling_defaults == {"temperature": 0.7, "top_k": 40}
    off = LLMEngine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=16, generation_defaults=False))
    assert off.sampling_defaults == {}


def test_bundled_model_samples_as_its_model_card_recommends(bundled):
    from kvship.loader import resolve_model

    source = resolve_model(None)  # the GGUF carries no generation config of its own
    assert sampling_defaults(source.generation_config) == {"temperature": 0.2, "top_p": 0.9}
    assert source.generation_config["eos_token_id"]  # the file's own entries are kept
