"""Embeddings against sentence-transformers on the same weights: tiny random Qwen3 embedding
models made here and saved as sentence-transformers saves them (a Qwen3Model checkpoint without
"model." prefixes or an output projection, modules.json, the Pooling config), served by the
engine directly and by a real `kvship serve` through the official openai SDK."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from conftest import write_word_tokenizer
from server_utils import assert_error, start_server

st = pytest.importorskip("sentence_transformers")

TEXTS = ["t1 t2 t3", "t5", "t7 t8 t9 t10 t11 t12 t13 t14 t15 t16 t17 t18 t19 t20 t21 t22 t23 t24 t25",
         " ".join(f"t{i % 300}" for i in range(90)), "t300 t301"]
HIDDEN = 64


def _save_st_model(root: Path, name: str, pooling: str, normalize: bool, config_extra: dict):
    import transformers
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, eos_token_id=319, bos_token_id=0, **config_extra)
    torch.manual_seed(1)
    base = transformers.Qwen3Model(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that they matter in the comparison
        for n, p in base.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
    hf = root / f"{name}-base"
    base.save_pretrained(hf)
    write_word_tokenizer(hf, cfg.vocab_size)
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "pad_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}))
    modules = [Transformer(str(hf)), Pooling(HIDDEN, pooling)] + ([Normalize()] if normalize else [])
    model = st.SentenceTransformer(modules=modules, device="cpu")
    folder = root / name
    model.save(str(folder))
    return folder, model


@pytest.fixture(scope="module")
def st_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    return {
        # Qwen3-Embedding's recipe: last token, unit length; a Matryoshka model
        "last": _save_st_model(root, "last", "lasttoken", True, {"is_matryoshka": True}),
        "mean": _save_st_model(root, "mean", "mean", False, {}),
    }


def _reference(model, texts: list[str]) -> np.ndarray:
    return model.encode(texts, convert_to_numpy=True, batch_size=2).astype(np.float32)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_engine_matches_sentence_transformers(st_models, kind):
    from kvship.config import EngineConfig
    from kvship.core.engine import LLMEngine

    folder, ref_model = st_models[kind]
    # A small step budget: the inputs run in several batches, the longest one alone.
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=32,
                                    max_num_batched_tokens=32))
    assert engine.task == "embed" and engine.pooling.mode == kind
    assert engine.pooling.normalize is (kind == "last")
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    got = torch.stack(engine.embed(ids)).numpy()
    want = _reference(ref_model, TEXTS)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert engine.kv.num_used_blocks == 0  # the cache was scratch: every block is back


@pytest.fixture(scope="module")
def embed_server(st_models):
    folder, _ = st_models["last"]
    srv = start_server(str(folder), "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "64MiB")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_embeddings_through_the_openai_sdk(st_models, embed_server):
    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ref_model = st_models["last"][1]
    model = client.models.list().data[0].id
    want = _reference(ref_model, TEXTS)
    # Left out, the SDK asks for base64 and decodes it itself; asked for explicitly, it hands the
    # base64 text (little-endian float32) back as it came.
    for fmt in (openai.omit, "float", "base64"):
        res = client.embeddings.create(model=model, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in res.data] == list(range(len(TEXTS)))
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if fmt == "base64" else d.embedding
                        for d in res.data], dtype=np.float32)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
        assert res.usage.prompt_tokens == res.usage.total_tokens == sum(len(t.split()) for t in TEXTS)
    one = client.embeddings.create(model=model, input="t5")
    np.testing.assert_allclose(one.data[0].embedding, want[1], atol=2e-5, rtol=1e-4)
    # token ids instead of text
    ids = client.embeddings.create(model=model, input=[[1, 2, 3], [5]])
    np.testing.assert_allclose([d.embedding for d in ids.data], want[:2], atol=2e-5, rtol=1e-4)
    # a Matryoshka prefix, back to unit length
    short = client.embeddings.create(model=model, input=TEXTS[:2], dimensions=16)
    prefix = want[:2, :16] / np.linalg.norm(want[:2, :16], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in short.data], prefix, atol=2e-5, rtol=1e-4)


def test_embedding_request_mistakes_are_400s(embed_server):
    url = embed_server.url
    cases = [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], [400]]}, "input"),  # outside the vocabulary
        ({"input": "t1 " * 200}, "input"),  # past --max-model-len 128
        ({"input": "t1", "dimensions": 65}, "dimensions"),
        ({"input": "t1", "dimensions": 0}, "dimensions"),
        ({"input": "t1", "encoding_format": "int8"}, "encoding_format"),
    ]
    for body, param in cases:
        assert_error(httpx.post(url + "/v1/embeddings", json=body, timeout=30), 400, param)
    lone_surrogate = b'{"input": "\\ud800x"}'  # valid JSON, not valid Unicode
    assert_error(httpx.post(url + "/v1/embeddings", content=lone_surrogate, timeout=30,
                            headers={"Content-Type": "application/json"}), 400, "input")
    # this server embeds: completions and chat are refused, saying why
    err = assert_error(httpx.post(url + "/v1/completions", json={"prompt": "t1", "max_tokens": 2}, timeout=30),
                       400, "model")
    assert "embeddings" in err["message"] and err["code"] == "wrong_task"
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "t1"}]},
                            timeout=30), 400, "model")
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_pooling_read_from_sentence_transformers_files(st_models, tmp_path):
    from kvship.loader import ModelSourceError, resolve_model

    assert resolve_model(str(st_models["mean"][0])).pooling.matryoshka_dimensions is None
    last = resolve_model(str(st_models["last"][0])).pooling
    assert (last.mode, last.normalize, last.allows_dimensions(16, HIDDEN), last.allows_dimensions(65, HIDDEN)) == (
        "last", True, True, False)
    # a pipeline step kvship does not run is refused, not skipped
    import shutil

    folder = tmp_path / "dense"
    shutil.copytree(st_models["mean"][0], folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelSourceError, match="Dense"):
        resolve_model(str(folder))
