"""PEFT-format LoRA adapters with random weights for a transformers model, and that model with an
adapter merged into its weights (W + scale * B @ A): the reference an engine running the adapter
must match. Shared by the engine and server tests."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(folder: Path, model, rank: int, alpha: float, seed: int, targets=ALL_TARGETS,
                 rslora: bool = False, std: float = 0.15, **config):
    """Write the adapter; return ``model`` with it merged (a copy)."""
    g = torch.Generator().manual_seed(seed)
    merged = copy.deepcopy(model)
    scale = alpha / (math.sqrt(rank) if rslora else rank)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets or not hasattr(module, "weight"):
            continue
        out_f, in_f = module.weight.shape
        a = torch.randn(rank, in_f, generator=g) * std
        b = torch.randn(out_f, rank, generator=g) * std
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
        with torch.no_grad():
            merged.get_submodule(name).weight += scale * b @ a
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
           "use_rslora": rslora, "bias": "none", "task_type": "CAUSAL_LM"} | config
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return merged.eval()


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
