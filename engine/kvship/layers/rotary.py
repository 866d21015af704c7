"""Rotary position embedding (rotate-half convention, as HF Llama), with llama3/linear scaling,
YaRN and Phi-3's longrope."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvship.kernels.rotary import build_cos_sin_cache


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if kind == "factors":  # each frequency's divisor, as GGUF files store llama3 scaling (rope_freqs)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn, longrope)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by the factor, those that turn more than beta_fast times are kept, and a linear ramp
    over the dimensions between blends the two (as transformers' _compute_yarn_parameters)."""
    original = scaling["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (so q.k by its square): its attention_factor, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek), else
    mscale(factor). 1 for the other kinds (longrope's lives in its own cache)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def longrope_cache(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any],
                   device=None) -> torch.Tensor:
    """Phi-3's longrope: frequencies divided per dimension by the short factors up to the
    original context and by the long factors beyond it (as vLLM does; transformers switches
    every position to the long factors once a sequence passes the original context, so the two
    agree up to that length), cos and sin scaled by sqrt(1 + ln(factor) / ln(original))."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor") or (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    caches = [build_cos_sin_cache(max_positions, head_dim, inv_freq=1.0 / (torch.tensor(
        scaling[f"{which}_factor"], dtype=torch.float64) * base), device=device) for which in ("short", "long")]
    return torch.cat([caches[0][:original], caches[1][original:]]) * attention


class RotaryEmbedding(nn.Module):
    """The cos/sin table, shared by every layer; applied by PagedAttention with the KV store."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        if scaling is not None and scaling["rope_type"] == "longrope":
            cache = longrope_cache(head_dim, max_positions, theta, scaling, device=torch.get_default_device())
        else:
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            cache = build_cos_sin_cache(max_positions, head_dim, inv_freq=inv_freq, device=torch.get_default_device())
            factor = rope_attention_factor(scaling)
            if factor != 1.0:
                cache = cache * factor
        self.register_buffer("cos_sin_cache", cache, persistent=False)


class PartialRotary(nn.Module):
    """The cos/sin table for heads whose first ``rotary_dim`` channels rotate (in pairs i,
    i + rotary_dim / 2) and the rest pass. The paged attention's kernels rotate pairs i,
    i + head_dim / 2 over a whole head, so q and k enter with their channels reordered
    (``order``: the rotated halves at the two half-heads' starts) and the unrotated pairs get
    frequency 0 (cos 1, sin 0). q.k is unchanged by the reordering; v is not reordered."""

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int, theta: float, scaling):
        super().__init__()
        if rope_attention_factor(scaling) != 1.0:
            raise ValueError("partial rotary with a scaled attention factor (YaRN) is not supported")
        inv = rope_inv_freq(rotary_dim, theta, scaling)
        inv = torch.cat([inv, torch.zeros(head_dim // 2 - rotary_dim // 2, dtype=inv.dtype)])
        cache = build_cos_sin_cache(max_positions, head_dim, inv_freq=inv, device=torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        h, half, rest = rotary_dim // 2, head_dim // 2, head_dim - rotary_dim
        order = [*range(h), *range(rotary_dim, rotary_dim + rest // 2),
                 *range(h, rotary_dim), *range(rotary_dim + rest // 2, head_dim)]
        assert len(order) == head_dim and half == h + rest // 2
        self.register_buffer("order", torch.tensor(order, device=torch.get_default_device()), persistent=False)


class NoRotary(nn.Module):
    """A table that turns nothing (cos 1, sin 0): position-free layers (Llama 4's NoPE layers)
    through the same rotary + KV-store path as the others."""

    def __init__(self, head_dim: int, max_positions: int):
        super().__init__()
        half = head_dim // 2
        cache = torch.cat([torch.ones(max_positions, half), torch.zeros(max_positions, half)], dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)
