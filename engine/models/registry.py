"""Which architectures we serve, and the class for each."""
from __future__ import annotations

from typing import Any

from kvship.models.config import UnsupportedModelError

# HF architecture name -> (family, module, class)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "kvship.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "kvship.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "kvship.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "kvship.models.qwen3", "Qwen3ForCausalLM"),
}


def _arch_name(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    if not archs and cfg.get("model_type") in by_type:
        return by_type[cfg["model_type"]]
    got = ", ".join(archs) or cfg.get("model_type") or "unknown"
    raise UnsupportedModelError(
        f"unsupported model architecture {got}; kvship supports: {', '.join(sorted(ARCHITECTURES))}"
    )


def architecture_of(cfg: dict[str, Any]) -> str:
    """The family name ("llama", "qwen2", "qwen3") of an HF config dict."""
    return ARCHITECTURES[_arch_name(cfg)][0]


def model_class(cfg: dict[str, Any]):
    import importlib

    _, module, cls = ARCHITECTURES[_arch_name(cfg)]
    return getattr(importlib.import_module(module), cls)
