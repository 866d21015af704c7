"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts, SwiGLU MLPs, whose outputs are summed with the router's weights.

Experts are stacked, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], and run in
kernels/fused_moe.py. Tensor parallelism shards each expert's intermediate dimension as the
dense MLP does; the router is replicated. Quantized experts stay quantized in fused_moe's
layout (codes in w13/w2, scales in w13_scale/w2_scale, offsets in *_bias): FP8 per row or per
block, integer codes of 4 or 8 bits, or NVFP4 (e2m1 codes two a byte, float32 scales per 16,
multiplied by kernels/nvfp4_moe.py). A stack takes the storage of its first matrix; later ones
stored more coarsely are widened to it, finer ones and act-order (g_idx) experts refused."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.kernels.fused_moe import ExpertScales, fused_moe, route
from kvship.kernels.nvfp4_moe import nvfp4_moe
from kvship.kernels.quant_linear import pack
from kvship.parallel import TPContext
from kvship.quant import QuantizedTensor, quantize
from kvship.quant.tensor import widened

__all__ = ["MoEExperts", "moe_reference", "route"]  # the models take route from here


class MoEExperts(nn.Module):
    """``quant``: the model's kvship.quant.QuantScheme (None: 16-bit experts)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPContext, quant=None):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = tp.shard(intermediate, "moe intermediate size")
        self.quant = quant
        self.groups = {"w13": 0, "w2": 0}  # inputs per scale, 0 for one scale per row
        self.bits = {"w13": 8, "w2": 8}  # integer codes: 4 (two a byte) or 8
        self.e2m1: bool | None = None  # NVFP4 codes; set by the first quantized matrix
        for name in ("w13_scale", "w2_scale", "w13_bias", "w2_bias"):
            self.register_buffer(name, None)
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
        if isinstance(src, QuantizedTensor) and src.g_idx is not None:  # checked on every matrix: GPTQ
            # drops the table of one whose groups happen to be in order, so the first may pass
            raise ValueError(f"expert {expert}'s {'down' if part is None else 'gate/up'} matrix is quantized with "
                             "act-order (GPTQ desc_act, a g_idx table), which mixture-of-experts layers do not "
                             "support; use a checkpoint quantized with desc_act false")
        if stack.numel() == 0:
            stack = self._allocate(name, src)
        if isinstance(src, QuantizedTensor) != (getattr(self, name + "_scale") is not None):
            raise ValueError(f"the experts of one layer come partly quantized, partly in 16 bits ({name})")
        if isinstance(src, QuantizedTensor):
            if self.e2m1 is None:
                self.e2m1 = src.e2m1
            elif src.e2m1 != self.e2m1:
                raise ValueError(f"the experts of one layer come partly in NVFP4, partly stored otherwise ({name})")
            packed = pack(self._conform(name, src), stack.device)
            getattr(self, name + "_scale")[expert, rows].copy_(packed.scales)
            if packed.biases is not None:
                getattr(self, name + "_bias")[expert, rows].copy_(packed.biases)
            src = packed.qweight
        stack.data[expert, rows].copy_(src)

    def _conform(self, name: str, qt: QuantizedTensor) -> QuantizedTensor:
        """``qt`` in its stack's storage (set by the stack's first matrix): the same, or widened
        to more bits, smaller groups or explicit offsets; never narrowed."""
        fp8, bits, group = getattr(self, name).dtype == torch.float8_e4m3fn, self.bits[name], self.groups[name]
        biased = getattr(self, name + "_bias") is not None
        if qt.is_fp8 or fp8:
            if qt.is_fp8 != fp8 or _group(qt) != group:
                raise ValueError(f"the experts of one layer have different FP8 storage ({name})")
            return qt
        mine = _group(qt)
        if (qt.bits, mine, qt.biases is not None) == (bits, group, biased):
            return qt
        if qt.bits > bits or (qt.biases is not None and not biased) or (group == 0) != (mine == 0) or \
                (group and mine % group):
            raise ValueError(f"the experts of one layer are stored differently ({name}: {bits}-bit codes in groups of "
                             f"{group or 'a row'}{' with offsets' if biased else ''}, then {qt.bits}-bit in groups "
                             f"of {mine or 'a row'}{' with offsets' if qt.biases is not None else ''}); a layer's "
                             "experts must share one storage or come coarsest last")
        return widened(qt, bits, group or qt.group_size, biased)

    def _allocate(self, name: str, first) -> nn.Parameter:
        """The stack ``name`` stored as ``first`` (its first matrix) is: quantized codes, scales
        (and offsets), or 16-bit (a checkpoint that leaves its experts unquantized)."""
        device = getattr(self, name).device
        rows, cols = (2 * self.intermediate, self.hidden) if name == "w13" else (self.hidden, self.intermediate)
        if isinstance(first, QuantizedTensor):
            group = _group(first)
            if group and (group < 16 or group & (group - 1)):
                raise ValueError(f"quantized experts with groups of {group} inputs are not supported (powers of two "
                                 "from 16 are, as 32 and 128 are)")
            self.groups[name], self.bits[name] = group, first.bits
            shape = (self.num_experts, rows, first.scales.shape[1])
            sdtype = torch.float32 if first.is_fp8 or first.e2m1 else torch.float16  # as quant_linear.pack stores them
            self.register_buffer(name + "_scale", torch.empty(shape, dtype=sdtype, device=device))
            if first.biases is not None:
                self.register_buffer(name + "_bias", torch.empty(shape, dtype=sdtype, device=device))
            dtype = torch.float8_e4m3fn if first.is_fp8 else torch.uint8
            cols = -(-cols // 2) if first.bits == 4 else cols
        else:
            dtype = self._dtype
        stack = nn.Parameter(torch.empty(self.num_experts, rows, cols, dtype=dtype, device=device),
                             requires_grad=False)
        stack.weight_loader = self.weight_loader
        setattr(self, name, stack)
        return stack

    def scales(self) -> ExpertScales:
        """How the stacks are stored, as the kernels take it (no scales: 16-bit)."""
        return ExpertScales(self.w13_scale, self.w2_scale, self.groups["w13"], self.groups["w2"], self.w13_bias,
                            self.w2_bias, self.bits["w13"], self.bits["w2"], bool(self.e2m1))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [T, H], routing (weights, ids) [T, k] -> this rank's partial sums [T, H], plus ``add``
        (this rank's partial sums of a shared expert) when given."""
        if self.e2m1:
            return nvfp4_moe(x, self.w13, self.w2, weights, ids, self.scales(), add)
        return fused_moe(x, self.w13, self.w2, weights, ids, self.scales(), add)


def _group(qt: QuantizedTensor) -> int:
    """Inputs per scale of a quantized matrix, 0 for one scale per row."""
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
