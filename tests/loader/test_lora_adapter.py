"""Reading PEFT LoRA adapters: scaling (alpha / r, rsLoRA), a URL source (a real HTTP server on
loopback), and what cannot be served refused by name."""
import functools
import http.server
import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from kvship.loader.lora_adapter import LoRAAdapterError, read_adapter

MODULE = "base_model.model.model.layers.0.self_attn.q_proj"


def write(folder, rank=4, keys=(MODULE,), **config):
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key in keys:
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 8)
        tensors[f"{key}.lora_B.weight"] = torch.randn(6, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                            "target_modules": ["q_proj"]} | config))
    return folder


def test_scaling_and_names(tmp_path):
    a = read_adapter(str(write(tmp_path / "a")), max_rank=16)
    assert a.rank == 4 and a.scale == 2.0 and list(a.weights) == ["model.layers.0.self_attn.q_proj"]
    assert read_adapter(str(write(tmp_path / "rs", use_rslora=True)), 16).scale == 4.0


@pytest.mark.parametrize("config, keys, words", [
    ({"use_dora": True}, (MODULE,), "DoRA"),
    ({"bias": "all"}, (MODULE,), "bias"),
    ({"modules_to_save": ["lm_head"]}, (MODULE,), "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, (MODULE,), "embed_tokens"),
    ({"rank_pattern": {"q_proj": 8}}, (MODULE,), "rank_pattern"),
    ({}, ("base_model.model.lm_head",), "lm_head"),
    ({"r": 32}, (MODULE,), "--max-lora-rank 16"),
    ({"layer_replication": [[0, 1], [0, 1]]}, (MODULE,), "layer replication"),
    ({"use_qalora": True}, (MODULE,), "QA-LoRA"),
    ({"lora_bias": True}, (MODULE,), "lora_bias"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, (MODULE,), "target_parameters"),
])
def test_unsupported_adapters_are_named(tmp_path, config, keys, words):
    folder = write(tmp_path / "x", rank=config.get("r", 4), keys=keys, **config)
    with pytest.raises(LoRAAdapterError, match=words.replace("-", "\\-")) as e:
        read_adapter(str(folder), max_rank=16)
    assert e.value.reason == "unsupported"


def test_url_source(tmp_path):
    write(tmp_path / "site" / "adapters" / "a")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/adapters"
        assert read_adapter(f"{url}/a/", max_rank=8).rank == 4
        with pytest.raises(LoRAAdapterError, match="could not be fetched") as e:
            read_adapter(f"{url}/missing", max_rank=8)
        assert e.value.reason == "not_found"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    with pytest.raises(LoRAAdapterError) as e:
        read_adapter(str(tmp_path / "nowhere" / "x"), max_rank=8)
    assert e.value.reason == "not_found"


def test_peft_made_adapters_are_read_and_activated_lora_refused(tmp_path):
    """Adapters as the peft package saves them (its whole adapter_config.json): a plain one is read
    with peft's scaling; an activated LoRA (applied only after its invocation tokens) is refused."""
    from conftest import make_tiny_model
    from lora_adapters import make_adapter

    base = make_tiny_model(tmp_path / "base", "llama-gqa-tied")
    make_adapter(tmp_path / "plain", base, rank=4, alpha=8, seed=1, rslora=True)
    a = read_adapter(str(tmp_path / "plain"), max_rank=16)
    assert a.rank == 4 and a.scale == 4.0 and len(a.weights) == 7 * base.config.num_hidden_layers
    make_adapter(tmp_path / "alora", base, rank=4, alpha=8, seed=2, merge=False, alora_invocation_tokens=[3, 4])
    with pytest.raises(LoRAAdapterError, match="activated LoRA"):
        read_adapter(str(tmp_path / "alora"), max_rank=16)
