"""llama.cpp's hybrid Gated DeltaNet files ("qwen3next", "qwen35", "qwen35moe") as the HF
checkpoints models/qwen3_next.py loads: the config's linear-attention keys from the file's
ssm.* metadata, and the layer tensors with the transforms of llama.cpp's converter undone.

The converter stores A_log as A = -exp(A_log) ("ssm_a"), dt_bias as "ssm_dt.bias", every
RMSNorm weight but the DeltaNet's gated norm as 1 + w, the conv1d as [channels, kernel], and
Qwen3-Next's per-key-head in_proj_qkvz as Qwen3.5's q|k|v rows ("attn_qkv") and z ("attn_gate")
(in_proj_ba stays grouped, "ssm_ba"). For Qwen3.5 with fewer key heads than value heads it also
reorders the value heads from grouped by key head (g0v0, g0v1, g1v0, ...) to tiled (g0v0, g1v0,
g0v1, ...) in every tensor indexed by them: here they are put back, so that a rank's slice of
value heads keeps its key heads (tensor parallelism) and the model sees the HF layout."""
from __future__ import annotations

import logging
import re
from typing import Any

import torch

from kvship.quant import QuantizedTensor, QuantRef

from .source import WeightRef, apply_slices

log = logging.getLogger(__name__)

# llama.cpp architecture -> (HF architecture, model_type)
HYBRID_ARCHS = {
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
_TILED_ARCHS = ("qwen35", "qwen35moe")
# the two tensors whose llama.cpp names do not follow blk.N.<part>.weight
_SSM_A = re.compile(r"^blk\.(\d+)\.ssm_a$")
_SSM_DT = re.compile(r"^blk\.(\d+)\.ssm_dt\.bias$")


def hybrid_hf_name(gname: str) -> str | None:
    m = _SSM_A.match(gname)
    if m:
        return f"model.layers.{m[1]}.linear_attn.A_log"
    m = _SSM_DT.match(gname)
    return f"model.layers.{m[1]}.linear_attn.dt_bias" if m else None


def hybrid_config(meta: dict, arch: str, cfg: dict) -> dict[str, Any]:
    """The HF config keys of a hybrid file: its linear attention (ssm.group_count key heads of
    ssm.state_size, ssm.time_step_rank value heads sharing ssm.inner_size), the full-attention
    layers (every full_attention_interval-th) and the rotated part of each attention head."""
    p = arch + "."
    hv = int(meta[p + "ssm.time_step_rank"])
    interval = int(meta.get(p + "full_attention_interval", 4))
    rope_dims = int(meta.get(p + "rope.dimension_count") or cfg["head_dim"])
    cls, model_type = HYBRID_ARCHS[arch]
    return {
        "architectures": [cls], "model_type": model_type,
        "linear_num_key_heads": int(meta[p + "ssm.group_count"]), "linear_num_value_heads": hv,
        "linear_key_head_dim": int(meta[p + "ssm.state_size"]),
        "linear_value_head_dim": int(meta[p + "ssm.inner_size"]) // hv,
        "linear_conv_kernel_dim": int(meta[p + "ssm.conv_kernel"]),
        "full_attention_interval": interval,
        "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention"
                        for i in range(cfg["num_hidden_layers"])],
        "partial_rotary_factor": rope_dims / cfg["head_dim"],
    }


def _untile(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """Value heads of ``d`` channels along ``dim`` from tiled order (r groups of hk heads) back
    to grouped (hk groups of r heads)."""
    t = t.movedim(dim, 0)
    rest = t.shape[1:]
    t = t.reshape(r, hk, d, *rest).transpose(0, 1).reshape(r * hk * d, *rest)
    return t.movedim(0, dim).contiguous()


class HybridTensors:
    """The DeltaNet and norm tensors of one hybrid file, as the HF checkpoint holds them."""

    def __init__(self, arch: str, cfg: dict):
        self.hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.r, self.dk, self.dv = hv // self.hk, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        self.tiled = arch in _TILED_ARCHS and self.r > 1

    def moved(self, hf: str, ref, quantized: bool):
        """The lazy tensor the HF checkpoint holds for a tensor this layout transforms (``ref``,
        a QuantRef when ``quantized``), None for the others."""
        if hf.endswith("linear_attn.A_log"):
            return self._mapped(ref, lambda t: self._heads(torch.log(-t.float()), 1), torch.float32)
        if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            return self._mapped(ref, lambda t: t.float() - 1.0, torch.float32)
        if not self.tiled:
            return None
        if hf.endswith("out_proj.weight"):
            return self._out_proj(ref) if quantized else self._mapped(ref, lambda t: self._heads(t, self.dv, dim=1))
        rows = self._rows_put_back(hf)
        if rows is None:
            return None
        if quantized:  # a reordering of whole rows: the blocks move with them
            return QuantRef(lambda: ref.load().map_rows(rows), ref.what, ref.shape)
        return self._mapped(ref, rows)

    def _rows_put_back(self, hf: str):
        """The reordering of a tiled tensor's rows (value heads, or conv channels of v)."""
        k2 = 2 * self.hk * self.dk
        if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return lambda t: torch.cat([t[:k2], self._heads(t[k2:], self.dv)])
        if hf.endswith("in_proj_z.weight"):
            return lambda t: self._heads(t, self.dv)
        if hf.endswith(("in_proj_b.weight", "in_proj_a.weight", "linear_attn.dt_bias")):
            return lambda t: self._heads(t, 1)
        return None

    def _heads(self, t: torch.Tensor, d: int, dim: int = 0) -> torch.Tensor:
        """Value heads of ``d`` channels along ``dim`` back in grouped order (if tiled)."""
        return _untile(t, dim, self.hk, self.r, d) if self.tiled else t

    @staticmethod
    def _mapped(ref: WeightRef, fn, dtype: torch.dtype | None = None) -> WeightRef:
        """``ref`` read whole, transformed, then sliced (each tensor is one layer's)."""
        return WeightRef(ref.shape, dtype or ref.dtype, lambda slices: apply_slices(fn(ref.load(None)), slices))

    def _out_proj(self, ref: QuantRef) -> QuantRef | WeightRef:
        """out_proj's input columns un-tiled in its blocks where a value head holds whole
        quantization groups, else dequantized (logged). Read here: the loader takes each
        tensor as it is yielded."""
        qt = ref.load()
        k = qt.shape[1]
        if qt.g_idx is not None or (qt.group_size < k and self.dv % qt.group_size):
            log.info("%s: value heads reordered in 16 bits (dequantized)", ref.what)
            w = _untile(qt.dequantize(), 1, self.hk, self.r, self.dv)
            return WeightRef(tuple(w.shape), torch.float32, lambda slices: apply_slices(w, slices))
        cols = _untile(torch.arange(k), 0, self.hk, self.r, self.dv)
        scales, biases = qt.scales, qt.biases
        if qt.group_size < k:  # whole groups move with their value head
            groups = _untile(torch.arange(k // qt.group_size), 0, self.hk, self.r, self.dv // qt.group_size)
            scales, biases = scales[:, groups], None if biases is None else biases[:, groups]
        moved = QuantizedTensor(qt.codes[:, cols].contiguous(), scales.contiguous(),
                                None if biases is None else biases.contiguous(), qt.bits, qt.group_size)
        return QuantRef(lambda: moved, ref.what, ref.shape)
