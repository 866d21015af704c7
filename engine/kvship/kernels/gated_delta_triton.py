"""Gated DeltaNet on the GPU: the causal conv1d with its state, and the gated delta rule in
its chunked form (prefill chunks) and its recurrent form (decode steps), over a flat batch of
sequences of different lengths, each reading and writing its own state slot in place. The
references are kernels/gated_delta.py's; ``gated_delta`` there dispatches.

The delta-rule kernels take the conv's output as it is ([T, q | k | v]) with the decay and beta
logits (a, b): the L2 norms, the GQA-style sharing of a key head by several value heads, the
decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) happen as they load. One
program owns a (sequence, value head, value tile): its [Dk, BV] slice of the state stays in
registers over the whole sequence. Within a chunk of BT tokens the unit lower-triangular
system of the delta updates is solved by forward substitution, row by row, in registers.

A speculative verify's sequences (``spec_rows`` >= 0) also write their state after each new
token but the last into rows spec_row, spec_row + 1, ... of the same state tensors; their delta
rule runs the recurrence token by token (a few tokens each), as the reference does.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, tl, triton


@triton.jit
def _conv_kernel(x, sx, w, state, s_slot, slots, past, cu, out, so, C,
                 K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(cu + i)
    length = tl.load(cu + i + 1) - lo
    slot = tl.load(slots + i).to(tl.int64)
    has_past = tl.load(past + i) != 0
    t = tb * BT + tl.arange(0, BT)
    c = cb * BC + tl.arange(0, BC)
    mt, mc = t < length, c < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1) + j
        inside = src >= 0
        xv = tl.load(x + (lo + src)[:, None] * sx + c[None, :], mask=(mt & inside)[:, None] & mc[None, :], other=0.0)
        sv = tl.load(state + slot * s_slot + c[None, :] * (K - 1) + (K - 1 + src)[:, None],
                     mask=(mt & ~inside & has_past)[:, None] & mc[None, :], other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * tl.load(w + c * K + j, mask=mc, other=0.0).to(tl.float32)[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out + (lo + t)[:, None] * so + c[None, :], y.to(out.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_state_kernel(x, sx, state, s_slot, slots, past, spec, cu, C, K: tl.constexpr, KP: tl.constexpr,
                       BC: tl.constexpr, KEEP: tl.constexpr):
    """A sequence's new conv state: its last K-1 inputs, from this step's tokens and, for a
    step shorter than K-1, from its old state (read before the store: the slot is written
    last). A verify's sequence first writes the state after each earlier token to its rows."""
    i, cb = tl.program_id(0), tl.program_id(1)
    lo = tl.load(cu + i)
    length = tl.load(cu + i + 1) - lo
    slot = tl.load(slots + i).to(tl.int64)
    has_past = tl.load(past + i) != 0
    j = tl.arange(0, KP)
    c = cb * BC + tl.arange(0, BC)
    mj, mc = j < K - 1, c < C
    old = state + slot * s_slot + c[:, None] * (K - 1)
    first, row = length, slot
    if KEEP:
        row = tl.load(spec + i).to(tl.int64)
        first = tl.where(row >= 0, 1, length)
    for end in range(first, length + 1):  # the state after `end` tokens
        src = end - (K - 1) + j
        inside = src >= 0
        xv = tl.load(x + (lo + src)[None, :] * sx + c[:, None], mask=mc[:, None] & (mj & inside)[None, :], other=0.0)
        sv = tl.load(old + (K - 1 + src)[None, :], mask=mc[:, None] & (mj & ~inside & has_past)[None, :], other=0.0)
        dst = tl.where(end == length, slot, row + end - 1)
        tl.store(state + dst * s_slot + c[:, None] * (K - 1) + j[None, :],
                 (xv.to(tl.float32) + sv.to(tl.float32)).to(state.dtype.element_ty), mask=mc[:, None] & mj[None, :])


@triton.jit
def _qkv_gates(x, sx, a_ptr, b_ptr, sab, rows, mt, kh, h, offs_k, mk, offs_v, mv, a_log, dt_bias,
               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Rows ``rows`` of q, k (L2-normed, q scaled), v, g and beta for value head h."""
    base = x + rows[:, None] * sx
    m2 = mt[:, None] & mk[None, :]
    q = tl.load(base + kh * DK + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
    k = tl.load(base + HK * DK + kh * DK + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * HK * DK + h * DV + offs_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * (DK ** -0.5)
    k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    a = tl.load(a_ptr + rows * sab + h, mask=mt, other=0.0).to(tl.float32) + dt_bias
    b = tl.load(b_ptr + rows * sab + h, mask=mt, other=0.0).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = tl.where(mt, -tl.exp(a_log) * softplus, 0.0)
    beta = tl.where(mt, tl.sigmoid(b), 0.0)
    return q, k, v.to(tl.float32), g, beta


@triton.jit
def _token_step(x, sx, a_ptr, b_ptr, sab, t, s, kh, h, offs_k, mk, offs_v, mv, a_log, dt_bias, out,
                HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """The recurrence over token row t: its output stored, the new state returned."""
    r = tl.arange(0, 1)
    q, k, v, g, beta = _qkv_gates(x, sx, a_ptr, b_ptr, sab, t + r, r < 1, kh, h, offs_k, mk, offs_v, mv,
                                  a_log, dt_bias, HK, HV, DK, DV)
    s = s * tl.exp(tl.sum(g, 0))
    kt = tl.trans(k)  # [BK, 1]
    delta = (tl.sum(v, 0) - tl.sum(s * kt, 0)) * tl.sum(beta, 0)
    s = s + kt * delta[None, :]
    o = tl.sum(s * tl.trans(q), 0)
    tl.store(out + (t * HV + h) * DV + offs_v, o, mask=mv)
    return s


@triton.jit
def _delta_kernel(x, sx, a_ptr, b_ptr, sab, a_log_ptr, dt_ptr, state, s_slot, slots, past, spec, cu, out,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, CHUNKED: tl.constexpr,
                  KEEP: tl.constexpr):
    i, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(cu + i)
    length = tl.load(cu + i + 1) - lo
    slot = tl.load(slots + i).to(tl.int64)
    has_past = tl.load(past + i) != 0
    kh = h // (HV // HK)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    s_ptr = state + slot * s_slot + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s_mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr, mask=s_mask & has_past, other=0.0)
    a_log, dt_bias = tl.load(a_log_ptr + h).to(tl.float32), tl.load(dt_ptr + h).to(tl.float32)
    first_kept = -1
    if KEEP:
        first_kept = tl.load(spec + i).to(tl.int64)
    if first_kept >= 0:  # a verify's sequence: token by token, the state after each token but the last kept
        kept = state + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        for t in range(0, length):
            s = _token_step(x, sx, a_ptr, b_ptr, sab, lo + t, s, kh, h, offs_k, mk, offs_v, mv, a_log, dt_bias, out,
                            HK, HV, DK, DV)
            tl.store(kept + (first_kept + t) * s_slot, s, mask=s_mask & (t < length - 1))
    elif CHUNKED:
        r = tl.arange(0, BT)
        lower = r[:, None] > r[None, :]
        for c0 in range(0, length, BT):
            mt = c0 + r < length
            rows = lo + c0 + r
            q, k, v, g, beta = _qkv_gates(x, sx, a_ptr, b_ptr, sab, rows, mt, kh, h, offs_k, mk, offs_v, mv,
                                          a_log, dt_bias, HK, HV, DK, DV)
            cum = tl.cumsum(g, 0)
            diff = tl.where(lower | (r[:, None] == r[None, :]), cum[:, None] - cum[None, :], float("-inf"))
            decay = tl.exp(diff)  # exp(cum_i - cum_j) for j <= i, else 0
            tri = tl.where(lower, beta[:, None] * tl.dot(k, tl.trans(k)) * decay, 0.0)
            u = v * beta[:, None]
            w = k * (beta * tl.exp(cum))[:, None]
            for row in range(1, BT):  # (I + tri) [u | w] = [beta v | beta exp(cum) k], row by row
                pick = r[:, None] == row
                coef = tl.sum(tl.where(pick, tri, 0.0), 0)  # row `row` of tri, over the columns j
                u = tl.where(pick, u - tl.sum(coef[:, None] * u, 0)[None, :], u)
                w = tl.where(pick, w - tl.sum(coef[:, None] * w, 0)[None, :], w)
            u = u - tl.dot(w, s)
            o = tl.dot(q * tl.exp(cum)[:, None], s) + tl.dot(tl.dot(q, tl.trans(k)) * decay, u)
            tl.store(out + (rows[:, None] * HV + h) * DV + offs_v[None, :], o, mask=mt[:, None] & mv[None, :])
            total = tl.sum(g, 0)
            s = s * tl.exp(total) + tl.dot(tl.trans(k * tl.exp(total - cum)[:, None]), u)
    else:  # one token: the recurrence
        s = _token_step(x, sx, a_ptr, b_ptr, sab, lo, s, kh, h, offs_k, mk, offs_v, mv, a_log, dt_bias, out,
                        HK, HV, DK, DV)
    tl.store(s_ptr, s, mask=s_mask)


def conv1d_triton(x, weight, conv_state, slots, past, cu, max_len: int, spec_rows=None):
    """x [T, C] -> silu(conv) [T, C]; each sequence's conv_state[slot] updated in place (and,
    where ``spec_rows`` [B] is >= 0, the states after its earlier tokens written from there)."""
    t, c = x.shape
    k = weight.shape[1]
    out = torch.empty_like(x)
    bt, bc = 16, min(128, next_pow2(c))
    b = cu.shape[0] - 1
    _conv_kernel[(b, triton.cdiv(max_len, bt), triton.cdiv(c, bc))](
        x, x.stride(0), weight, conv_state, conv_state.stride(0), slots, past, cu, out, out.stride(0), c,
        K=k, BT=bt, BC=bc)
    _conv_state_kernel[(b, triton.cdiv(c, bc))](x, x.stride(0), conv_state, conv_state.stride(0), slots, past,
                                               slots if spec_rows is None else spec_rows, cu, c, K=k,
                                               KP=next_pow2(max(k - 1, 1)), BC=bc, KEEP=spec_rows is not None)
    return out


def delta_rule_triton(mixed, a, b, a_log, dt_bias, state, slots, past, cu, hk: int, decode: bool,
                      spec_rows=None, chunk: int = 16):
    """mixed [T, q | k | v] (the conv's output), a and b [T, Hv] -> o [T, Hv, Dv] float32; each
    sequence's state[slot] ([Hv, Dk, Dv] float32) read (where ``past``) and written in place.
    ``decode``: one token per sequence (the recurrence), else the chunked form, BT = ``chunk``.
    ``spec_rows`` as conv1d_triton's."""
    _, hv, dk, dv = state.shape
    assert a.stride(0) == b.stride(0) and a.stride(1) == 1 and b.stride(1) == 1 and mixed.stride(1) == 1
    out = torch.empty(mixed.shape[0], hv, dv, dtype=torch.float32, device=mixed.device)
    bk = max(16, next_pow2(dk))
    bv = min(32, max(16, next_pow2(dv)))
    grid = (cu.shape[0] - 1, hv, triton.cdiv(dv, bv))
    _delta_kernel[grid](mixed, mixed.stride(0), a, b, a.stride(0), a_log, dt_bias, state, state.stride(0), slots,
                        past, slots if spec_rows is None else spec_rows, cu, out, HK=hk, HV=hv, DK=dk, DV=dv, BK=bk,
                        BV=bv, BT=chunk, CHUNKED=not decode, KEEP=spec_rows is not None)
    return out
