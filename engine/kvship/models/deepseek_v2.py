"""DeepSeek-V2 and DeepSeek-V2-Lite (DeepseekV2ForCausalLM), and DeepSeek-V3's architecture
(DeepseekV3ForCausalLM: Moonlight-16B-A3B): Llama's pre-norm block (models/llama.py) with
multi-head latent attention (MLA) and, from layer first_k_dense_replace on, routed experts
beside always-on shared experts.

MLA compresses each token's keys and values into one normalized latent c (kv_lora_rank wide)
plus a key part k_pe (qk_rope_head_dim) that carries the rotary embedding and is shared by
every head; kv_b_proj expands c into each head's k_nope and v. The cache holds c and k_pe only
(layers/attention.py: LatentAttention), and attention runs in the absorbed form: q_nope is
projected into the latent space through the head's W_UK rows of kv_b_proj, attention is MQA
over the latent rows, and the attended latent goes through the head's W_UV rows before o_proj.
Scores are scaled by qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared.

Rotary: DeepSeek rotates the rope channels of q and k as adjacent pairs (2i, 2i + 1), as
transformers' complex product does; kvship's rotary rotates halves (i, i + d/2). The loader
puts the rope rows of q_proj (q_b_proj) and kv_a_proj_with_mqa in the order even channels, then
odd ones, so the projections come out in the halves layout: the same rotation of the same
pairs, and as q_pe and k_pe only meet in their dot product, the same scores.

Routing: V2 takes a softmax over the experts, the top k (greedy, or group_limited_greedy: only
the topk_group groups with the best expert compete); V3 sigmoid scores, chosen with a bias
(kernels/fused_moe.py noaux_route). Weights times routed_scaling_factor, computed in float32 as transformers does
(the router's weight is held in float32). The shared experts are one SwiGLU MLP of
n_shared_experts * moe_intermediate_size, ungated.

Tensor parallelism: query heads are sharded (q_proj / q_b_proj and kv_b_proj by rows, o_proj by
columns); the latent's projection and norm (and q_a_proj) are replicated, so every rank stores
the whole latent cache.

Quantized weights: a quantized checkpoint (FP8 block-wise or per channel, GPTQ, AWQ,
compressed-tensors: quant/formats.py; a GGUF file's blocks: loader/gguf.py) or in-situ
(--quantization): every projection but the router and kv_b_proj, which the absorbed products
multiply by its per-head blocks and which is held in 16 bits (a checkpoint's quantized one
dequantized at load).

KV cache: the model's dtype or FP8 (LatentAttention).

Multi-token prediction (V3): the checkpoint's layers past num_hidden_layers
(num_nextn_predict_layers) are loaded into ``mtp`` (models/mtp.py) for speculative decoding.

Not supported (refused by name in models/config.py or the runner): an int4 KV cache, V2
scoring other than softmax (V3's other than noaux_tc), attention or MLP biases, V2 with
norm_topk_prob.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvship.kernels.fused_moe import noaux_route
from kvship.kernels.gemv import float_linear, head_matmul
from kvship.layers.attention import AttentionMetadata, LatentAttention
from kvship.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvship.layers.moe import route
from kvship.layers.norm import RMSNorm
from kvship.layers.rotary import RotaryEmbedding, yarn_mscale
from kvship.loader.source import WeightRef, apply_slices
from kvship.models.config import ModelConfig
from kvship.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, SparseMoeBlock
from kvship.models.mtp import NextTokenLayer, next_token_layers, nextn_renamed
from kvship.parallel import SINGLE, TPContext
from kvship.quant import QuantRef


def mla_scale(cfg: ModelConfig) -> float:
    """The scores' scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str,
                 window: int | None = None):
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.nope, self.rope, self.v_dim, self.rank = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.num_heads = tp.shard(heads, "num_attention_heads")
        q_out = heads * (self.nope + self.rope)
        quant = cfg.quantization
        if cfg.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(hidden, cfg.q_lora_rank, False, SINGLE, quant)  # replicated
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, q_out, False, tp, quant)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_out, False, tp, quant)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.rank + self.rope, False, SINGLE, quant)  # replicated
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # 16 bits always: forward multiplies by its per-head blocks (W_UK, W_UV) directly
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), False, tp)
        # partial sums: the post-attention norm reduces them, as in LlamaAttention
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, False, tp, reduce=False, quant=quant)
        self.attn = LatentAttention(self.num_heads, self.rank, self.rope, rotary, backend, mla_scale(cfg))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_pe = q.view(-1, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # a view with the rope key beside each row: the norm reads it so
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)  # per head: W_UK rows, then W_UV rows
        q_lat = head_matmul(q_nope, w[:, :self.nope], transposed=True)  # [T, h, rank]
        o_lat = self.attn(positions, q_lat, q_pe, latent, k_pe, meta)
        out = head_matmul(o_lat, w[:, self.nope:], transposed=False)  # [T, h, v]
        return self.o_proj(out.reshape(-1, h * self.v_dim))


def group_limited_route(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's group_limited_greedy: experts in n_group groups, a group rated by its best
    expert's probability; the top k over the best topk_group groups' experts."""
    probs = torch.softmax(logits.float(), dim=-1)
    per_group = probs.shape[-1] // n_group
    best = probs.view(-1, n_group, per_group).amax(dim=-1)
    keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, dim=-1).indices, 1.0)
    weights, ids = (probs * keep.repeat_interleave(per_group, dim=1)).topk(top_k, dim=-1)
    return weights, ids


class DeepseekV2MoE(SparseMoeBlock):
    """SparseMoeBlock's router and experts, DeepSeek's routing (V3's with its router's
    e_score_correction_bias, float32 as checkpoints store it), and the ungated shared experts."""

    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__(cfg, tp)
        self.scaling, self.groups, self.scoring = cfg.routed_scaling_factor, cfg.moe_groups, cfg.moe_scoring
        self.gate.float()  # DeepSeek routes in float32: held so, not converted every step
        if self.scoring == "sigmoid":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        self.shared_experts = None
        if cfg.shared_experts_intermediate_size:
            self.shared_experts = LlamaMLP(cfg, tp, cfg.shared_experts_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = float_linear(x, self.gate.weight)
        if self.scoring == "sigmoid":  # the routing kernel scales the weights too
            weights, ids = noaux_route(logits, self.gate.e_score_correction_bias, self.top_k, *self.groups,
                                       self.renormalize, self.scaling)
        else:
            if self.groups is None:
                weights, ids = route(logits, self.top_k, False)
            else:
                weights, ids = group_limited_route(logits, self.top_k, *self.groups)
            if self.scaling != 1.0:
                weights = weights * self.scaling
        # the shared experts first: the routed experts' kernel adds their output into its own
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return self.experts(x, weights, ids, add=shared)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention = DeepseekV2Attention
    sparse_mlp = DeepseekV2MoE


class DeepseekV3MTPLayer(DeepseekV2DecoderLayer, NextTokenLayer):
    """A multi-token-prediction layer (models/mtp.py)."""


class DeepseekV2Model(LlamaModel):
    layer = DeepseekV2DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__(cfg, max_positions, tp, backend)
        rotary = self.layers[0].self_attn.attn.rotary
        self.mtp = next_token_layers(DeepseekV3MTPLayer, cfg, rotary, tp, backend)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    backbone = DeepseekV2Model
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    optional_weights = ("model.mtp.",)  # a checkpoint saved without them (as transformers saves one)

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        """The checkpoint's layers past num_hidden_layers are V3's multi-token-prediction layers:
        into ``mtp`` when the config names them (num_nextn_predict_layers), else skipped."""
        seen: set[int] = set()
        super().load_weights(((name, self._halves_layout(name, ref))
                              for name, ref in nextn_renamed(weights, self.cfg, seen)), need_lm_head)
        if not seen:
            self.model.mtp = nn.ModuleList()  # announced by the config, absent from the checkpoint

    def _halves_layout(self, name: str, ref):
        """The rope rows of a query or latent projection reordered from DeepSeek's adjacent pairs
        to the halves layout (module docstring); other tensors as they are, and every tensor of a
        V3 checkpoint that says its rope is not interleaved (rope_interleave false)."""
        c = self.cfg
        if not c.rope_interleave:
            return ref
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            head, first = c.qk_nope_head_dim + c.head_dim, c.qk_nope_head_dim
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            head, first = c.kv_lora_rank + c.head_dim, c.kv_lora_rank
        else:
            return ref
        order = torch.cat([torch.arange(head)[:first], first + torch.arange(0, c.head_dim, 2),
                           first + torch.arange(1, c.head_dim, 2)])

        def reorder(t: torch.Tensor) -> torch.Tensor:  # the rows of each head, then of the whole tensor
            return t.view(-1, head, *t.shape[1:])[:, order].reshape(t.shape)
        if isinstance(ref, QuantRef):  # its codes and per-row scales (QuantizedTensor) alike
            return QuantRef(lambda: ref.load().map_rows(reorder), ref.what, ref.shape)
        return WeightRef(ref.shape, ref.dtype, lambda slices: apply_slices(reorder(ref.load()), slices))
