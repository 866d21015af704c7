"""The Gated DeltaNet layer (Qwen3-Next, Qwen3.5): projections, the causal conv1d with its
state, the gated delta rule with its state, the gated RMSNorm and the output projection.

Each running sequence owns one slot of recurrent state (AttentionMetadata.state_slots, given
by the KV-cache manager with its blocks): the last K-1 conv inputs and the delta-rule matrices,
read at the start of its step and written at its end. A speculative verify step
(AttentionMetadata.spec_state_rows) also keeps the state after each of a sequence's new tokens
but the last, in rows past the slots: the runner copies the one after the last accepted token
into the slot, which drops the rejected tokens' updates (as vLLM and SGLang keep per-position
states). Those sequences run the recurrence token by token (a few tokens each). A sequence with nothing computed before
the step (seq_lens equal to its new tokens: a new or recomputed one) starts from zeros, so a
preempted sequence rebuilds its state from its tokens. Without slots (the runner's start-up
prefills) every sequence starts from zeros and nothing is kept.

Tensor parallelism shards the key heads, each rank taking its value heads with them (the value
heads are grouped by key head): its rows of every in_proj part, its q, k and v conv channels,
its A_log and dt_bias entries, out_proj's matching input columns (partial sums, reduced by the
post-attention norm), and its slice of the recurrent state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.kernels import gated_delta as gd
from kvship.kernels import gated_delta_triton as gdt
from kvship.kernels._triton import use_triton
from kvship.kernels.norm import gated_rms_norm
from kvship.layers.attention import AttentionMetadata
from kvship.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvship.parallel import TPContext


class GatedDeltaNet(nn.Module):
    # in_proj's parts, in its rows' order: the conv's input (q, k, v), the output gate z, beta's
    # and the decay's logits (b, a); checkpoints name them in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    PARTS = ("q", "k", "v", "z", "b", "a")

    def __init__(self, cfg, tp: TPContext, backend: str):
        super().__init__()
        la = cfg.linear_attention
        self.tp = tp
        self.hk = tp.shard(la.num_key_heads, "linear_num_key_heads")  # this rank's heads
        self.hv = tp.shard(la.num_value_heads, "linear_num_value_heads")
        self.dk, self.dv, self.width = la.key_head_dim, la.value_head_dim, la.conv_kernel
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.sizes = [key_dim, key_dim, value_dim, value_dim, self.hv, self.hv]
        self.in_proj = MergedColumnParallelLinear(cfg.hidden_size, [n * tp.size for n in self.sizes], False, tp,
                                                  quant=cfg.quantization)
        self.in_proj.checkpoint_parts = tuple(f"in_proj_{p}" for p in self.PARTS)  # the names it loads under
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.width), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        for p in (self.conv_weight, self.A_log, self.dt_bias):
            p.weight_loader = self._load_sharded
        self.norm_weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)  # per value head, shared
        self.eps = cfg.rms_norm_eps
        # partial sums, as LlamaAttention's o_proj: the post-attention norm reduces them
        self.out_proj = RowParallelLinear(value_dim * tp.size, cfg.hidden_size, False, tp, reduce=False,
                                          quant=cfg.quantization)
        self.force_torch = backend == "torch"
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K-1], bound by bind_state
        self.delta_state: torch.Tensor | None = None  # [slots, Hv, Dk, Dv] float32

    def _load_sharded(self, param: nn.Parameter, ref, shard_id=None) -> None:
        """This rank's rows: of A_log and dt_bias its value heads; of the conv its q, k and v
        channels (the checkpoint's rows are all q, then all k, then all v)."""
        r = self.tp.rank
        if param is not self.conv_weight:
            param.data.copy_(ref.load((slice(r * self.hv, (r + 1) * self.hv),)))
            return
        parts, start = [], 0
        for size in self.sizes[:3]:
            parts.append(ref.load((slice(start + r * size, start + (r + 1) * size),)))
            start += size * self.tp.size
        param.data.copy_(torch.cat(parts))

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One slot's tensors: the conv inputs in the model's dtype, the delta rule's matrices in
        float32 (they sum a whole context's updates, as transformers' reference keeps them)."""
        return [((self.conv_dim, self.width - 1), dtype), ((self.hv, self.dk, self.dv), torch.float32)]

    def bind_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        (conv, cdt), (delta, ddt) = self.state_shapes(dtype)
        self.conv_state = torch.zeros(num_slots, *conv, dtype=cdt, device=device)
        self.delta_state = torch.zeros(num_slots, *delta, dtype=ddt, device=device)

    def _initial(self, meta: AttentionMetadata, q_lens: torch.Tensor, dtype, device):
        """Each sequence's starting state: its slot's, or zeros where it has no past."""
        n = q_lens.shape[0]
        slots = meta.state_slots
        if slots is None:
            return (torch.zeros(n, self.conv_dim, self.width - 1, dtype=dtype, device=device),
                    torch.zeros(n, self.hv, self.dk, self.dv, dtype=torch.float32, device=device))
        past = meta.has_past.bool()[:, None, None]
        conv, delta = self.conv_state[slots], self.delta_state[slots]
        return torch.where(past, conv, 0).to(dtype), torch.where(past[..., None], delta, 0)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, *self.sizes[3:]], dim=-1)
        q_lens = meta.query_lens
        decode = meta.num_decodes == q_lens.shape[0]
        if use_triton(x) and not self.force_torch:
            o = self._triton(mixed, a, b, meta, q_lens, decode)
        else:
            o = self._torch(mixed, a, b, meta, q_lens, decode)
        # the gated RMSNorm: normed per value head (weight times, in the model's dtype), times silu(z)
        return self.out_proj(gated_rms_norm(o, z, self.norm_weight, self.eps, x.dtype))

    def _triton(self, mixed, a, b, meta: AttentionMetadata, q_lens, decode: bool) -> torch.Tensor:
        slots, conv, delta = meta.state_slots, self.conv_state, self.delta_state
        past = meta.has_past
        if slots is None:  # a throw-away state for each sequence, started from zeros
            n = q_lens.shape[0]
            slots = torch.arange(n, device=mixed.device)
            (cs, cdt), (ds, ddt) = self.state_shapes(mixed.dtype)
            conv = torch.empty(n, *cs, dtype=cdt, device=mixed.device)
            delta = torch.empty(n, *ds, dtype=ddt, device=mixed.device)
            past = torch.zeros_like(past)
        rows = meta.spec_state_rows
        mixed = gdt.conv1d_triton(mixed, self.conv_weight, conv, slots, past, meta.cu_seqlens_q, meta.max_seqlen_q,
                                  rows)
        return gdt.delta_rule_triton(mixed, a, b, self.A_log, self.dt_bias, delta, slots, past, meta.cu_seqlens_q,
                                     self.hk, decode, rows)

    def _torch(self, mixed, a, b, meta: AttentionMetadata, q_lens, decode: bool) -> torch.Tensor:
        t = mixed.shape[0]
        conv0, delta0 = self._initial(meta, q_lens, mixed.dtype, mixed.device)
        if decode:
            mixed, conv1 = gd.conv1d_step_torch(mixed, self.conv_weight, conv0)
        else:
            bounds = meta.cu_seqlens_q.tolist()
            verify = self._verify_spans(meta, bounds)
            for row, i, lo, hi in verify:
                self.conv_state[row:row + hi - lo - 1] = gd.conv_states_torch(mixed[lo:hi - 1], conv0[i], self.width)
            mixed, conv1 = gd.causal_conv1d_torch(mixed, self.conv_weight, conv0, bounds)
        q, k, v = mixed.split(self.sizes[:3], dim=-1)
        r = self.hv // self.hk
        q = (gd.l2norm(q.reshape(t, self.hk, self.dk)) * self.dk**-0.5).repeat_interleave(r, dim=1)
        k = gd.l2norm(k.reshape(t, self.hk, self.dk)).repeat_interleave(r, dim=1)
        v = v.reshape(t, self.hv, self.dv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = torch.sigmoid(b.float())
        if decode:
            o, delta1 = gd.recurrent_step_torch(q, k, v, g, beta, delta0)
        else:
            o, delta1 = gd.delta_rule_torch(q, k, v, g, beta, delta0, bounds)
            for row, i, lo, hi in verify:  # as the Triton path runs them: token by token
                o[lo:hi], states = gd.recurrent_states_torch(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                                             delta0[i])
                self.delta_state[row:row + hi - lo - 1] = states[:-1]
                delta1[i] = states[-1]
        if meta.state_slots is not None:
            self.conv_state[meta.state_slots] = conv1.to(self.conv_state.dtype)
            self.delta_state[meta.state_slots] = delta1
        return o

    @staticmethod
    def _verify_spans(meta: AttentionMetadata, bounds: list[int]) -> list[tuple[int, int, int, int]]:
        """(first state row, sequence, its first and end token) of each sequence whose states
        after its positions are kept (a verify's)."""
        if meta.spec_state_rows is None:
            return []
        return [(row, i, bounds[i], bounds[i + 1]) for i, row in enumerate(meta.spec_state_rows.tolist()) if row >= 0]
