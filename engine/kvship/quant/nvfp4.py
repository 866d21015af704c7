"""NVFP4 checkpoints: e2m1 weights (4-bit floats, two a byte, the even input in the low nibble),
an FP8 (e4m3) scale per 16 inputs of a row, and one float32 global scale per matrix, in the two
layouts that ship them:

- compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed`` uint8 [N, K/2],
  ``weight_scale`` e4m3 [N, K/16], ``weight_global_scale`` [1], which divides:
  W = E2M1[code] * weight_scale / weight_global_scale.
- ModelOpt (``quant_method: modelopt``, ``quant_algo: NVFP4``): ``weight`` uint8 [N, K/2],
  ``weight_scale`` e4m3 [N, K/16], ``weight_scale_2`` [1], which multiplies:
  W = E2M1[code] * weight_scale * weight_scale_2.

Either becomes a QuantizedTensor of e2m1 codes (one a byte) with float32 scales per 16 (the
FP8 scale times the global factor). Activations are not quantized: a checkpoint made for
NVFP4 activations as well (W4A4; its input_global_scale / input_scale is read past) runs with
16-bit activations (W4A16), as Hopper has no FP4 tensor cores; a log line says so."""
from __future__ import annotations

import logging

import torch

from .tensor import QuantizedTensor

log = logging.getLogger(__name__)

NVFP4_GROUP = 16


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes [N, K] (low nibble first)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def nvfp4(t: dict[str, torch.Tensor], layout: str = "compressed-tensors") -> QuantizedTensor:
    packed = t["weight_packed"] if layout == "compressed-tensors" else t["weight"]
    codes = unpack_nibbles(packed.view(torch.uint8))
    scale = t["weight_scale"].view(torch.float8_e4m3fn).float() if t["weight_scale"].dtype == torch.uint8 \
        else t["weight_scale"].float()
    if layout == "compressed-tensors":
        scale = scale / t["weight_global_scale"].float().reshape(())
    else:
        scale = scale * t["weight_scale_2"].float().reshape(())
    n, k = codes.shape
    if scale.shape != (n, k // NVFP4_GROUP):
        raise ValueError(f"NVFP4 scales of shape {tuple(scale.shape)} for a [{n}, {k}] matrix: one per "
                         f"{NVFP4_GROUP} inputs expected")
    return QuantizedTensor(codes.contiguous(), scale.contiguous(), None, 4, NVFP4_GROUP, e2m1=True)


def nvfp4_options(weights: dict, activations: dict | None, where: str) -> None:
    """Refuses what the layout does not hold; says so when activations would have been FP4."""
    group = weights.get("group_size", NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise ValueError(f"{where}: NVFP4 with groups of {group} inputs is not supported ({NVFP4_GROUP} are)")
    if weights.get("symmetric", True) is False:
        raise ValueError(f"{where}: asymmetric NVFP4 weights (a zero point) are not supported")
    if activations:
        log.warning("%s: the checkpoint also quantizes activations to FP4; kvship runs its NVFP4 weights with "
                    "16-bit activations (W4A16)", where)
