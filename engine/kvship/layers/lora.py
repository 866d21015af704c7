"""LoRA on a linear layer, per token: y = base(x) + scale * B[slot] @ A[slot] @ x for the adapter
slot each token's request runs with (none: -1).

The base layer is left as it is (16-bit, quantized, fused with its activation): the low-rank
delta is added to whatever it returns. A fused projection (q/k/v, gate/up) has one A per slice,
stacked so that one shrink serves them all, and one B per slice, expanded into the slice's
columns. Adapter weights live in ``max_loras`` fixed slots (runner/lora_manager.py fills them,
the scale folded into B), so a step's kernels and the decode graphs never change shape.
"""
from __future__ import annotations

import torch
from torch import nn

from kvship.kernels.activation import act_and_mul
from kvship.kernels.lora import lora_expand, lora_shrink


class LoRABatch:
    """Each token's adapter slot in the current step, shared by every LoRA layer of a model: one
    fixed buffer, written before each forward, which the decode graphs read where it is.
    ``active`` False (no token of the step has an adapter) lets eager steps skip the kernels;
    graphs are captured with it on."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.active = False
        self.blocks: torch.Tensor | None = None  # an eager step's runs of one adapter (kernels/lora.py)

    def slots(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > self.token_slots.shape[0]:
            raise RuntimeError(f"a step of {num_tokens} tokens exceeds the LoRA slot buffer "
                               f"({self.token_slots.shape[0]} tokens)")
        return self.token_slots[:num_tokens]


class LoRALinear(nn.Module):
    """``slices``: (shard id, output features) of each matrix fused in ``base``, in column order
    ("q", "k", "v"; 0, 1 for gate/up; None for a plain projection)."""

    def __init__(self, base: nn.Module, in_features: int, slices: list[tuple[object, int]], max_loras: int,
                 max_rank: int, batch: LoRABatch, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.batch = batch
        self.in_features = in_features
        self.max_rank = max_rank
        self.slice_ids = [sid for sid, _ in slices]
        self.slice_sizes = [n for _, n in slices]
        self.col_starts = [sum(self.slice_sizes[:i]) for i in range(len(slices))]
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slices) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        for i, n in enumerate(self.slice_sizes):
            self.register_buffer(f"lora_b{i}", torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device),
                                 persistent=False)
        # a row-parallel layer that takes a gate/up output applies the activation itself
        self.gated_input = getattr(base, "gated_input", False)

    @property
    def lora_b(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_b{i}") for i in range(len(self.slice_sizes))]

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        if not self.batch.active:
            return self.base(x, *args)
        if self.gated_input and x.shape[-1] != self.in_features:
            x = act_and_mul(x, self.base.act)  # the delta needs the activated input too
        y = self.base(x)  # a gate/up layer's whole product: the down projection applies the activation
        slots, blocks = self.batch.slots(x.shape[0]), self.batch.blocks
        h = lora_shrink(x, self.lora_a, slots, blocks)
        for i, b in enumerate(self.lora_b):
            lora_expand(y, h, b, slots, i * self.max_rank, self.col_starts[i], blocks)
        return y

    def set_slot(self, slot: int, slice_id, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one slice of an adapter into ``slot`` (A [r, in], B [out, r] already scaled;
        None: the adapter leaves this slice alone)."""
        i = self.slice_ids.index(slice_id)
        rows = slice(i * self.max_rank, (i + 1) * self.max_rank)
        self.lora_a[slot, rows].zero_()
        self.lora_b[i][slot].zero_()
        if a is not None:
            r = a.shape[0]
            self.lora_a[slot, rows][:r].copy_(a)
            self.lora_b[i][slot, :, :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()
