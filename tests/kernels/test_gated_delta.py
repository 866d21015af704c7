"""Gated DeltaNet: the chunked form against the token-by-token definition, and the Triton
kernels (the conv1d with its state, the chunked and recurrent delta rule) against the torch
references, in the interpreter on the CPU (fp32: the interpreter's tl.dot on bf16 is wrong)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvship.kernels import gated_delta as gd
from kvship.kernels._triton import HAS_TRITON

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
HK, HV, DK, DV, K = 2, 4, 16, 16, 4
C = 2 * HK * DK + HV * DV


def test_chunked_form_equals_the_recurrence():
    g = torch.Generator().manual_seed(0)
    length, h, dk, dv = 150, 3, 8, 6
    q = gd.l2norm(torch.randn(length, h, dk, generator=g)) * dk**-0.5
    k = gd.l2norm(torch.randn(length, h, dk, generator=g))
    v, s0 = torch.randn(length, h, dv, generator=g), torch.randn(h, dk, dv, generator=g)
    decay, beta = -torch.rand(length, h, generator=g), torch.rand(length, h, generator=g)
    want, want_s = gd.recurrent_torch(q, k, v, decay, beta, s0)
    for chunk in (16, 64):  # 150 tokens: a partial last chunk either way
        got, got_s = gd.chunked_torch(q, k, v, decay, beta, s0, chunk)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=0)


def _step(lens, past, slots, seed=0):
    """A step's projections and states, and the references' outputs and new states."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t = sum(lens)
    proj = torch.randn(t, C + 2 * HV, generator=g)
    mixed, a, b = proj.split([C, HV, HV], -1)
    weight, a_log, dt = torch.randn(C, K, generator=g) * 0.5, torch.rand(HV, generator=g).log(), torch.rand(HV, generator=g)
    conv, delta = torch.randn(8, C, K - 1, generator=g), torch.randn(8, HV, DK, DV, generator=g) * 0.1
    keep = past.bool()
    c0 = torch.where(keep[:, None, None], conv[slots], 0)
    d0 = torch.where(keep[:, None, None, None], delta[slots], 0)
    y, c1 = gd.causal_conv1d_torch(mixed, weight, c0, cu.tolist())
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], -1)
    q = (gd.l2norm(q.reshape(t, HK, DK)) * DK**-0.5).repeat_interleave(HV // HK, 1)
    k = gd.l2norm(k.reshape(t, HK, DK)).repeat_interleave(HV // HK, 1)
    o, d1 = gd.delta_rule_torch(q, k, v.reshape(t, HV, DV), -a_log.exp() * F.softplus(a + dt), torch.sigmoid(b), d0,
                                cu.tolist())
    inputs = [x.to(DEV) for x in (mixed, a, b, weight, a_log, dt, conv, delta, slots, past, cu)]
    return inputs, (y, c1, o, d1)


def test_decode_step_references_agree_with_the_chunked_ones():
    past, slots = torch.tensor([1, 0, 1], dtype=torch.int32), torch.tensor([4, 1, 7])
    (mixed, a, b, weight, a_log, dt, conv, delta, *_), (y, c1, o, d1) = _step([1, 1, 1], past, slots)
    keep = past.bool()
    got_y, got_c = gd.conv1d_step_torch(mixed, weight, torch.where(keep[:, None, None], conv[slots], 0))
    torch.testing.assert_close(got_y, y, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_c, c1, atol=0, rtol=0)
    q, k, v = got_y.split([HK * DK, HK * DK, HV * DV], -1)
    q = (gd.l2norm(q.reshape(3, HK, DK)) * DK**-0.5).repeat_interleave(HV // HK, 1)
    k = gd.l2norm(k.reshape(3, HK, DK)).repeat_interleave(HV // HK, 1)
    got_o, got_d = gd.recurrent_step_torch(q, k, v.reshape(3, HV, DV), -a_log.exp() * F.softplus(a + dt),
                                           torch.sigmoid(b), torch.where(keep[:, None, None, None], delta[slots], 0))
    torch.testing.assert_close(got_o, o, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_d, d1, atol=1e-6, rtol=0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lens,decode", [([1, 37, 5, 2], False), ([1, 1, 1], True)])
def test_triton_kernels_match_the_references(lens, decode):
    """Sequences of different lengths (one shorter than the conv's window, one over two
    chunks of 16), some with a past state and some without, in slots out of order; the
    kernels write each sequence's slot in place and leave the others as they were."""
    from kvship.kernels.gated_delta_triton import conv1d_triton, delta_rule_triton

    past = torch.tensor([1, 1, 0, 1][:len(lens)], dtype=torch.int32)
    slots = torch.tensor([3, 0, 2, 5][:len(lens)])
    (mixed, a, b, weight, a_log, dt, conv, delta, sl, pa, cu), (y, c1, o, d1) = _step(lens, past, slots)
    before_conv, before_delta = conv.clone(), delta.clone()
    got_y = conv1d_triton(mixed, weight, conv, sl, pa, cu, max(lens))
    got_o = delta_rule_triton(got_y, a, b, a_log, dt, delta, sl, pa, cu, HK, decode)
    torch.testing.assert_close(got_y.cpu(), y, atol=2e-5, rtol=0)
    torch.testing.assert_close(got_o.cpu(), o, atol=2e-5, rtol=0)
    torch.testing.assert_close(conv[sl].cpu(), c1, atol=0, rtol=0)
    torch.testing.assert_close(delta[sl].cpu(), d1, atol=2e-5, rtol=0)
    others = [i for i in range(8) if i not in slots.tolist()]
    assert torch.equal(conv[others], before_conv[others]) and torch.equal(delta[others], before_delta[others])


def _per_position_states(mixed, a, b, weight, a_log, dt, c0, d0, lo, hi):
    """The references' conv and delta states after each of one sequence's tokens."""
    conv = gd.conv_states_torch(mixed[lo:hi], c0, K)
    y, _ = gd.causal_conv1d_torch(mixed[lo:hi], weight, c0[None], [0, hi - lo])
    n = hi - lo
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], -1)
    q = (gd.l2norm(q.reshape(n, HK, DK)) * DK**-0.5).repeat_interleave(HV // HK, 1)
    k = gd.l2norm(k.reshape(n, HK, DK)).repeat_interleave(HV // HK, 1)
    o, delta = gd.recurrent_states_torch(q, k, v.reshape(n, HV, DV), -a_log.exp() * F.softplus(a[lo:hi] + dt),
                                         torch.sigmoid(b[lo:hi]), d0)
    return conv, delta, o


def test_per_position_states_end_where_the_step_ends():
    """The state after a sequence's last token, kept position by position, is the one the
    step writes (chunked conv and delta rule), and its outputs are the chunked form's."""
    past, slots = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([2, 5])
    (mixed, a, b, weight, a_log, dt, conv, delta, *_, cu), (y, c1, o, d1) = _step([5, 2], past, slots)
    for i, (lo, hi) in enumerate(((0, 5), (5, 7))):
        c0 = conv[slots[i]] if past[i] else torch.zeros_like(conv[0])
        d0 = delta[slots[i]] if past[i] else torch.zeros_like(delta[0])
        got_c, got_d, got_o = _per_position_states(mixed, a, b, weight, a_log, dt, c0, d0, lo, hi)
        torch.testing.assert_close(got_c[-1], c1[i], atol=0, rtol=0)
        torch.testing.assert_close(got_d[-1], d1[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(got_o, o[lo:hi], atol=1e-5, rtol=0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.timeout(300)
def test_triton_verify_keeps_the_state_after_each_token():
    """A verify step beside a prefill chunk and a decode: the sequences with state rows write
    their state after each token but the last there (the last into their slot), token by token
    as the reference runs them; no other row changes."""
    from kvship.kernels.gated_delta_triton import conv1d_triton, delta_rule_triton

    lens, past, slots = [4, 20, 1, 3], torch.tensor([1, 0, 1, 1], dtype=torch.int32), torch.tensor([3, 0, 2, 5])
    (mixed, a, b, weight, a_log, dt, conv, delta, sl, pa, cu), (y, c1, o, d1) = _step(lens, past, slots)
    conv = torch.cat([conv, torch.zeros(8, *conv.shape[1:], device=DEV)])
    delta = torch.cat([delta, torch.zeros(8, *delta.shape[1:], device=DEV)])
    rows = torch.tensor([8, -1, -1, 12], device=DEV)
    before_conv, before_delta = conv.clone(), delta.clone()
    got_y = conv1d_triton(mixed, weight, conv, sl, pa, cu, max(lens), rows)
    got_o = delta_rule_triton(got_y, a, b, a_log, dt, delta, sl, pa, cu, HK, False, rows)
    torch.testing.assert_close(got_y.cpu(), y, atol=2e-5, rtol=0)
    torch.testing.assert_close(conv[sl].cpu(), c1, atol=0, rtol=0)
    torch.testing.assert_close(delta[sl].cpu(), d1, atol=2e-5, rtol=0)
    cpu = [t.cpu() for t in (mixed, a, b, weight, a_log, dt)]
    bounds = cu.tolist()
    for i, row in ((0, 8), (3, 12)):
        lo, hi = bounds[i], bounds[i + 1]
        want_c, want_d, want_o = _per_position_states(*cpu, before_conv[slots[i]].cpu(), before_delta[slots[i]].cpu(),
                                                      lo, hi)
        n = hi - lo - 1
        torch.testing.assert_close(conv[row:row + n].cpu(), want_c[:-1], atol=0, rtol=0)
        torch.testing.assert_close(delta[row:row + n].cpu(), want_d[:-1], atol=2e-5, rtol=0)
        torch.testing.assert_close(got_o[lo:hi].cpu(), want_o, atol=2e-5, rtol=0)
    torch.testing.assert_close(got_o[4:24].cpu(), o[4:24], atol=2e-5, rtol=0)
    touched = set(slots.tolist()) | {8, 9, 10, 12, 13}
    others = [i for i in range(16) if i not in touched]
    assert torch.equal(conv[others], before_conv[others]) and torch.equal(delta[others], before_delta[others])


def _sm90_specs():
    """The conv and delta-rule kernels at a Qwen3.6-27B shape (16 key heads and 48 value heads of
    128 per rank, conv width 4) as the layer launches them, with and without a verify's
    per-position state rows (KEEP), chunked and one-token; each once with its pointers 16-byte
    aligned (as torch allocates them: Triton specializes on it)."""
    for spec in _sm90_variants():
        yield spec
        yield {**spec, "divisible": [n for n, t in spec["types"].items() if t.startswith("*")]}


def _sm90_variants():
    conv = {"x": "*bf16", "sx": "i32", "state": "*bf16", "s_slot": "i32", "slots": "*i64", "past": "*i32",
            "cu": "*i32", "C": "i32"}
    yield {"kernel": "kvship.kernels.gated_delta_triton:_conv_kernel",
           "types": {**conv, "w": "*bf16", "out": "*bf16", "so": "i32"}, "constexprs": {"K": 4, "BT": 16, "BC": 128}}
    for keep in (False, True):
        yield {"kernel": "kvship.kernels.gated_delta_triton:_conv_state_kernel", "types": {**conv, "spec": "*i64"},
               "constexprs": {"K": 4, "KP": 4, "BC": 128, "KEEP": keep}}
        for chunked in (False, True):
            types = {"x": "*bf16", "sx": "i32", "a_ptr": "*bf16", "b_ptr": "*bf16", "sab": "i32", "a_log_ptr": "*bf16",
                     "dt_ptr": "*bf16", "state": "*fp32", "s_slot": "i32", "slots": "*i64", "past": "*i32",
                     "spec": "*i64", "cu": "*i32", "out": "*fp32"}
            yield {"kernel": "kvship.kernels.gated_delta_triton:_delta_kernel", "types": types,
                   "constexprs": {"HK": 16, "HV": 48, "DK": 128, "DV": 128, "BK": 128, "BV": 32, "BT": 16,
                                  "CHUNKED": chunked, "KEEP": keep}}


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.timeout(900)
def test_kernels_compile_for_sm90():
    """On a machine without a GPU (tests/sm90_compile.py says why): every variant compiles for
    an H100/H200 within a block's shared memory."""
    from sm90_compile import compile_in_child

    compile_in_child(list(_sm90_specs()))
