"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the causal depthwise conv1d over the projected q/k/v
and the gated delta rule, as plain-torch references over a flat batch of sequences.

Shapes: a step's T tokens, sequences delimited by cu_seqlens [B+1]. The conv state of a sequence
is its last K-1 inputs [C, K-1]; the delta state is a matrix per value head [H, Dk, Dv] (fp32),
S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T, o_t = S_t^T q_t.
q and k arrive L2-normalised, q already scaled by Dk^-1/2 (as transformers' reference does).

Prefill chunks run the chunked (WY / UT-transform) form, decode steps the recurrence; both are
exact rewritings of the same sum, so a step may start anywhere inside a chunk of the form.
kernels/gated_delta_triton.py holds the GPU kernels (layers/gated_delta.py picks the path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # the chunked form's block of positions (as the FLA kernels and transformers use)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32 (transformers' and FLA's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                        cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K], state [B, C, K-1] (zeros for a sequence with no past) ->
    (silu(conv) [T, C] in x's dtype, the new states [B, C, K-1])."""
    out, new_state = torch.empty_like(x), torch.empty_like(state)
    width = weight.shape[1]
    for i in range(len(cu_seqlens) - 1):
        lo, hi = cu_seqlens[i], cu_seqlens[i + 1]
        ext = torch.cat([state[i].to(x.dtype), x[lo:hi].T], dim=1)  # [C, K-1+L]
        y = F.conv1d(ext[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, L]
        out[lo:hi] = F.silu(y).T.to(x.dtype)
        new_state[i] = ext[:, ext.shape[1] - (width - 1):]
    return out, new_state


def conv1d_step_torch(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, C], state [B, C, K-1] -> (silu(conv) [B, C], new state)."""
    ext = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    y = (ext.float() * weight.float()).sum(-1)
    return F.silu(y).to(x.dtype), ext[:, :, 1:]


def recurrent_step_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv]
    (fp32) -> (o [B, H, Dv] fp32, new state)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def recurrent_states_torch(q, k, v, g, beta, state):
    """The definition, token by token: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state
    [H, Dk, Dv] -> (o [L, H, Dv], the state after each position [L, H, Dk, Dv]). A verify step
    keeps them all: the one after its last accepted token becomes the sequence's."""
    outs, states = [], []
    for t in range(q.shape[0]):
        o, state = recurrent_step_torch(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state[None])
        state = state[0]
        outs.append(o)
        states.append(state)
    return torch.cat(outs), torch.stack(states)


def recurrent_torch(q, k, v, g, beta, state):
    """As ``recurrent_states_torch``, the final state only. The chunked form is tested against it."""
    o, states = recurrent_states_torch(q, k, v, g, beta, state)
    return o, states[-1]


def conv_states_torch(x: torch.Tensor, state: torch.Tensor, width: int) -> torch.Tensor:
    """One sequence's conv state after each of its positions: x [L, C], state [C, K-1] (zeros
    with no past) -> [L, C, K-1], the last K-1 inputs up to each position."""
    ext = torch.cat([state.to(x.dtype), x.T], dim=1)  # [C, K-1+L]
    return ext.unfold(1, width - 1, 1)[:, 1:].permute(1, 0, 2)


def chunked_torch(q, k, v, g, beta, state, chunk: int = CHUNK):
    """One sequence in the chunked form: arguments as ``recurrent_torch``. Within a chunk the
    delta updates are solved at once (a unit lower-triangular system), between chunks the state
    carries, as transformers' torch_chunk_gated_delta_rule."""
    length = q.shape[0]
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # heads first
    pad = -length % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h, n = q.shape[0], (length + pad) // chunk
    q, k, v = (t.reshape(h, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # solved as I + its strictly lower part
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    s = state.float()
    for i in range(n):
        u = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ u
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ u
    return out.reshape(h, n * chunk, -1)[:, :length].transpose(0, 1), s


def delta_rule_torch(q, k, v, g, beta, state: torch.Tensor, cu_seqlens: list[int]):
    """A flat batch: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [B, H, Dk, Dv] (zeros
    for a sequence with no past) -> (o [T, H, Dv] fp32, final states [B, H, Dk, Dv])."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(state)
    for i in range(len(cu_seqlens) - 1):
        lo, hi = cu_seqlens[i], cu_seqlens[i + 1]
        out[lo:hi], final[i] = chunked_torch(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state[i])
    return out, final
