"""Which LoRA adapters the device holds, and each step's token -> adapter-slot map.

Adapters are read from disk once into a host LRU cache (--max-cpu-loras) and copied into one of
--max-loras device slots when a step needs them, evicting the slot used least recently (the
scheduler never runs more distinct adapters at once than there are slots). The model's attention
and MLP projections are wrapped in layers/lora.py's LoRALinear, whose A/B buffers are the slots.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvship.kernels._triton import use_triton
from kvship.kernels.lora_segments import DECODE_BLOCK_M, PREFILL_BLOCK_M, group_rows
from kvship.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvship.layers.lora import LoRABatch, LoRALinear
from kvship.loader.lora_adapter import LoRAAdapter, LoRAAdapterError, read_adapter
from kvship.lora_request import LoRARequest
from kvship.models.config import ModelConfig
from kvship.sequence import Batch

log = logging.getLogger(__name__)


@dataclass
class Shard:
    """Which part of an adapter's matrices this rank holds for one projection, cut as the
    projection's own weight is: A's input features [in_start, + in), each part's B rows
    [start, + size); and the whole sizes, which an adapter's matrices must have."""

    in_features: int
    in_start: int
    full_in: int
    parts: list[tuple[object, int, int, int]]  # (shard id, size here, first row, whole size)


def _shard(name: str, module: nn.Module, cfg: ModelConfig) -> Shard | None:
    """The shard of a projection adapters may target, or None."""
    h = cfg.hidden_size
    if name.endswith("self_attn.qkv_proj") and isinstance(module, QKVParallelLinear):
        d, rank = module.head_dim, module.tp.rank
        q, kv = module.num_heads * d, module.num_kv_heads * d
        kv_start = module.kv_head_start * d
        return Shard(h, 0, h, [("q", q, rank * q, q * module.tp.size), ("k", kv, kv_start, cfg.num_key_value_heads * d),
                               ("v", kv, kv_start, cfg.num_key_value_heads * d)])
    if name.endswith("mlp.gate_up_proj") and isinstance(module, MergedColumnParallelLinear):
        rank, size = module.tp.rank, module.tp.size
        return Shard(h, 0, h, [(i, n, rank * n, n * size) for i, n in enumerate(module.out_sizes)])
    if name.endswith(("self_attn.o_proj", "mlp.down_proj")) and isinstance(module, RowParallelLinear):
        n = module.in_features
        return Shard(n, module.tp.rank * n, n * module.tp.size, [(None, module.out_features, 0, module.out_features)])
    return None


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_loras: int, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.batch = LoRABatch(max_tokens, max_loras, device)
        self.device, self.dtype = device, dtype
        self.packed = getattr(model, "packed", {})  # checkpoint module name -> (ours, shard id)
        self.layers: dict[str, LoRALinear] = {}
        self.shards: dict[str, Shard] = {}
        for name, module in list(model.named_modules()):
            shard = _shard(name, module, model_config)
            if shard is not None:
                parent, _, child = name.rpartition(".")
                layer = LoRALinear(module, shard.in_features, [(sid, n) for sid, n, _, _ in shard.parts], max_loras,
                                   max_rank, self.batch, dtype, device)
                setattr(model.get_submodule(parent), child, layer)
                self.layers[name], self.shards[name] = layer, shard
        if not self.layers:
            raise ValueError(f"--enable-lora: {type(model).__name__} has no projections LoRA adapters can target")
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recent first
        # adapter id -> each layer's slot image (None: a layer it leaves alone), least recent first
        self.cpu: OrderedDict[int, dict[str, tuple[torch.Tensor, torch.Tensor] | None]] = OrderedDict()
        self.loads = 0  # copies into device slots (tests: an adapter is loaded once)
        # what the other tensor-parallel ranks must do too: slots loaded since the last step
        # (slot, id, name, path) and the step's per-token slots ([] when no token has an adapter)
        self.sent: list[tuple[int, int, str, str]] = []
        self.step_slots: list[int] = []

    def check(self, request: LoRARequest) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """The adapter's slot images, layer by layer (read and laid out once, then from the host
        cache); LoRAAdapterError naming what does not fit this model."""
        images = self.cpu.get(request.lora_int_id)
        if images is None:
            adapter = read_adapter(request.lora_path, self.max_rank)
            self._validate(adapter)
            images = self.cpu[request.lora_int_id] = self._images(adapter)
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(request.lora_int_id)
        return images

    def _images(self, adapter: LoRAAdapter) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each layer's share of the adapter as its slot holds it: this rank's cut of each matrix,
        as the projection's weight is cut, B scaled, in the slots' dtype. Laid out as the adapter is
        read, a step that first uses it only copies one A and one B a layer."""
        by_layer: dict[str, dict] = {}
        for module, (a, b) in adapter.weights.items():
            name, sid = self._target(module)
            by_layer.setdefault(name, {})[sid] = (a, b)
        touched = [(name, layer) for name, layer in self.layers.items() if name in by_layer]
        shapes = [shape for _, layer in touched for shape in layer.image_shapes()]
        # one page-locked buffer an adapter: pinning each layer's images apart costs more than the copies
        flat = torch.zeros(sum(s.numel() for s in shapes), dtype=self.dtype, pin_memory=self.device.type == "cuda")
        views = iter(v.view(s) for v, s in zip(flat.split([s.numel() for s in shapes]), shapes))
        images: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = dict.fromkeys(self.layers)
        for name, layer in touched:
            mats, shard = by_layer[name], self.shards[name]
            parts = {sid: (mats[sid][0][:, shard.in_start:shard.in_start + shard.in_features],
                           mats[sid][1][start:start + size] * adapter.scale)
                     for sid, size, start, _ in shard.parts if sid in mats}
            images[name] = layer.slot_image(parts, next(views), next(views))
        return images

    def _target(self, module: str) -> tuple[str, object]:
        """(our projection's name, the part's shard id) for an adapter's module."""
        parent, _, leaf = module.rpartition(".")
        ours, sid = self.packed.get(leaf, (leaf, None))
        name = f"{parent}.{ours}"
        layer = self.layers.get(name)
        if layer is None or sid not in layer.slice_ids:
            raise LoRAAdapterError(f"LoRA target module {module!r} has no place in this model")
        return name, sid

    def _validate(self, adapter: LoRAAdapter) -> None:
        for module, (a, b) in adapter.weights.items():
            name, sid = self._target(module)
            shard = self.shards[name]
            out = next(full for s, _, _, full in shard.parts if s == sid)
            if a.shape[1] != shard.full_in or b.shape[0] != out:
                raise LoRAAdapterError(f"LoRA module {module!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                       f"the model's [{out}, {shard.full_in}] projection")

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
        self.load(slot, request)
        self.sent.append((slot, lora_id, request.lora_name, request.lora_path))
        return slot

    def load(self, slot: int, request: LoRARequest) -> None:
        """Copy an adapter into a device slot (on a tensor-parallel worker: as rank 0 says)."""
        images = self.check(request)
        for name, layer in self.layers.items():
            layer.write_slot(slot, images[name])
        self.slot_of[request.lora_int_id] = slot
        self.loads += 1
        log.info("LoRA adapter %s (id %d) loaded into slot %d", request.lora_name, request.lora_int_id, slot)

    def prepare(self, batch: Batch) -> None:
        """Each token's slot for this step, and its rows grouped by adapter, into the shared
        buffers."""
        requests = {s.lora.lora_int_id: s.lora for s in batch.seqs if s.lora is not None}
        slots = {i: self._slot(r, set(requests)) for i, r in requests.items()}
        per_token = [-1 if s.lora is None else slots[s.lora.lora_int_id]
                     for s, n in zip(batch.seqs, batch.num_new_tokens) for _ in range(n)]
        self.write_slots(per_token, max(batch.num_new_tokens, default=0) > 1)
        self.step_slots = per_token if requests else []

    def write_slots(self, per_token: list[int], prefill: bool) -> None:
        """A step's per-token slots (-1: no adapter) and its rows grouped by adapter, into the
        buffers the LoRA layers read (``prefill``: the step has prompt chunks)."""
        host = torch.tensor(per_token, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.batch.slots(len(per_token)).copy_(host, non_blocking=True)
        self.batch.active = max(per_token, default=-1) >= 0
        if self.batch.active:
            self._set_groups(per_token, prefill)

    def _set_groups(self, per_token: list[int], prefill: bool) -> None:
        """The rows grouped by adapter, for the grouped kernels (the torch references group rows
        themselves); decode steps by the graphs' block size."""
        if not use_triton(self.batch.token_slots):
            return
        groups = self.batch.groups
        groups.block_m = PREFILL_BLOCK_M if prefill else DECODE_BLOCK_M
        order, blocks = group_rows(per_token, groups.block_m, groups.blocks.shape[0])
        host = torch.from_numpy(np.concatenate([blocks.ravel(), order]))
        host = host.pin_memory() if self.device.type == "cuda" else host
        groups.blocks.view(-1).copy_(host[:blocks.size], non_blocking=True)
        groups.order[:len(order)].copy_(host[blocks.size:], non_blocking=True)

    def take_message(self) -> tuple[list[int], list]:
        """Rank 0: this step's (per-token slots, slot loads) for the other ranks."""
        loads, self.sent = self.sent, []
        return self.step_slots, loads

    def apply_message(self, slots: torch.Tensor | None, loads: list, num_tokens: int, prefill: bool) -> None:
        """A worker rank: the loads rank 0 made, then the step's per-token slots (None: none)."""
        for slot, lora_id, name, path in loads:
            self.load(slot, LoRARequest(name, lora_id, path))
        self.batch.active = slots is not None
        if slots is not None:
            self.batch.slots(num_tokens).copy_(slots)
            self._set_groups(slots.tolist(), prefill)
