"""LoRA on a linear layer, per token: y = base(x) + scale * B[slot] @ A[slot] @ x for the adapter
slot each token's request runs with (none: -1).

The base layer is left as it is (16-bit, quantized, fused with its activation): the low-rank
delta is added to whatever it returns. A fused projection (q/k/v, gate/up) has one A per slice
and one B per slice, each kind stacked so that one shrink and one expand serve them all.
Adapter weights live in ``max_loras`` fixed slots (runner/lora_manager.py fills them, the scale
folded into B), so a step's kernels and the decode graphs never change shape.
"""
from __future__ import annotations

import torch
from torch import nn

from kvship.kernels.gemv import linear_and_shrink
from kvship.kernels.lora import lora_expand, lora_shrink
from kvship.kernels.lora_segments import DECODE_BLOCK_M, RowGroups, num_blocks
from kvship.layers.linear import RowParallelLinear, plain_weight


class LoRABatch:
    """Each token's adapter slot in the current step, and the rows grouped by adapter (the
    grouped kernels'), shared by every LoRA layer of a model: fixed buffers, written before each
    forward, which the decode graphs read where they are. ``active`` False (no token of the step
    has an adapter) skips the kernels, eagerly or by replaying the graphs captured without them."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device):
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.active = False
        capacity = num_blocks(max_tokens, max_loras, DECODE_BLOCK_M)
        # decode steps group by DECODE_BLOCK_M rows, as the graphs are captured
        self.groups = RowGroups(torch.zeros(max_tokens, dtype=torch.int32, device=device),
                                torch.zeros(capacity, 3, dtype=torch.int32, device=device), DECODE_BLOCK_M)

    def capture_state(self, active: bool) -> None:
        """As a decode graph is captured: with or without the kernels; rows grouped as decode
        steps group them (the graph keeps the block size). No row has an adapter meanwhile: each
        capture's eager warm-up runs the kernels on these buffers, where start-up's prefills
        left a grouping of more rows than a small graph's batch holds."""
        self.active = active
        self.groups.block_m = DECODE_BLOCK_M
        self.token_slots.fill_(-1)
        self.groups.blocks.zero_()

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
        self.register_buffer("lora_b", torch.zeros(max_loras, sum(self.slice_sizes), max_rank, dtype=dtype,
                                                   device=device), persistent=False)
        # a row-parallel layer that takes a gate/up output applies the activation itself
        self.gated_input = getattr(base, "gated_input", False)
        self.act = getattr(base, "act", None)
        # A row-parallel layer that reduces its own output: the delta joins its partial sums
        # first (each rank's A holds its share of the input features), so the reduction is ours.
        self.reduce = getattr(base, "reduce", False)
        if self.reduce:
            base.reduce = False

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        if self.batch.active:
            # a gate/up layer's whole product (the down projection applies the activation); the
            # down projection's input still gated: its GEMV and the shrink apply it as they read it
            act = self.act if self.gated_input and x.shape[-1] != self.in_features else None
            slots, groups = self.batch.slots(x.shape[0]), self.batch.groups
            fused = self._base_and_shrink(x, act, slots)
            if fused is None:
                y = self.base(x)
                h = lora_shrink(x, self.lora_a, slots, groups, act)
            else:
                y, h = fused
            lora_expand(y, h, self.lora_b, slots, self.slice_sizes, groups)
        else:
            y = self.base(x, *args)
        if self.reduce:
            y = self.base.tp.all_reduce(y)
            if self.base.bias is not None:
                y = y + self.base.bias
        return y

    def _base_and_shrink(self, x: torch.Tensor, act: str | None, slots: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The base product and the shrink in one launch, where the base takes the one-row GEMV
        (a 16-bit layer in a decode graph): (y, h), else None. A row-parallel base adds no bias
        here (this layer adds it after the reduction)."""
        weight = plain_weight(self.base)
        if weight is None:
            return None
        bias = None if isinstance(self.base, RowParallelLinear) else self.base.bias
        return linear_and_shrink(x, weight, bias, act, self.lora_a, slots)

    def image_shapes(self) -> tuple[torch.Size, torch.Size]:
        """The shapes of one slot's A and B, which an adapter's ``slot_image`` for this layer fills."""
        return self.lora_a.shape[1:], self.lora_b.shape[1:]

    def slot_image(self, parts: dict, a_img: torch.Tensor, b_img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's (A, B) for this layer as a slot holds them, written into zeroed host
        tensors of ``image_shapes`` (page-locked for slots on a GPU, so that their copies do not
        wait on the host): ``parts`` maps a slice's id to its (A [r, in], B [out, r] already
        scaled); a slice left out stays zero."""
        for slice_id, (a, b) in parts.items():
            i = self.slice_ids.index(slice_id)
            r, start = a.shape[0], i * self.max_rank
            a_img[start:start + r].copy_(a)
            b_img[self.col_starts[i]:self.col_starts[i] + self.slice_sizes[i], :r].copy_(b)
        return a_img, b_img

    def write_slot(self, slot: int, image: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy an adapter's ``slot_image`` into ``slot`` (None: the adapter leaves this layer alone)."""
        if image is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
        else:
            self.lora_a[slot].copy_(image[0], non_blocking=True)
            self.lora_b[slot].copy_(image[1], non_blocking=True)
