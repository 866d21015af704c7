"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts, each a SwiGLU MLP, and their outputs are summed with the router's weights.

Experts are stacked so that one parameter holds every expert's matrix: w13 [E, 2 * I, H] (gate
rows, then up rows) and w2 [E, H, I]. Tensor parallelism shards each expert's intermediate
dimension, like the dense MLP: every rank routes the same way (the router is replicated) and
returns partial sums that the next norm reduces.

The router's choice (``route``: softmax, top k, renormalized for Mixtral and Qwen3-MoE's
norm_topk_prob) and the experts run in kernels/fused_moe.py: on a GPU, its Triton kernels (shapes
fixed by the token count, no host sync, so decode runs in CUDA graphs); elsewhere its plain-torch
path, one matmul pair per expert that has tokens. Both read only the selected experts' weights.

FP8 experts (an FP8 checkpoint, block-wise or per channel, or in-situ ``--quantization fp8``)
stay FP8 on the device: w13 and w2 hold float8_e4m3fn codes, and the buffers w13_scale
[E, 2I, G] and w2_scale [E, H, G] their float32 scales, one per output row and per block of
inputs (G = K / 128 for Qwen3-30B-A3B-FP8's 128 x 128 blocks: a block's scale repeated over its
rows) or one per row (G = 1: per-channel checkpoints, in-situ fp8, which quantizes each row of
this rank's shard). Repeated per row, scales follow any split of the rows; a tensor-parallel
split of w2's inputs must fall between blocks (QuantizedTensor.cols says so otherwise). The
stacks are allocated as the first expert's matrix arrives: its storage decides theirs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.kernels.fused_moe import ExpertScales, fused_moe, route
from kvship.parallel import TPContext
from kvship.quant import QuantizedTensor, quantize

__all__ = ["MoEExperts", "moe_reference", "route"]  # the models take route from here


class MoEExperts(nn.Module):
    """``quant``: the model's kvship.quant.QuantScheme; experts are quantized only to FP8 (the
    runner refuses other schemes for mixtures of experts)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPContext, quant=None):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = tp.shard(intermediate, "moe intermediate size")
        self.quant = quant
        self.groups = {"w13": 0, "w2": 0}  # FP8: inputs per scale, 0 for one scale per row
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        if quant is None:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.intermediate), requires_grad=False)
        else:  # allocated by the first matrix loaded into each (_allocate)
            self._dtype = torch.get_default_dtype()
            self.w13 = nn.Parameter(torch.empty(0), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(0), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, ref, shard_id: tuple[int, int | None]) -> None:
        """shard_id: (expert, 0 for gate / 1 for up) for w13; (expert, None) for w2 (down)."""
        expert, part = shard_id
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if part is None:  # down: [H, I], this rank's columns
            src, name, rows = ref.load((slice(None), slice(start, start + size))), "w2", slice(None)
        else:  # gate or up: [I, H], this rank's rows
            src, name, rows = ref.load((slice(start, start + size),)), "w13", slice(part * size, (part + 1) * size)
        if self.quant is None:
            param.data[expert, rows].copy_(src)
            return
        stack = getattr(self, name)
        if self.quant.insitu is not None:  # one matrix at a time, on the device
            src = quantize((src.dequantize() if isinstance(src, QuantizedTensor) else src).to(stack.device),
                           self.quant.insitu)
        if stack.numel() == 0:
            stack = self._allocate(name, src)
        if isinstance(src, QuantizedTensor) != (stack.dtype == torch.float8_e4m3fn):
            raise ValueError(f"the experts of one layer come partly in FP8, partly in 16 bits ({name})")
        if isinstance(src, QuantizedTensor):
            if _group(src) != self.groups[name]:
                raise ValueError(f"the experts of one layer have different FP8 scale blocks ({name})")
            getattr(self, name + "_scale")[expert, rows].copy_(src.scales)
            src = src.codes
        stack.data[expert, rows].copy_(src)

    def _allocate(self, name: str, first) -> nn.Parameter:
        """The stack ``name`` stored as ``first`` (its first matrix) is: FP8 codes and scales, or
        16-bit (a checkpoint that leaves its experts unquantized)."""
        device = getattr(self, name).device
        rows, cols = (2 * self.intermediate, self.hidden) if name == "w13" else (self.hidden, self.intermediate)
        if isinstance(first, QuantizedTensor):
            if not first.is_fp8 or first.g_idx is not None:
                raise ValueError("quantized experts are served in FP8 only")
            group = _group(first)
            if group and (group < 16 or group & (group - 1)):
                raise ValueError(f"FP8 experts with blocks of {group} inputs are not supported (powers of two "
                                 "from 16 are, as 128 is)")
            self.groups[name] = group
            self.register_buffer(name + "_scale", torch.empty(self.num_experts, rows, first.scales.shape[1],
                                                              dtype=torch.float32, device=device))
            dtype = torch.float8_e4m3fn
        else:
            dtype = self._dtype
        stack = nn.Parameter(torch.empty(self.num_experts, rows, cols, dtype=dtype, device=device),
                             requires_grad=False)
        stack.weight_loader = self.weight_loader
        setattr(self, name, stack)
        return stack

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing (weights, ids) [T, k] -> this rank's partial sums [T, H]."""
        scales = ExpertScales(self.w13_scale, self.w2_scale, self.groups["w13"], self.groups["w2"])  # None: 16-bit
        return fused_moe(x, self.w13, self.w2, weights, ids, scales)


def _group(qt: QuantizedTensor) -> int:
    """Inputs per scale of an FP8 matrix, 0 for one scale per row."""
    return 0 if qt.scales.shape[1] == 1 else qt.group_size


def moe_reference(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """Token by token, expert by expert: what MoEExperts computes, written as the definition."""
    weights, ids = route(x @ router.T, top_k, renormalize)
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out
