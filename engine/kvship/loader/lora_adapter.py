"""Reading a PEFT LoRA adapter: ``adapter_config.json`` (r, lora_alpha, target_modules,
use_rslora) and ``adapter_model.safetensors`` (``...layers.N.self_attn.q_proj.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]). What kvship cannot apply is refused here, by name:
modules other than the attention and MLP projections, DoRA and the other PEFT options that
change the product (UNSERVED_FEATURES), biases, extra saved modules, ranks above the engine's
--max-lora-rank."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT options that change what the adapter computes at inference: ignored, each would give
# wrong answers, so an adapter that sets one is refused
UNSERVED_FEATURES = (
    ("use_dora", "DoRA"),
    ("fan_in_fan_out", "transposed weights"),
    ("lora_bias", "a bias on lora_B"),
    ("alora_invocation_tokens", "activated LoRA"),
    ("use_qalora", "QA-LoRA"),
    ("use_bdlora", "block-diagonal LoRA"),
    ("layer_replication", "layer replication"),
    ("arrow_config", "Arrow routing"),
    ("target_parameters", "adapters on parameters"),
    ("trainable_token_indices", "trainable token embeddings"),
)


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; ``reason`` is "not_found" or "unsupported"."""

    def __init__(self, message: str, reason: str = "unsupported"):
        super().__init__(message)
        self.reason = reason


@dataclass
class LoRAAdapter:
    rank: int
    scale: float  # lora_alpha / r, or / sqrt(r) with rsLoRA
    # "model.layers.3.self_attn.q_proj" -> (A [r, in], B [out, r]), float32 on the CPU
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def adapter_folder(path: str) -> str:
    """A local folder holding the adapter's files; a hub id is fetched (from the local cache
    without network)."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, CONFIG_FILE)):
            raise LoRAAdapterError(f"no {CONFIG_FILE} in LoRA adapter folder {path!r}", "not_found")
        return local
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE])
    except Exception as e:  # not a hub id, not found, no network: all say the same to the client
        raise LoRAAdapterError(f"LoRA adapter {path!r} is neither a local folder nor a hub id that could be "
                               f"fetched ({type(e).__name__})", "not_found") from None


def _download(url: str, folder: str) -> None:
    """The adapter's two files from below ``url`` (the URL of its folder) into ``folder``."""
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            with urllib.request.urlopen(f"{url.rstrip('/')}/{name}", timeout=60) as r, \
                    open(os.path.join(folder, name), "wb") as f:
                shutil.copyfileobj(r, f)
    except OSError as e:  # HTTP errors, no connection
        raise LoRAAdapterError(f"LoRA adapter {url!r} could not be fetched ({e})", "not_found") from None


def read_adapter(path: str, max_rank: int) -> LoRAAdapter:
    """The adapter at ``path``: a local folder, a hub id, or a URL of its folder (fetched each
    time it is read: the engine keeps what it read in its host cache)."""
    if path.startswith(("http://", "https://")):
        with tempfile.TemporaryDirectory(prefix="kvship-lora-") as folder:
            _download(path, folder)
            return _read_folder(folder, path, max_rank)
    return _read_folder(adapter_folder(path), path, max_rank)


def _read_folder(folder: str, path: str, max_rank: int) -> LoRAAdapter:
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        cfg = json.load(f)
    _check_config(cfg, max_rank)
    weights_path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise LoRAAdapterError(f"no {WEIGHTS_FILE} in LoRA adapter folder {path!r}", "not_found")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        module, kind = _split_key(key)
        pairs.setdefault(module, {})[kind] = tensor.float()
    rank = int(cfg["r"])
    weights = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"LoRA adapter module {module!r} lacks its lora_A or lora_B matrix")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"LoRA adapter module {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} "
                                   f"are not of rank r={rank}")
        weights[module] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {path!r} holds no lora_A/lora_B matrices")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return LoRAAdapter(rank, scale, weights)


def _check_config(cfg: dict, max_rank: int) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"adapter type {cfg['peft_type']!r} is not served; only LORA adapters are")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"LoRA rank r={rank!r} in adapter_config.json is not a positive integer")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA rank r={rank} exceeds --max-lora-rank {max_rank}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_MODULES]
        if unknown:
            raise LoRAAdapterError(f"LoRA target module(s) {', '.join(unknown)} not supported; kvship applies "
                                   f"adapters to {', '.join(TARGET_MODULES)}")
    for key, what in UNSERVED_FEATURES:
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter uses {what} ({key} in adapter_config.json), which is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"LoRA modules_to_save {cfg['modules_to_save']} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA {key} (per-module ranks or alphas) is not supported")


def _split_key(key: str) -> tuple[str, str]:
    """"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" ->
    ("model.layers.0.self_attn.q_proj", "lora_A")."""
    name = key.removeprefix("base_model.model.")
    parts = name.split(".")
    if len(parts) < 4 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise LoRAAdapterError(f"LoRA adapter tensor {key!r} is not a lora_A/lora_B weight of a supported module")
    module = ".".join(parts[:-2])
    if parts[-3] not in TARGET_MODULES:
        raise LoRAAdapterError(f"LoRA target module {parts[-3]!r} ({module}) not supported; kvship applies "
                               f"adapters to {', '.join(TARGET_MODULES)}")
    return module, parts[-2]
