"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest`` spelling): a name clients use,
an id unique among the engine's adapters, and where its PEFT files are."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1; the engine's slots and the prefix cache key adapters by it
    lora_path: str  # a folder with adapter_config.json and adapter_model.safetensors (or a hub id)

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")
