"""gpt-oss's experts as a layer: the stacks kernels/gpt_oss_moe.py multiplies, loaded from the
checkpoint's layouts and sharded over tensor-parallel ranks by the intermediate dimension.

A checkpoint holds each layer's experts as a few stacked tensors under ``mlp.experts.``:
OpenAI's MXFP4 release ``gate_up_proj_blocks`` [E, 2I, H / 32, 16] and ``gate_up_proj_scales``
[E, 2I, H / 32] (``down_proj_*`` likewise, [E, H, ...]); a 16-bit one (as transformers saves it)
``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H], transposed; both ``gate_up_proj_bias``
[E, 2I] and ``down_proj_bias`` [E, H]. Gate and up rows alternate (gate i, up i); they are stored
here gate rows first, then up rows, as the kernels read them. The down bias is added by rank 0
only: the ranks' outputs are partial sums."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from kvship.kernels.gpt_oss_moe import MXFP4_BLOCK, GptOssExperts, gpt_oss_moe
from kvship.loader.source import WeightRef
from kvship.parallel import TPContext


class GptOssMoEExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPContext, mxfp4: bool,
                 alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.tp, self.num_experts, self.hidden, self.mxfp4 = tp, num_experts, hidden, mxfp4
        self.intermediate = tp.shard(intermediate, "moe intermediate size")
        self.alpha, self.limit = alpha, limit
        if mxfp4 and (self.intermediate % MXFP4_BLOCK or hidden % MXFP4_BLOCK):
            raise ValueError(f"MXFP4 experts need their sizes per rank ({hidden}, {self.intermediate}) to be "
                             f"multiples of {MXFP4_BLOCK}: use a tensor-parallel size that divides them so")
        e, i, h = num_experts, self.intermediate, hidden

        def param(*shape, dtype=None):
            p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
            p.weight_loader = self.weight_loader
            return p
        codes = torch.uint8 if mxfp4 else None
        self.w13 = param(e, 2 * i, h // 2 if mxfp4 else h, dtype=codes)
        self.w2 = param(e, h, i // 2 if mxfp4 else i, dtype=codes)
        self.w13_bias = param(e, 2 * i, dtype=torch.float32)
        self.w2_bias = param(e, h, dtype=torch.float32)
        if mxfp4:
            self.w13_scale = param(e, 2 * i, h // MXFP4_BLOCK, dtype=torch.uint8)
            self.w2_scale = param(e, h, i // MXFP4_BLOCK, dtype=torch.uint8)
        else:
            self.w13_scale = self.w2_scale = None
        self._experts: GptOssExperts | None = None

    # checkpoint suffix (after "mlp.experts.") -> our parameter
    CHECKPOINT = {"gate_up_proj": "w13", "gate_up_proj_blocks": "w13", "gate_up_proj_scales": "w13_scale",
                  "gate_up_proj_bias": "w13_bias", "down_proj": "w2", "down_proj_blocks": "w2",
                  "down_proj_scales": "w2_scale", "down_proj_bias": "w2_bias"}

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        """Any of the checkpoint's expert tensors (CHECKPOINT names the parameter it fills)."""
        t = ref.load()
        if t.dim() == 4:  # MXFP4 blocks [E, N, K / 32, 16] -> codes [E, N, K / 2]
            t = t.flatten(-2)
        elif param is self.w13 or param is self.w2:  # 16-bit, as transformers holds it: [E, K, N]
            t = t.transpose(1, 2)
        if (param.dtype == torch.uint8) != (t.dtype == torch.uint8):
            raise ValueError(f"gpt-oss experts: a {t.dtype} tensor for {'MXFP4' if self.mxfp4 else '16-bit'} "
                             "experts (the checkpoint's quantization_config says how they are stored)")
        i, start = self.intermediate, self.tp.rank * self.intermediate
        if any(param is p for p in (self.w13, self.w13_scale, self.w13_bias)):
            # rows alternate gate, up: this rank's rows of each, gate rows first
            t = torch.cat([t[:, 0::2][:, start:start + i], t[:, 1::2][:, start:start + i]], dim=1)
        elif param is self.w2_bias:
            t = t if self.tp.rank == 0 else torch.zeros_like(t)
        else:  # down: the columns of this rank's inputs, in stored units (a code byte holds 2, a scale 32)
            cols = t.shape[-1] // self.tp.size
            t = t[..., self.tp.rank * cols:(self.tp.rank + 1) * cols]
        if t.shape != param.shape:
            raise ValueError(f"gpt-oss experts: a tensor of shape {tuple(t.shape)} for one of {tuple(param.shape)}")
        param.data.copy_(t)

    def experts(self) -> GptOssExperts:
        """The stacks as the kernels take them, made once and kept: loading copies into these same
        parameters; a move or cast (``_apply``) may replace them, and drops the copy."""
        if self._experts is None:
            self._experts = GptOssExperts(self.w13, self.w13_bias, self.w2, self.w2_bias, self.w13_scale,
                                          self.w2_scale, self.alpha, self.limit)
        return self._experts

    def _apply(self, fn, recurse=True):
        self._experts = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return gpt_oss_moe(x, self.experts(), weights, ids)

    def dummy_checkpoint(self, prefix: str, generator: torch.Generator, dtype: torch.dtype, device
                         ) -> Iterator[tuple[str, WeightRef]]:
        """Random tensors named and shaped as the single-rank checkpoint holds them (benchmarks):
        MXFP4 codes of any value with scales near 2 ** -6, 16-bit weights with std 0.02."""
        e, h, i = self.num_experts, self.hidden, self.intermediate * self.tp.size
        shapes = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
        for name, (e_, n, k) in shapes.items():
            if self.mxfp4:
                codes = torch.randint(0, 256, (e_, n, k // MXFP4_BLOCK, 16), generator=generator, device=device,
                                      dtype=torch.uint8)
                scales = torch.randint(119, 123, (e_, n, k // MXFP4_BLOCK), generator=generator, device=device,
                                       dtype=torch.uint8)
                yield f"{prefix}.{name}_blocks", _ref(codes)
                yield f"{prefix}.{name}_scales", _ref(scales)
            else:
                w = torch.empty(e_, k, n, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
                yield f"{prefix}.{name}", _ref(w)
            bias = torch.empty(e_, n, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
            yield f"{prefix}.{name}_bias", _ref(bias)


def _ref(t: torch.Tensor) -> WeightRef:
    return WeightRef(t.shape, t.dtype, lambda slices: t if slices is None else t[slices])
