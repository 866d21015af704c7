"""Which LoRA adapters the device holds, and each step's token -> adapter-slot map.

Adapters are read from disk once into a host LRU cache (--max-cpu-loras) and copied into one of
--max-loras device slots when a step needs them, evicting the slot used least recently (the
scheduler never runs more distinct adapters at once than there are slots). The model's attention
and MLP projections are wrapped in layers/lora.py's LoRALinear, whose A/B buffers are the slots.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from kvship.kernels.lora_segments import segment_blocks
from kvship.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvship.layers.lora import LoRABatch, LoRALinear
from kvship.loader.lora_adapter import LoRAAdapter, LoRAAdapterError, read_adapter
from kvship.lora_request import LoRARequest
from kvship.sequence import Batch

log = logging.getLogger(__name__)


def _wrap_spec(name: str, module: nn.Module, hidden: int) -> tuple[int, list[tuple[object, int]]] | None:
    """(input features, slices) of a projection adapters may target, or None."""
    if name.endswith("self_attn.qkv_proj") and isinstance(module, QKVParallelLinear):
        q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
        return hidden, [("q", q), ("k", kv), ("v", kv)]
    if name.endswith("mlp.gate_up_proj") and isinstance(module, MergedColumnParallelLinear):
        return hidden, list(enumerate(module.out_sizes))
    if name.endswith(("self_attn.o_proj", "mlp.down_proj")) and isinstance(module, RowParallelLinear):
        return module.in_features, [(None, module.out_features)]
    return None


class LoRAManager:
    def __init__(self, model: nn.Module, hidden_size: int, max_loras: int, max_rank: int, max_cpu_loras: int,
                 max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.batch = LoRABatch(max_tokens, device)
        self.device = device
        self.packed = getattr(model, "packed", {})  # checkpoint module name -> (ours, shard id)
        self.layers: dict[str, LoRALinear] = {}
        for name, module in list(model.named_modules()):
            spec = _wrap_spec(name, module, hidden_size)
            if spec is not None:
                parent, _, child = name.rpartition(".")
                layer = LoRALinear(module, *spec, max_loras, max_rank, self.batch, dtype, device)
                layer.act = getattr(module, "act", None)
                setattr(model.get_submodule(parent), child, layer)
                self.layers[name] = layer
        if not self.layers:
            raise ValueError(f"--enable-lora: {type(model).__name__} has no projections LoRA adapters can target")
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recent first
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # adapter id -> weights, least recent first
        self.loads = 0  # copies into device slots (tests: an adapter is loaded once)

    def check(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter's weights (read once, then from the host cache); LoRAAdapterError naming
        what does not fit this model."""
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is None:
            adapter = read_adapter(request.lora_path, self.max_rank)
            self._validate(adapter)
            self.cpu[request.lora_int_id] = adapter
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(request.lora_int_id)
        return adapter

    def _target(self, module: str) -> tuple[LoRALinear, object]:
        parent, _, leaf = module.rpartition(".")
        ours, sid = self.packed.get(leaf, (leaf, None))
        layer = self.layers.get(f"{parent}.{ours}")
        if layer is None or sid not in layer.slice_ids:
            raise LoRAAdapterError(f"LoRA target module {module!r} has no place in this model")
        return layer, sid

    def _validate(self, adapter: LoRAAdapter) -> None:
        for module, (a, b) in adapter.weights.items():
            layer, sid = self._target(module)
            out = layer.slice_sizes[layer.slice_ids.index(sid)]
            if a.shape[1] != layer.in_features or b.shape[0] != out:
                raise LoRAAdapterError(f"LoRA module {module!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                       f"the model's [{out}, {layer.in_features}] projection")

    def _slot(self, request: LoRARequest, in_use: set[int]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return self.slot_of[lora_id]
        if len(self.slot_of) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        else:
            victim = next((i for i in self.slot_of if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than --max-loras {self.max_loras} adapters")
            slot = self.slot_of.pop(victim)
        adapter = self.check(request)
        by_layer: dict[str, dict] = {}
        for module, (a, b) in adapter.weights.items():
            layer, sid = self._target(module)
            by_layer.setdefault(id(layer), {})[sid] = (a, b * adapter.scale)
        for layer in self.layers.values():
            mats = by_layer.get(id(layer), {})
            for sid in layer.slice_ids:
                a, b = mats.get(sid, (None, None))
                layer.set_slot(slot, sid, a, b)
        self.slot_of[lora_id] = slot
        self.loads += 1
        log.info("LoRA adapter %s (id %d) loaded into slot %d", request.lora_name, lora_id, slot)
        return slot

    def prepare(self, batch: Batch) -> None:
        """Each token's slot for this step, into the shared buffer (one copy); for a step with a
        prompt chunk (never a graph's) also its runs of one adapter, for the grouped kernels."""
        requests = {s.lora.lora_int_id: s.lora for s in batch.seqs if s.lora is not None}
        slots = {i: self._slot(r, set(requests)) for i, r in requests.items()}
        per_token = [-1 if s.lora is None else slots[s.lora.lora_int_id]
                     for s, n in zip(batch.seqs, batch.num_new_tokens) for _ in range(n)]
        cuda = self.device.type == "cuda"
        host = torch.tensor(per_token, dtype=torch.int32, pin_memory=cuda)
        self.batch.slots(len(per_token)).copy_(host, non_blocking=True)
        self.batch.active = bool(requests)
        self.batch.blocks = None
        if cuda and requests and max(batch.num_new_tokens) > 1:
            blocks = torch.tensor(segment_blocks(per_token), dtype=torch.int32).T.contiguous()
            self.batch.blocks = blocks.pin_memory().to(self.device, non_blocking=True)
