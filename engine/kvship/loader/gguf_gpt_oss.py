"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) as the checkpoint models/gpt_oss.py
reads: the config from the file's metadata, and the experts' stacks in OpenAI's layout.

llama.cpp stores each layer's experts as ``ffn_gate_exps``, ``ffn_up_exps`` [E, I, H] and
``ffn_down_exps`` [E, H, I] (with ``.bias`` [E, I] / [E, H]), usually in its MXFP4 type: blocks of
32 inputs, an e8m0 byte (the same exponent OpenAI stores) then 16 bytes whose low nibbles are
inputs 0..15 and high nibbles inputs 16..31 (OpenAI pairs inputs 2j, 2j + 1 in a byte instead).
MXFP4 stacks are repacked to ``*_blocks`` / ``*_scales`` and stay MXFP4; other types are
dequantized into the 16-bit layout (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]). Gate and
up rows are interleaved as OpenAI's checkpoints hold them. Every other tensor is dequantized at
load (the model keeps attention and router in 16 bits). Q and K rows are not permuted in these
files (llama.cpp rotates gpt-oss's halves, NEOX style)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .gguf_blocks import GGMLType
from .gguf_file import GGUFTensorInfo
from .source import WeightRef, apply_slices

ARCH = "gpt-oss"
MXFP4_BLOCK_BYTES = 17
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")


def gpt_oss_config(meta: dict, tensors: dict[str, GGUFTensorInfo], cfg: dict[str, Any]) -> dict[str, Any]:
    """The keys of gpt-oss's config.json that the generic GGUF reader does not fill."""
    p = ARCH + "."
    layers = cfg["num_hidden_layers"]
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    out = dict(num_local_experts=int(meta[p + "expert_count"]), num_experts_per_tok=int(meta[p + "expert_used_count"]),
               intermediate_size=int(meta.get(p + "expert_feed_forward_length", cfg["intermediate_size"])),
               sliding_window=int(meta.get(p + "attention.sliding_window", 128)), attention_bias=True,
               # llama.cpp's gpt-oss graph slides on even layers (its swa pattern of 2), as transformers'
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    if cfg.get("rope_scaling"):  # YaRN as OpenAI configures it (the file stores factor and original context)
        out["rope_scaling"] = dict(cfg["rope_scaling"], beta_fast=32.0, beta_slow=1.0, truncate=False)
    if gate is not None and gate.ggml_type == GGMLType.MXFP4:
        out["quantization_config"] = {"quant_method": "mxfp4"}
    return out


def mxfp4_to_openai(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp MXFP4 bytes of a [..., N, K] tensor -> OpenAI's (blocks [..., N, K/32, 16], scales
    [..., N, K/32]): the same codes and exponents, pairs regrouped."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(*shape[:-1], shape[-1] // 32, MXFP4_BLOCK_BYTES)
    scales = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 1:]))
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # inputs 0..31 of each block
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, I, ...] gate and up -> [E, 2I, ...] rows gate 0, up 0, gate 1, ..."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def _ref(make) -> WeightRef:
    t = make()  # shape and dtype: read at once (one layer's stack, as the experts' loader reads it whole)
    return WeightRef(t.shape, t.dtype, lambda slices: apply_slices(t, slices))


def expert_refs(layer: str, parts: dict[str, GGUFTensorInfo]) -> Iterator[tuple[str, WeightRef]]:
    """One layer's experts (``parts``: "gate.weight", "up.bias", ... -> the file's tensors) under the
    checkpoint names GptOssMoEExperts reads."""
    prefix = f"model.layers.{layer}.mlp.experts."
    gate, up, down = parts["gate.weight"], parts["up.weight"], parts["down.weight"]
    if gate.ggml_type == GGMLType.MXFP4:
        def packed(info):
            return mxfp4_to_openai(info.raw(), info.shape)
        (gb, gs), (ub, us) = packed(gate), packed(up)
        db, ds = packed(down)
        yield prefix + "gate_up_proj_blocks", _ref(lambda: _interleave(gb, ub))
        yield prefix + "gate_up_proj_scales", _ref(lambda: _interleave(gs, us))
        yield prefix + "down_proj_blocks", _ref(lambda: db)
        yield prefix + "down_proj_scales", _ref(lambda: ds)
    else:
        yield prefix + "gate_up_proj", _ref(lambda: _interleave(gate.load(), up.load()).transpose(1, 2))
        yield prefix + "down_proj", _ref(lambda: down.load().transpose(1, 2))
    yield prefix + "gate_up_proj_bias", _ref(lambda: _interleave(parts["gate.bias"].load(), parts["up.bias"].load()))
    yield prefix + "down_proj_bias", _ref(lambda: parts["down.bias"].load())


def gpt_oss_weights(tensors: dict[str, GGUFTensorInfo], names: dict[str, str | None]
                    ) -> Iterator[tuple[str, WeightRef]]:
    """The file's tensors as the checkpoint's: experts by layer (expert_refs), sinks under their
    parameter's name, the rest dequantized under the generic reader's names."""
    experts: dict[str, dict[str, GGUFTensorInfo]] = {}
    for gname, info in tensors.items():
        m = _EXPERTS.match(gname)
        if m is not None:
            experts.setdefault(m[1], {})[f"{m[2]}.{m[3]}"] = info
            continue
        hf = names[gname]
        if hf is None:
            continue
        if hf.endswith("self_attn.sinks.weight"):
            hf = hf.removesuffix(".weight")
        yield hf, WeightRef(info.shape, torch.float32, lambda slices, info=info: apply_slices(info.load(), slices))
    for layer, parts in experts.items():
        yield from expert_refs(layer, parts)
