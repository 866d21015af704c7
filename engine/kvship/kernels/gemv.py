"""Matrix-vector product for one-token decode: y [1, N] = x [1, K] @ W[N, K]^T (+ bias).

Each program streams BLOCK_N whole weight rows once and reduces its fp32 partial sums at the
end: no split-K, no second kernel, no atomics. Used only inside captured CUDA graphs and only
on the shapes in tuning/gemv.py where it beat cuBLAS; elsewhere cuBLAS runs. With ``act`` the
input is the gate/up output [1, 2K] and the kernel applies act(gate) * up on the fly, so the
MLP's down projection needs no activation kernel.

``head_matmul``: the per-head form (DeepSeek's absorbed attention, one matrix per head, either
orientation), one launch for one token in a graph instead of batched cuBLAS and copies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvship.kernels._triton import pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.activation import act_and_mul, act_and_mul_torch, gelu_tanh_mul, silu_mul
from kvship.kernels.tuning.gemv import DEFAULT_CONFIG, FLOAT_GEMV_CONFIG, GEMV_SHAPES, HEAD_GEMV_CONFIG


def gemv_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
) -> torch.Tensor:
    return F.linear(act_and_mul_torch(x, act) if act else x, weight, bias)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, a_ptr, slots_ptr, h_ptr, R, stride_as, stride_ar,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr, LORA: tl.constexpr = False,
):
    # the PDL wait comes first: prefetching the first weight tile before it was much slower
    pdl_wait(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    shrink = False
    if LORA:  # the programs past W's rows take the row's adapter's A rows: LoRA's shrink, on the same x
        shrink = pid >= tl.cdiv(N, BLOCK_N)
        if shrink:
            slot = tl.load(slots_ptr)
            offs_n = (pid - tl.cdiv(N, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = (offs_n < R) & (slot >= 0)
            rows = a_ptr + slot.to(tl.int64) * stride_as + offs_n[:, None].to(tl.int64) * stride_ar
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0, eviction_policy="evict_last")
        if GATED:  # x holds [gate | up]: act(gate) * up, rounded as act_and_mul's output is
            up = tl.load(x_ptr + K + kk, mask=kmask, other=0.0, eviction_policy="evict_last")
            if GELU:
                x = gelu_tanh_mul(x, up).to(x_ptr.dtype.element_ty)
            else:
                x = silu_mul(x, up).to(x_ptr.dtype.element_ty)
        x = x.to(tl.float32)
        w = tl.load(rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                    eviction_policy="evict_first")  # each weight byte is read once per step
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if shrink:  # float32 sums, as lora_shrink leaves them (zeros for a row without an adapter)
        tl.store(h_ptr + offs_n, y, mask=offs_n < R)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict[str, int] | None = None,
    act: str | None = None, out_dtype: torch.dtype | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``gemv_torch`` for x with one row ([1, K], or [1, 2K] with ``act``); W [N, K].
    The sums are float32 whatever the dtypes; the output is x's dtype, or ``out_dtype``. With
    ``lora`` (stacked A [S, R, K], the row's slot [1] int32) more programs take the slot's A rows
    in the same launch: returns (y, h) with h [1, 1, R] float32, ``lora_shrink``'s result."""
    n, k = weight.shape
    assert x.numel() == x.shape[-1] == (2 * k if act else k) and weight.stride(-1) == 1
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=out_dtype or x.dtype, device=x.device)
    cfg = config or DEFAULT_CONFIG
    grid = triton.cdiv(n, cfg["block_n"])
    a, slots, h, r = weight, weight, y, 0  # never read without lora
    if lora is not None:
        a, slots = lora
        assert a.shape[2] == k and a.stride(-1) == 1 and a.dtype == weight.dtype
        r = a.shape[1]
        h = torch.empty(1, 1, r, dtype=torch.float32, device=x.device)
        grid += triton.cdiv(r, cfg["block_n"])
    _gemv_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), a, slots, h, r, a.stride(0),
        a.stride(-2), HAS_BIAS=bias is not None, GATED=act is not None, GELU=act == "gelu_tanh",
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], LORA=lora is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_launch(x),
    )
    return y if lora is None else (y, h)


def _in_graph(x: torch.Tensor, tokens: int) -> bool:
    """The rule for every kernel here: it takes one token's product while a CUDA graph is captured.
    Eagerly, a Triton launch costs the host more than the kernel saves on the GPU."""
    return tokens == 1 and use_triton(x) and torch.cuda.is_current_stream_capturing()


def _graph_config(x: torch.Tensor, weight: torch.Tensor) -> dict[str, int] | None:
    """The GEMV's launch settings when it should take x @ W^T (``_in_graph``, one row of x, and a
    weight shape listed in GEMV_SHAPES), else None."""
    if not _in_graph(x, x.numel() // x.shape[-1]):
        return None
    return GEMV_SHAPES.get(tuple(weight.shape))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that while a CUDA graph is captured, one-row inputs on weight shapes
    listed in GEMV_SHAPES go to the kernel."""
    config = _graph_config(x, weight)
    if config is not None:
        return gemv_triton(x, weight, bias, config)
    return F.linear(x, weight, bias)


def linear_and_shrink(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None,
                      a: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``linear`` (``act_mul_linear`` with ``act``) and LoRA's shrink of the same x by its row's
    adapter (stacked A [S, R, K], slots [1]) in one launch, where ``linear`` takes the GEMV: (y,
    h [1, 1, R] float32); else None. At one token each LoRA kernel costs more than its bytes."""
    config = _graph_config(x, weight)
    if config is None or a.dtype != weight.dtype:
        return None
    return gemv_triton(x, weight, bias, config, act=act, lora=(a, slots))


def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W^T in float32 for a float32 W (DeepSeek's router, which routes in float32): for one
    row in a captured graph the GEMV, which reads the 16-bit x as it is; else F.linear on x
    converted (two cuBLAS kernels and the conversion's, where this is one launch)."""
    if _in_graph(x, x.numel() // x.shape[-1]):
        return gemv_triton(x, weight, config=FLOAT_GEMV_CONFIG, out_dtype=torch.float32)
    return F.linear(x.float(), weight)


def act_mul_linear(h: torch.Tensor, weight: torch.Tensor, act: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(act_and_mul(h, act)): one kernel where ``linear`` would take the GEMV, two otherwise."""
    config = _graph_config(h, weight)
    if config is not None:
        return gemv_triton(h, weight, bias, config, act=act)
    return F.linear(act_and_mul(h, act), weight, bias)


def head_matmul_torch(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x [T, H, K], w [H, N, K] (or [H, K, N] when ``transposed``) -> [T, H, N]: x[:, h] @ W_h^T."""
    return torch.bmm(x.transpose(0, 1), w if transposed else w.transpose(1, 2)).transpose(0, 1)


@triton.jit
def _head_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_xh, stride_wh, stride_wr, stride_yh,
                      TRANS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[h, n] = sum_k x[h, k] W_h[n, k] for the program's head h (axis 1) and BLOCK_N outputs.
    W_h's element (n, k) lies at h * stride_wh + n * stride_wr + k, or with TRANS at
    h * stride_wh + k * stride_wr + n: the tile is loaded along the unit stride either way, and
    summed over K once at the end."""
    pdl_wait(PDL)
    h = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    x_row = x_ptr + h * stride_xh
    w_h = w_ptr + h * stride_wh
    if TRANS:
        acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = tl.load(x_row + kk, mask=kmask, other=0.0).to(tl.float32)
        if TRANS:
            w = tl.load(w_h + kk[:, None] * stride_wr + offs_n[None, :], mask=kmask[:, None] & nmask[None, :],
                        other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[:, None]
        else:
            w = tl.load(w_h + offs_n[:, None] * stride_wr + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
    if TRANS:
        y = tl.sum(acc, 0)
    else:
        y = tl.sum(acc, 1)
    tl.store(y_ptr + h * stride_yh + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


def head_gemv_triton(x: torch.Tensor, w: torch.Tensor, transposed: bool,
                     config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton twin of ``head_matmul_torch`` for one token: x [1, H, K] -> [1, H, N], contiguous.
    x and w may be strided views; their last stride must be 1."""
    heads = w.shape[0]
    k, n = (w.shape[1], w.shape[2]) if transposed else (w.shape[2], w.shape[1])
    assert x.shape == (1, heads, k) and x.stride(-1) == 1 and w.stride(-1) == 1
    cfg = config or HEAD_GEMV_CONFIG[transposed]
    y = torch.empty(1, heads, n, dtype=x.dtype, device=x.device)
    _head_gemv_kernel[(triton.cdiv(n, cfg["block_n"]), heads)](
        x, w, y, n, k, x.stride(1), w.stride(0), w.stride(1), y.stride(1), TRANS=transposed,
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"], **pdl_launch(x))
    return y


def head_matmul(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``head_matmul_torch``, except that one token's product in a captured graph (``_in_graph``)
    is one launch of the kernel."""
    if _in_graph(x, x.shape[0]):
        return head_gemv_triton(x, w, transposed)
    return head_matmul_torch(x, w, transposed)
