"""Quantized checkpoint formats, read from the checkpoint's own ``quantization_config``.

Each format names the tensors one quantized linear layer is stored as (``q_proj.qweight``,
``q_proj.scales``, ...) and converts them to the canonical QuantizedTensor. ``group_tensors``
turns a checkpoint's (name, tensor) stream into one where each quantized layer appears once,
as ``<layer>.weight`` with a QuantRef, so models load quantized checkpoints with the same names
and sharding code as 16-bit ones.

Layouts (from the formats' own documentation and reference code):
- fp8 (transformers FineGrainedFP8, DeepSeek-V3 / Qwen3-FP8): ``weight`` float8_e4m3fn [N, K],
  ``weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)] multiplied in (despite its name).
- compressed-tensors: ``float-quantized`` FP8 ``weight`` with ``weight_scale`` per tensor [1] or
  per channel [N, 1]; ``pack-quantized`` int4/int8 ``weight_packed`` int32 [N, K*bits/32], eight
  (or four) values per int32 along K, lowest bits first, stored offset by 2**(bits-1);
  ``weight_scale`` [N, K/G]; ``weight_zero_point`` when asymmetric: signed, packed like the codes
  but along N (int32 [N*bits/32, K/G]);
  ``naive-quantized`` / ``int-quantized`` int8 ``weight`` with ``weight_scale``.
- GPTQ: ``qweight`` int32 [K*bits/32, N] packed along K; ``qzeros`` int32 [K/G, N*bits/32]
  packed along N; ``scales`` fp16 [K/G, N]; ``g_idx`` int32 [K] (act-order). The original
  ("gptq", v1) files store each zero minus one; ``checkpoint_format: gptq_v2`` stores it as is.
- AWQ (GEMM): ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/G, N/8] packed along N in the
  order 0 2 4 6 1 3 5 7; ``scales`` fp16 [K/G, N]; W = (q - zero) * scale.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch

from .nvfp4 import nvfp4, nvfp4_options
from .tensor import QuantizedTensor, code_centre


class QuantRef:
    """A quantized matrix read and converted only when asked for: ``load(slices)`` returns the
    QuantizedTensor restricted to (rows[, cols]) of W [N, K], as WeightRef.load does for floats."""

    dtype = None  # not a plain tensor

    def __init__(self, read: Callable[[], QuantizedTensor], what: str, shape: tuple[int, int] | None = None) -> None:
        self.read, self.what, self.shape = read, what, shape

    def load(self, slices: tuple[slice, ...] | None = None) -> QuantizedTensor:
        qt = self.read()
        if slices and not isinstance(slices, tuple):
            slices = (slices,)
        for dim, sl in enumerate(slices or ()):
            start, stop, _ = sl.indices(qt.shape[dim])
            if (start, stop) != (0, qt.shape[dim]):
                qt = qt.rows(start, stop - start) if dim == 0 else qt.cols(start, stop - start)
        return qt

    def __repr__(self) -> str:
        return f"QuantRef({self.what})"


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits values each, lowest bits first, unpacked along ``dim``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    p = packed.to(torch.int32).unsqueeze(-1)
    if dim == 0:
        vals = (p.transpose(0, 1) >> shifts) & ((1 << bits) - 1)  # [cols, rows, per]
        return vals.reshape(packed.shape[1], packed.shape[0] * per).transpose(0, 1).to(torch.uint8)
    vals = (p >> shifts) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], packed.shape[1] * per).to(torch.uint8)


def _expand_rows(t: torch.Tensor, block: int, n: int) -> torch.Tensor:
    return t.repeat_interleave(block, 0)[:n]


@dataclass
class CheckpointFormat:
    """How one quantization method stores a linear layer. ``suffixes``: the tensors of a layer
    (each after ``<layer>.``); ``required``: those that must be present; ``convert`` makes the
    canonical tensor; ``ignore``: layers left in 16 bits (matched as name fragments)."""

    name: str
    suffixes: tuple[str, ...]
    required: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)

    def convert(self, t: dict[str, torch.Tensor]) -> QuantizedTensor:
        return _CONVERTERS[self.name](t, **self.options)


def _fp8_block(t, block=(128, 128)):
    w = t["weight"]
    n, k = w.shape
    scale = t.get("weight_scale_inv")
    if scale is None:
        scale = t["weight_scale"]
    scale = scale.float()
    if scale.numel() == 1:  # per tensor
        return QuantizedTensor(w.view(torch.float8_e4m3fn), scale.reshape(1, 1).expand(n, 1).contiguous(), None, 8, k)
    if scale.dim() == 2 and scale.shape == (n, 1):  # per channel
        return QuantizedTensor(w.view(torch.float8_e4m3fn), scale.contiguous(), None, 8, k)
    bn, bk = block
    return QuantizedTensor(w.view(torch.float8_e4m3fn), _expand_rows(scale, bn, n).contiguous(), None, 8, bk)


def _ct_packed(t, bits=4, group_size=None, symmetric=True):
    if "weight_g_idx" in t:
        raise UnsupportedQuantization("compressed-tensors checkpoints with activation ordering (weight_g_idx) "
                                      "are not supported")
    shape = t.get("weight_shape")
    codes = _unpack_int32(t["weight_packed"], bits, dim=1)
    n, k = (int(shape[0]), int(shape[1])) if shape is not None else codes.shape
    codes = codes[:n, :k].contiguous()
    scale = t["weight_scale"].float()
    if scale.dim() == 1:
        scale = scale[:, None]
    g = (group_size or -(-k // scale.shape[1])) if scale.shape[1] > 1 else k
    zp = t.get("weight_zero_point")
    if symmetric or zp is None:
        return QuantizedTensor(codes, scale, None, bits, g)
    if zp.dtype == torch.int32:  # packed like the codes, along the output rows, offset by 2**(bits-1)
        zp = _unpack_int32(zp, bits, dim=0)[:n].to(torch.int16) - (1 << (bits - 1))
    # stored codes are q + 2**(bits-1) with q signed; W = (q - zp) * s = codes * s - (2**(bits-1) + zp) * s
    zp = zp.float().reshape(scale.shape)
    return QuantizedTensor(codes, scale, -((1 << (bits - 1)) + zp) * scale, bits, g)


def _ct_int8(t, group_size=None, **_):
    w = t["weight"]
    n, k = w.shape
    scale = t["weight_scale"].float()
    scale = scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, -1)
    codes = (w.to(torch.int16) + 128).to(torch.uint8)
    g = k if scale.shape[1] == 1 else (group_size or k // scale.shape[1])
    return QuantizedTensor(codes, scale.contiguous(), None, 8, g)


def _gptq(t, bits=4, group_size=128, v2=False):
    # (desc_act needs no option: a g_idx out of order says it)
    codes = _unpack_int32(t["qweight"], bits, dim=0)  # [K, N]
    k, n = codes.shape
    scales = t["scales"].float()  # [groups, N]
    zeros = _unpack_int32(t["qzeros"], bits, dim=1)[:, :n].float()  # [groups, N]
    if not v2:
        zeros = (zeros + 1) % (1 << bits)  # v1 files hold zero - 1 (wrapping at 2**bits)
    g = group_size if group_size and group_size > 0 else k
    g_idx = t.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // g):
            g_idx = None  # groups in order: no table needed
    # zeros all at the symmetric codes' centre: the implied offset, none stored
    biases = None if bool((zeros == code_centre(bits)).all()) else (-zeros * scales).t().contiguous()
    return QuantizedTensor(codes.t().contiguous(), scales.t().contiguous(), biases, bits, g, g_idx)


_AWQ_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # position of value i of a word: its inverse order


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    vals = _unpack_int32(packed, 4, dim=1)  # [R, N] in storage order 0 2 4 6 1 3 5 7 per word
    r, n = vals.shape
    return vals.view(r, n // 8, 8)[:, :, _AWQ_ORDER].reshape(r, n)


def _awq(t, group_size=128):
    codes = _awq_unpack(t["qweight"])  # [K, N]
    k, n = codes.shape
    zeros = _awq_unpack(t["qzeros"]).float()
    scales = t["scales"].float()
    g = group_size if group_size and group_size > 0 else k
    return QuantizedTensor(codes.t().contiguous(), scales.t().contiguous(), (-zeros * scales).t().contiguous(), 4, g)


_CONVERTERS = {"fp8": _fp8_block, "compressed-tensors-fp8": _fp8_block, "compressed-tensors-packed": _ct_packed,
               "compressed-tensors-int8": _ct_int8, "gptq": _gptq, "awq": _awq, "nvfp4": nvfp4}


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class UnsupportedQuantization(ValueError):
    pass


def checkpoint_format(cfg: dict | None) -> CheckpointFormat | None:
    """The format a config.json's ``quantization_config`` describes, None for a 16-bit model;
    a clear error for one kvship does not read."""
    if not cfg:
        return None
    method = str(cfg.get("quant_method", "")).lower()
    if method == "fp8":
        if cfg.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedQuantization("fp8 checkpoints with static activation scales are not supported "
                                          "(activation_scheme must be dynamic)")
        block = cfg.get("weight_block_size") or (128, 128)
        return CheckpointFormat("fp8", ("weight", "weight_scale_inv", "weight_scale"), ("weight",),
                                tuple(cfg.get("modules_to_not_convert") or ()), {"block": tuple(block)})
    if method == "gptq":
        bits = int(cfg.get("bits", 4))
        if bits not in (4, 8):
            raise UnsupportedQuantization(f"GPTQ with {bits} bits is not supported (4 and 8 are)")
        v2 = str(cfg.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return CheckpointFormat("gptq", ("qweight", "qzeros", "scales", "g_idx"), ("qweight", "qzeros", "scales"),
                                tuple(cfg.get("modules_to_not_convert") or ()),
                                {"bits": bits, "group_size": int(cfg.get("group_size", 128)), "v2": v2})
    if method == "awq":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm" or int(cfg.get("bits", cfg.get("w_bit", 4))) != 4:
            raise UnsupportedQuantization(f"AWQ {version} with {cfg.get('bits', cfg.get('w_bit'))} bits is not "
                                          "supported (4-bit GEMM packing is)")
        return CheckpointFormat("awq", ("qweight", "qzeros", "scales"), ("qweight", "qzeros", "scales"),
                                tuple(cfg.get("modules_to_not_convert") or ()),
                                {"group_size": int(cfg.get("group_size", cfg.get("q_group_size", 128)))})
    if method == "compressed-tensors":
        return _compressed_tensors(cfg)
    if method == "mxfp4":  # gpt-oss's experts, read by their layer (layers/gpt_oss_moe.py) as stored
        return CheckpointFormat("mxfp4", (), ())
    if method == "modelopt":
        return _modelopt(cfg)
    if method == "gguf":  # the GGUF loader hands over each kept-quantized matrix itself
        return CheckpointFormat("gguf", (), ())
    raise UnsupportedQuantization(f"quantization method {method or 'unknown'!r} is not supported; kvship reads "
                                  "fp8, gptq, awq, compressed-tensors and ModelOpt NVFP4 checkpoints (and GGUF files)")


def _compressed_tensors(cfg: dict) -> CheckpointFormat:
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization("compressed-tensors checkpoints with more than one config group are not supported")
    w = groups[0].get("weights") or {}
    fmt = str(groups[0].get("format") or cfg.get("format", "")).lower()
    ignore = tuple(cfg.get("ignore") or ())
    bits, kind, strategy = int(w.get("num_bits", 8)), str(w.get("type", "int")), str(w.get("strategy", "tensor"))
    acts = groups[0].get("input_activations")
    if fmt == "nvfp4-pack-quantized":
        try:
            nvfp4_options(w, acts, "compressed-tensors nvfp4")
        except ValueError as e:
            raise UnsupportedQuantization(str(e)) from None
        return CheckpointFormat("nvfp4", ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
                                ("weight_packed", "weight_scale", "weight_global_scale"), ignore)
    if acts and not acts.get("dynamic", False):
        raise UnsupportedQuantization("compressed-tensors checkpoints with static activation scales are not supported")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized", ""):
        if strategy == "block":
            block = tuple(w.get("block_structure") or (128, 128))
            return CheckpointFormat("compressed-tensors-fp8", ("weight", "weight_scale"), ("weight", "weight_scale"),
                                    ignore, {"block": block})
        return CheckpointFormat("compressed-tensors-fp8", ("weight", "weight_scale"), ("weight", "weight_scale"), ignore)
    if kind == "int" and fmt == "pack-quantized" and bits in (4, 8):
        return CheckpointFormat("compressed-tensors-packed",
                                ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
                                ("weight_packed", "weight_scale"), ignore,
                                {"bits": bits, "group_size": w.get("group_size"),
                                 "symmetric": bool(w.get("symmetric", True))})
    if kind == "int" and bits == 8 and fmt in ("naive-quantized", "int-quantized"):
        return CheckpointFormat("compressed-tensors-int8", ("weight", "weight_scale", "weight_zero_point"),
                                ("weight", "weight_scale"), ignore, {"group_size": w.get("group_size")})
    raise UnsupportedQuantization(f"compressed-tensors {fmt or '?'} with {bits}-bit {kind} weights "
                                  f"({strategy}) is not supported")


def _modelopt(cfg: dict) -> CheckpointFormat:
    algo = str(cfg.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise UnsupportedQuantization(f"ModelOpt {algo or '?'} checkpoints are not supported (NVFP4 is)")
    if cfg.get("kv_cache_quant_algo"):
        raise UnsupportedQuantization("ModelOpt checkpoints with a quantized KV cache (kv_cache_quant_algo) are not "
                                      "supported; use --kv-cache-dtype instead")
    try:
        nvfp4_options({"group_size": cfg.get("group_size", 16)}, {"nvfp4": True}, "ModelOpt NVFP4")
    except ValueError as e:
        raise UnsupportedQuantization(str(e)) from None
    return CheckpointFormat("nvfp4", ("weight", "weight_scale", "weight_scale_2", "input_scale"),
                            ("weight", "weight_scale", "weight_scale_2"),
                            tuple(cfg.get("exclude_modules") or cfg.get("ignore") or ()), {"layout": "modelopt"})


def group_tensors(weights: Iterable[tuple[str, object]], fmt: CheckpointFormat) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with each quantized layer's parts gathered into one
    ``<layer>.weight`` QuantRef; everything else (norms, embeddings, ignored layers) as it is."""
    layers: dict[str, dict[str, object]] = {}
    order: list[str] = []
    for name, ref in weights:
        prefix, _, suffix = name.rpartition(".")
        if suffix in fmt.suffixes and not any(f in prefix or fnmatch(prefix, f) for f in fmt.ignore):
            if prefix not in layers:
                layers[prefix] = {}
                order.append(prefix)
            layers[prefix][suffix] = ref
        else:
            yield name, ref
    for prefix in order:
        parts = layers[prefix]
        if set(parts) == {"weight"} and parts["weight"].dtype in _FLOAT_DTYPES:
            yield f"{prefix}.weight", parts["weight"]  # a layer the quantizer left in 16 bits
            continue
        missing = [s for s in fmt.required if s not in parts]
        if missing:
            raise UnsupportedQuantization(f"{fmt.name} checkpoint: layer {prefix!r} lacks {', '.join(missing)}")
        yield f"{prefix}.weight", QuantRef(lambda parts=parts: fmt.convert({k: r.load() for k, r in parts.items()}),
                                           f"{fmt.name}: {', '.join(sorted(parts))}")
