"""LoRA adapters with random weights for a transformers model, made and saved by the `peft`
package, and that model with the adapter merged by peft (W + scale * B @ A): the reference an
engine running the adapter must match. Shared by the engine, server, operator and router tests."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(folder: Path, model, rank: int, alpha: float, seed: int, targets=ALL_TARGETS,
                 rslora: bool = False, std: float = 0.15, merge: bool = True, **config):
    """Write the adapter with peft's save_pretrained; return ``model`` with it merged (a copy), or
    None without ``merge``. ``config``: more LoraConfig fields."""
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                      init_lora_weights=False, task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft's own init leaves B at zero or small: large random factors tell adapters apart
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval() if merge else None


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
