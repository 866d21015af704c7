"""y = x @ W^T for quantized W, dequantized in registers: nothing 16-bit is ever written.

The device layout of kvship.quant.QuantizedTensor (``pack``): codes [N, K] as uint8 (8-bit
integers), float8_e4m3fn (FP8) or, for 4 bits, two codes per byte along K (byte j of a row:
k = 2j in the low nibble, 2j + 1 in the high one) -> [N, ceil(K/2)]; scales and biases
[N, groups] in float16 for integer codes (the precision GPTQ/AWQ/GGUF scales have) and float32
for FP8 (block scales are float32 in the checkpoints); g_idx [K] int32 for act-order GPTQ.

``quant_linear_torch`` (unpack, dequantize, F.linear) is the reference and the CPU path.
``quant_linear_triton`` runs one of two kernels: one input row (batch-1 decode) streams the
codes once with plain FMAs and one reduction at the end (as kernels/gemv.py does for bf16;
codes beside 16-bit x in kernels/quant_gemv.py's fp16-pair form, see _one_row_config); more rows
go through a tiled tensor-core GEMM. Both take the scales of a whole tile of groups
at once (a [.., groups, group] view of the tile), except for act-order weights, whose groups are
scattered over K and are looked up per input. FP8 weights from two rows take the FP8 tensor
cores (``_dense_matmul``, W8A8): activations quantized per token for per-row weights
(torch._scaled_mm), per token and group for block-wise ones (kernels/fp8_matmul.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvship.kernels._triton import pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.activation import act_and_mul
from kvship.kernels.fp8_matmul import (
    fp8_group_matmul_triton,
    group_matmul_fits,
    quantize_fp8_groups,
    quantize_fp8_rows,
)
from kvship.kernels.numerics import exact_dot as _dot
from kvship.kernels.numerics import small_int_to_float
from kvship.kernels.nvfp4_linear import dequantize_nvfp4_torch, nvfp4_linear
from kvship.kernels.quant_gemv import (
    GATED_ACTS,
    fits,
    pairs_fit,
    qgemv_pairs_triton,
    qgemv_words_triton,
    tiles_keep_groups,
)
from kvship.kernels.quant_gemv_mma import MAX_TOKENS, mma_fit, qgemv_mma_triton
from kvship.kernels.tuning.quant_linear import (
    DENSE_ROWS,
    GEMM_CONFIGS,
    GEMV_CONFIGS,
    MMA_GEMV_CONFIG,
    MMA_GEMV_SHAPES,
    PAIRS_GEMV_CONFIGS,
    PAIRS_GEMV_SHAPES,
    W8A8_ROWS,
    WORD_GEMV_CONFIGS,
)
from kvship.quant.tensor import QuantizedTensor, code_centre


@dataclass
class QWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int
    k: int  # input features (the packed width may round up)
    e2m1: bool = False  # NVFP4 codes, multiplied by kernels/nvfp4_linear.py

    @property
    def fp8(self) -> bool:
        return self.qweight.dtype == torch.float8_e4m3fn

    @property
    def n(self) -> int:
        return self.qweight.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.biases, self.g_idx)
                   if t is not None)


def pack(qt: QuantizedTensor, device: torch.device | str) -> QWeight:
    codes = qt.codes.to(device)
    if qt.bits == 4:
        if codes.shape[1] % 2:
            codes = F.pad(codes, (0, 1))
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sdtype = torch.float32 if qt.is_fp8 or qt.e2m1 else torch.float16  # NVFP4's: FP8 times a float32 factor
    return QWeight(codes.contiguous(), qt.scales.to(device, sdtype).contiguous(),
                   None if qt.biases is None else qt.biases.to(device, sdtype).contiguous(),
                   None if qt.g_idx is None else qt.g_idx.to(device, torch.int32).contiguous(),
                   qt.bits, qt.group_size, qt.codes.shape[1], qt.e2m1)


def dequantize_torch(w: QWeight) -> torch.Tensor:
    """[N, K] float32."""
    q = w.qweight
    if w.e2m1:
        return dequantize_nvfp4_torch(q, w.scales, w.k)
    if w.bits == 4:
        codes = torch.stack((q & 15, q >> 4), -1).view(q.shape[0], -1)[:, :w.k].float()
    else:
        codes = q.float()
    centre = code_centre(w.bits, w.fp8, w.biases is not None)
    if centre:
        codes -= centre
    gi = w.g_idx.long() if w.g_idx is not None else torch.arange(w.k, device=q.device) // w.group_size
    out = codes * w.scales.float()[:, gi]
    if w.biases is not None:
        out += w.biases.float()[:, gi]
    return out


def quant_linear_torch(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_torch(w).to(x.dtype), bias)


@triton.jit
def _dequant(c, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, group0, g_idx_ptr, k_idx, kmask,
             FP8: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr, GATHER: tl.constexpr,
             GE: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr):
    """Codes c [ROWS outputs, TILE inputs] -> fp32 weights. GATHER: each input's group comes from
    the g_idx table (act-order, or groups that do not tile evenly). Otherwise the tile holds
    TILE // GE whole groups of GE of its elements starting at group0 (or lies inside group0 when
    GE >= TILE), and each group's scale is loaded once and broadcast over a [ROWS, groups, GE] view."""
    if FP8:  # the codes arrive as their bytes (masked lanes read as 0, which is +0.0 in E4M3)
        c = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        c = small_int_to_float(c)
    if SYMM:
        c = c - CENTRE
    if GATHER:
        g = tl.load(g_idx_ptr + k_idx, mask=kmask, other=0)
        ptrs = offs_n[:, None].to(tl.int64) * stride_s + g[None, :]
        m = nmask[:, None] & kmask[None, :]
        w = c * tl.load(s_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        if not SYMM:
            w += tl.load(b_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        return w
    elif GE >= TILE:
        ptrs = offs_n.to(tl.int64) * stride_s + group0
        m = nmask & (group0 < ngroups)
        w = c * tl.load(s_ptr + ptrs, mask=m, other=0.0).to(tl.float32)[:, None]
        if not SYMM:
            w += tl.load(b_ptr + ptrs, mask=m, other=0.0).to(tl.float32)[:, None]
        return w
    else:
        NG: tl.constexpr = TILE // GE
        gs = group0 + tl.arange(0, NG)
        ptrs = offs_n[:, None].to(tl.int64) * stride_s + gs[None, :]
        m = nmask[:, None] & (gs < ngroups)[None, :]
        w = tl.reshape(c, [ROWS, NG, GE]) * tl.load(s_ptr + ptrs, mask=m, other=0.0).to(tl.float32)[:, :, None]
        if not SYMM:
            w += tl.load(b_ptr + ptrs, mask=m, other=0.0).to(tl.float32)[:, :, None]
        return tl.reshape(w, [ROWS, TILE])


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, gi_ptr, bias_ptr, y_ptr, N, K, KP, stride_w, stride_s, ngroups,
                  BITS4: tl.constexpr, FP8: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr, GATHER: tl.constexpr,
                  HAS_BIAS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One input row. BLOCK_K counts stored columns (bytes of two codes each for 4 bits)."""
    pdl_wait(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for kp0 in range(0, KP, BLOCK_K):
        offs = kp0 + tl.arange(0, BLOCK_K)
        q = tl.load(rows + offs[None, :], mask=nmask[:, None] & (offs < KP)[None, :], other=0,
                    eviction_policy="evict_first")
        if BITS4:  # low nibble: input 2j, high nibble: input 2j + 1
            k_lo = 2 * offs
            m_lo, m_hi = k_lo < K, k_lo + 1 < K
            x_lo = tl.load(x_ptr + k_lo, mask=m_lo, other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + k_lo + 1, mask=m_hi, other=0.0).to(tl.float32)
            w_lo = _dequant(q & 15, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, 2 * kp0 // G, gi_ptr, k_lo,
                            m_lo, False, SYMM, CENTRE, GATHER, G // 2, BLOCK_K, BLOCK_N)
            w_hi = _dequant(q >> 4, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, 2 * kp0 // G, gi_ptr,
                            k_lo + 1, m_hi, False, SYMM, CENTRE, GATHER, G // 2, BLOCK_K, BLOCK_N)
            acc += w_lo * x_lo[None, :] + w_hi * x_hi[None, :]
        else:
            kmask = offs < K
            x = tl.load(x_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
            w = _dequant(q, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, kp0 // G, gi_ptr, offs, kmask,
                         FP8, SYMM, CENTRE, GATHER, G, BLOCK_K, BLOCK_N)
            acc += w * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, gi_ptr, bias_ptr, y_ptr, M, N, K, KP, stride_x, stride_y, stride_w,
                  stride_s, ngroups,
                  BITS4: tl.constexpr, FP8: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr, GATHER: tl.constexpr,
                  HAS_BIAS: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Rows of x in [BLOCK_M, BLOCK_N] output tiles; each weight tile is dequantized in registers
    to x's dtype and fed to the tensor cores."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = offs_m < M, offs_n < N
    xrows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    wrows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dt = x_ptr.dtype.element_ty
    for kp0 in range(0, KP, BLOCK_K):
        offs = kp0 + tl.arange(0, BLOCK_K)
        q = tl.load(wrows + offs[None, :], mask=nmask[:, None] & (offs < KP)[None, :], other=0)
        if BITS4:  # the two nibbles' weights interleaved back into input order: one dot over 2 * BLOCK_K inputs
            k_lo = 2 * offs
            m_lo, m_hi = k_lo < K, k_lo + 1 < K
            w_lo = _dequant(q & 15, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, 2 * kp0 // G, gi_ptr, k_lo,
                            m_lo, False, SYMM, CENTRE, GATHER, G // 2, BLOCK_K, BLOCK_N)
            w_hi = _dequant(q >> 4, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, 2 * kp0 // G, gi_ptr,
                            k_lo + 1, m_hi, False, SYMM, CENTRE, GATHER, G // 2, BLOCK_K, BLOCK_N)
            w = tl.reshape(tl.join(w_lo.to(dt), w_hi.to(dt)), [BLOCK_N, 2 * BLOCK_K])
            kk = 2 * kp0 + tl.arange(0, 2 * BLOCK_K)
            a = tl.load(xrows + kk[None, :], mask=mmask[:, None] & (kk < K)[None, :], other=0.0)
            acc = _dot(a, tl.trans(w), acc)
        else:
            kmask = offs < K
            a = tl.load(xrows + offs[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = _dequant(q, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, kp0 // G, gi_ptr, offs, kmask,
                         FP8, SYMM, CENTRE, GATHER, G, BLOCK_K, BLOCK_N)
            acc = _dot(a, tl.trans(w.to(dt)), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def shape_key(w: QWeight) -> tuple:
    """A quantized matrix's key in the per-shape settings tables: (format, group, N, K)."""
    return ("fp8" if w.fp8 else w.bits, w.group_size if w.scales.shape[1] > 1 else 0, w.n, w.k)


def dense_rows(x2: torch.Tensor, w: QWeight) -> int:
    """The number of rows from which ``quant_linear_triton`` multiplies on the tensor cores."""
    return W8A8_ROWS if _w8a8(x2, w) else DENSE_ROWS


def _gemm_config(m: int) -> dict[str, int]:
    return GEMM_CONFIGS[16 if m <= 16 else 64 if m <= 64 else None]


def _within_groups(w: QWeight, cfg: dict[str, int]) -> dict[str, int]:
    """``cfg`` with tiles no wider than a group (same bytes per tile: more rows, fewer columns),
    so that each tile takes one scale per row: much faster for the 16-bit expansion, much slower
    for the one-row GEMV (narrow rows), which keeps tiles of several groups."""
    per_group = w.group_size // (2 if w.bits == 4 else 1)  # stored columns per group
    if w.g_idx is not None or w.scales.shape[1] == 1 or per_group >= cfg["block_k"] or per_group < 16 \
            or per_group & (per_group - 1):
        return cfg
    return {**cfg, "block_k": per_group, "block_n": min(128, cfg["block_n"] * cfg["block_k"] // per_group)}


def _gather_table(w: QWeight, tile: int) -> torch.Tensor | None:
    """The per-input group table the kernels look groups up in, or None when tiles of ``tile``
    inputs hold whole groups (or lie inside one)."""
    if w.g_idx is not None:
        return w.g_idx
    if tiles_keep_groups(tile, w.group_size, w.scales.shape[1]):
        return None
    table = getattr(w, "_table", None)
    if table is None:
        table = (torch.arange(w.k, device=w.qweight.device, dtype=torch.int32) // w.group_size)
        w._table = table
    return table


def _layout(w: QWeight, block_k: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    """What every kernel takes of the layout for tiles of ``block_k`` stored columns: the codes'
    bytes, scales, offsets and group table (unused ones stand in as the scales: a pointer the
    kernel never reads), and the compile-time flags."""
    table = _gather_table(w, block_k * (2 if w.bits == 4 else 1))
    symm = w.biases is None and not w.fp8
    ptrs = (w.qweight.view(torch.uint8), w.scales, w.biases if w.biases is not None else w.scales,
            table if table is not None else w.scales)
    return ptrs, dict(BITS4=w.bits == 4, FP8=w.fp8, SYMM=symm,
                      CENTRE=float(code_centre(w.bits, w.fp8, w.biases is not None)),
                      GATHER=table is not None,
                      # one group per row: a group wider than any tile (and a power of two, as tile shapes must be)
                      G=w.group_size if w.scales.shape[1] > 1 else 1 << 30)


def _one_row_config(w: QWeight, dtype: torch.dtype) -> dict[str, int]:
    """The pairs kernel's settings (PAIRS_GEMV_SHAPES for the weight's shape, else
    PAIRS_GEMV_CONFIGS) where it takes the layout and x is 16-bit (its sums are fp16: float32
    serving keeps float32 arithmetic), else the word kernel's (with block_w) for integer codes,
    else the per-code one's."""
    if dtype != torch.float32 and pairs_fit(w.bits, w.k, w.group_size, w.scales.shape[1], w.g_idx is not None):
        key = shape_key(w)
        return PAIRS_GEMV_SHAPES.get(key, PAIRS_GEMV_CONFIGS[key[0]])
    words = WORD_GEMV_CONFIGS[w.bits]
    if not w.fp8 and fits(w.bits, w.k, w.group_size, w.scales.shape[1], w.g_idx is not None, words["block_w"]):
        return words
    return GEMV_CONFIGS[w.bits]


def quant_linear_triton(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None,
                        config: dict[str, int] | None = None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, kp = x2.shape[0], w.n, w.qweight.shape[1]
    if config is None and m >= dense_rows(x2, w):
        return _dense_matmul(x2, w, bias).view(*shape[:-1], n)
    if config is None and 1 < m <= MAX_TOKENS \
            and mma_fit(w.bits, w.k, w.group_size, w.scales.shape[1], w.g_idx is not None, x.dtype):
        config = MMA_GEMV_SHAPES.get(shape_key(w), MMA_GEMV_CONFIG)
    if config is not None and "mma" in config:
        return qgemv_mma_triton(x2, w.qweight, w.scales, w.biases, bias, w.group_size, w.k,
                                config).view(*shape[:-1], n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bias_ptr = bias if bias is not None else w.scales
    if m == 1:
        cfg = config or _one_row_config(w, x.dtype)
        if "pairs" in cfg:
            return qgemv_pairs_triton(x2, w.qweight, w.scales, w.biases, bias, w.bits, w.group_size, w.k,
                                      cfg).view(*shape[:-1], n)
        if "block_w" in cfg:
            return qgemv_words_triton(x2, w.qweight, w.scales, w.biases, bias, w.bits, w.group_size, w.k,
                                      cfg).view(*shape[:-1], n)
        ptrs, flags = _layout(w, cfg["block_k"])
        _qgemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
            x2, *ptrs, bias_ptr, y, n, w.k, kp, w.qweight.stride(0), w.scales.stride(0), w.scales.shape[1],
            HAS_BIAS=bias is not None, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags, **pdl_launch(x2))
    elif m > 0:
        cfg = config or _gemm_config(m)
        ptrs, flags = _layout(w, cfg["block_k"])
        grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]))
        _qgemm_kernel[grid](
            x2, *ptrs, bias_ptr, y, m, n, w.k, kp, x2.stride(0), y.stride(0), w.qweight.stride(0),
            w.scales.stride(0), w.scales.shape[1], HAS_BIAS=bias is not None,
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)
    return y.view(*shape[:-1], n)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, gi_ptr, out_ptr, N, K, KP, stride_w, stride_s, ngroups,
                    BITS4: tl.constexpr, FP8: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr,
                    GATHER: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [N, K] in the output's dtype, one [BLOCK_N, BLOCK_K stored columns] tile per program."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    q = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs[None, :],
                mask=nmask[:, None] & (offs < KP)[None, :], other=0)
    rows = out_ptr + offs_n[:, None].to(tl.int64) * K
    kp0 = tl.program_id(1) * BLOCK_K
    if BITS4:
        k_lo = 2 * offs
        m_lo, m_hi = k_lo < K, k_lo + 1 < K
        lo = _dequant(q & 15, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, 2 * kp0 // G, gi_ptr, k_lo, m_lo,
                      False, SYMM, CENTRE, GATHER, G // 2, BLOCK_K, BLOCK_N)
        hi = _dequant(q >> 4, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, 2 * kp0 // G, gi_ptr, k_lo + 1, m_hi,
                      False, SYMM, CENTRE, GATHER, G // 2, BLOCK_K, BLOCK_N)
        dt = out_ptr.dtype.element_ty  # the two nibbles' weights back in input order: contiguous stores
        w = tl.reshape(tl.join(lo.to(dt), hi.to(dt)), [BLOCK_N, 2 * BLOCK_K])
        kk = 2 * kp0 + tl.arange(0, 2 * BLOCK_K)
        tl.store(rows + kk[None, :], w, mask=nmask[:, None] & (kk < K)[None, :])
    else:
        kmask = offs < K
        w = _dequant(q, s_ptr, b_ptr, offs_n, nmask, stride_s, ngroups, kp0 // G, gi_ptr, offs, kmask,
                     FP8, SYMM, CENTRE, GATHER, G, BLOCK_K, BLOCK_N)
        tl.store(rows + offs[None, :], w.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def dequantize_triton(w: QWeight, dtype: torch.dtype) -> torch.Tensor:
    """Triton twin of ``dequantize_torch``, in ``dtype``."""
    out = torch.empty(w.n, w.k, dtype=dtype, device=w.qweight.device)
    cfg = _within_groups(w, {"block_n": 32, "block_k": 128})
    bn, bk = cfg["block_n"], cfg["block_k"]
    ptrs, flags = _layout(w, bk)
    grid = (triton.cdiv(w.n, bn), triton.cdiv(w.qweight.shape[1], bk))
    _dequant_kernel[grid](*ptrs, out, w.n, w.k, w.qweight.shape[1], w.qweight.stride(0), w.scales.stride(0),
                          w.scales.shape[1], BLOCK_N=bn, BLOCK_K=bk, num_warps=4, **flags)
    return out


def _w8a8(x2: torch.Tensor, w: QWeight) -> bool:
    """FP8 weights beside 16-bit activations on a GPU with FP8 tensor cores (compute capability
    8.9+), with one scale per row (torch._scaled_mm, per-token activation scales) or per row
    and group of inputs that fp8_matmul's group GEMM takes (block-wise checkpoints)."""
    if not (x2.is_cuda and w.fp8 and x2.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x2.device) >= (8, 9)):
        return False
    if w.scales.shape[1] == 1:
        return w.n % 16 == 0 and w.k % 16 == 0
    return group_matmul_fits(w.group_size, w.k) and w.k % 16 == 0


def _dense_matmul(x2: torch.Tensor, w: QWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows: tensor cores at full rate. FP8 weights multiply FP8 activations quantized
    dynamically (W8A8, as vLLM's) at every row count: per token beside per-row weights
    (torch._scaled_mm), per token and group beside block-wise ones (fp8_matmul's group GEMM).
    A 16-bit copy of an FP8 matrix would read three times its bytes and run at half the FP8
    rate. Other formats are expanded into a transient 16-bit matrix for cuBLAS (compute-bound
    at these sizes: the expansion costs less than the dequantizing GEMM lost)."""
    if _w8a8(x2, w):
        if w.scales.shape[1] == 1:
            xq, scale_a = quantize_fp8_rows(x2)
            return torch._scaled_mm(xq, w.qweight.t(), scale_a=scale_a, scale_b=w.scales.view(1, -1),
                                    bias=bias, out_dtype=x2.dtype)
        xq, scale_a = quantize_fp8_groups(x2, w.group_size)  # block-wise: activations per token and group
        return fp8_group_matmul_triton(xq, scale_a, w.qweight, w.scales, w.group_size, bias, x2.dtype)
    return F.linear(x2, dequantize_triton(w, x2.dtype), bias)


def quant_linear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.e2m1:
        return nvfp4_linear(x, w.qweight, w.scales, w.k, bias)
    if use_triton(x):
        return quant_linear_triton(x, w, bias)
    return quant_linear_torch(x, w, bias)


def quant_linear_gated(x: torch.Tensor, w: QWeight, act: str) -> torch.Tensor:
    """act(gate) * up [.., N / 2] of x @ W^T for a gate/up projection W (its gate rows first): for
    one 16-bit row in the epilogue of the pairs GEMV (kernels/quant_gemv.py, GATED), which then
    writes the activations alone; otherwise the product, then act_and_mul."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x) and x2.shape[0] == 1 and act in GATED_ACTS and w.n % 2 == 0 and not w.e2m1:
        cfg = _one_row_config(w, x.dtype)
        if "pairs" in cfg and cfg["block_n"] % 2 == 0:
            return qgemv_pairs_triton(x2.contiguous(), w.qweight, w.scales, w.biases, None, w.bits, w.group_size,
                                      w.k, cfg, act).view(*x.shape[:-1], w.n // 2)
    return act_and_mul(quant_linear(x, w), act)
