"""W8A8 on the FP8 tensor cores: activations quantized to FP8 per token (or per token and group)
as they are multiplied, and the GEMM for block-wise FP8 weights.

Per-row weights meet per-token activations in ``torch._scaled_mm`` (kernels/quant_linear.py).
Block weights (128 x 128, held as a scale per row and group of 128 inputs) need their scale
inside the K loop: each BLOCK_K = group step takes one FP8 dot and adds it times the (token,
group) and (row, group) scales, as DeepSeek-V3's own GEMM does. ``quantize_fp8_groups_torch``
and ``fp8_group_matmul_torch`` are the references (the kernels match the first bit for bit)."""
from __future__ import annotations

import torch

from kvship.kernels._triton import pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.numerics import fp8_round
from kvship.kernels.tuning.fp8_matmul import GROUP_GEMM_CONFIGS, GROUP_GEMM_SHAPES
from kvship.quant.insitu import FP8_MAX
from kvship.quant.tensor import QuantizedTensor


def quantize_fp8_groups_torch(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations: x2 [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K / group)]
    float32) with x2 ~= codes * scale of the (row, group); a scale is the group's amax / 448 (at
    least 1e-12, so that zeros divide to zeros), and x2 / scale is rounded to nearest, ties to
    even. ``group`` >= K: one scale per token."""
    m, k = x2.shape
    group = min(group, k) if k else 1
    ng = -(-k // group)
    x = torch.nn.functional.pad(x2.float(), (0, ng * group - k)).view(m, ng, group)
    scale = (x.abs().amax(2) / FP8_MAX).clamp_min(1e-12)
    codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, ng * group)[:, :k].contiguous(), scale


def quantize_fp8_rows_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 activations (scales [M, 1]): ``quantize_fp8_groups_torch`` with one group."""
    return quantize_fp8_groups_torch(x2, x2.shape[1])


@triton.jit
def _fp8_scale(amax):
    """A group's scale from its largest magnitude, ``quantize_fp8_groups_torch``'s rule: amax /
    448 (FP8_MAX) rounded to nearest, at least 1e-12."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)


@triton.jit
def _fp8_codes(x, scale):
    """x (fp32) / scale (fp32, broadcast) as FP8 E4M3 codes, ``quantize_fp8_groups_torch``'s
    arithmetic bit for bit: the division rounds to nearest (``/`` is an approximate division on
    NVIDIA GPUs), and fp8_round rounds in fp32 before the then exact cast."""
    v = tl.math.div_rn(x, scale)
    r = fp8_round(v, False)
    # fp8_round's + 1.5 * 2**23 turns a negative value that rounds to zero into +0; the torch
    # cast keeps its sign (-0, byte 0x80)
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """One row per program, one scale a row. ONE_PASS: the row fits one block and is read once;
    longer rows are read twice (amax, then codes), the second time from the cache."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        acc = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        amax = tl.max(acc, 0)
    scale = _fp8_scale(amax)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        if not ONE_PASS:
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + offs, _fp8_codes(x, scale), mask=k0 + offs < K)


@triton.jit
def _fp8_groups_kernel(x_ptr, q_ptr, s_ptr, K, NG, stride_x, G: tl.constexpr, GROUPS: tl.constexpr,
                       PDL: tl.constexpr):
    """GROUPS groups of G inputs of one row per program (grid: rows, group blocks), read once."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = gs[:, None] * G + tl.arange(0, G)[None, :]
    m = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(x), 1))
    tl.store(s_ptr + row * NG + gs, scale, mask=gs < NG)
    tl.store(q_ptr + row * K + offs, _fp8_codes(x, scale[:, None]), mask=m)


# Widest row the per-token kernel reads once; wider ones are read in blocks of this many
# elements, twice.
FP8_ROWS_BLOCK = 8192
GROUPS_BLOCK = 4096  # inputs a group-quantization program takes


def quantize_fp8_rows_triton(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``quantize_fp8_rows_torch``: one launch instead of four elementwise ones."""
    m, k = x2.shape
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    block = min(triton.next_power_of_2(k), FP8_ROWS_BLOCK)
    if m > 0:
        _fp8_rows_kernel[(m,)](x2, codes, scales, k, x2.stride(0), BLOCK_K=block, ONE_PASS=k <= block,
                               num_warps=8 if block >= 2048 else 4)
    return codes, scales


def quantize_fp8_groups_triton(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``quantize_fp8_groups_torch`` for groups of a power of two inputs."""
    m, k = x2.shape
    assert group & (group - 1) == 0, "groups of a power of two inputs"
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    ng = triton.cdiv(k, group)
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty(m, ng, dtype=torch.float32, device=x2.device)
    per = max(1, min(GROUPS_BLOCK // group, triton.next_power_of_2(ng)))
    if m > 0:
        _fp8_groups_kernel[(m, triton.cdiv(ng, per))](x2, codes, scales, k, ng, x2.stride(0), G=group, GROUPS=per,
                                                      num_warps=4, **pdl_launch(x2))
    return codes, scales


def quantize_fp8_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x2):
        return quantize_fp8_rows_triton(x2)
    return quantize_fp8_rows_torch(x2)


def quantize_fp8_groups(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x2):
        return quantize_fp8_groups_triton(x2, group)
    return quantize_fp8_groups_torch(x2, group)


def fp8_group_matmul_torch(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                           group: int, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = (xq * x_scales) @ (wq * w_scales)^T (+ bias) in float32, then out_dtype: codes
    [M, K] and [N, K], scales per row and group of ``group`` inputs."""
    x = QuantizedTensor(xq, x_scales, None, 8, group).dequantize()
    w = QuantizedTensor(wq, w_scales, None, 8, group).dequantize()
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The rows and columns of C a GEMM's program ``pid`` computes: programs walk the tiles GROUP_M
    row blocks at a time down each column block, so that neighbouring programs share weight tiles in L2."""
    grid_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_here
    pid_n = (pid % width) // rows_here
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _fp8_group_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                           stride_as, stride_bs, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """C [M, N] = sum over groups g of (A_g @ B_g^T) * as[:, g] * bs[:, g], with BLOCK_K the group:
    each step's FP8 dot sums in float32 on its own, then takes both scales (tiles: grouped_tile)."""
    offs_m, offs_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_a
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * stride_b
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pdl_wait(PDL)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k = g * BLOCK_K + offs_k
        kmask = k < K
        a = tl.load(a_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        sa = tl.load(as_ptr + offs_m * stride_as + g, mask=mmask, other=0.0)
        sb = tl.load(bs_ptr + offs_n * stride_bs + g, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_c + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def group_gemm_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile settings for m rows of an n x k matrix (the group is BLOCK_K)."""
    table = GROUP_GEMM_SHAPES.get((n, k), GROUP_GEMM_CONFIGS)
    return table[16 if m <= 16 else 64 if m <= 64 else 256]


def group_matmul_fits(group: int, k: int) -> bool:
    """Groups the kernel takes as its BLOCK_K: a power of two from 32 (an FP8 dot's least K) to 256."""
    return 32 <= group <= 256 and group & (group - 1) == 0 and k > 0


def fp8_group_matmul_triton(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                            group: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
                            config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton twin of ``fp8_group_matmul_torch`` (``group_matmul_fits`` must hold)."""
    cfg = config or group_gemm_config(xq.shape[0], wq.shape[0], xq.shape[1])
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    _fp8_group_gemm_kernel[grid](
        xq, x_scales, wq, w_scales, bias if bias is not None else w_scales, y, m, n, k,
        xq.stride(0), wq.stride(0), y.stride(0), x_scales.stride(0), w_scales.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=group,
        GROUP_M=cfg.get("group_m", 8), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch(xq))
    return y
