"""Llama 4 text (Llama4ForCausalLM; the language model of Llama4ForConditionalGeneration, whose
vision tower is skipped): Llama's pre-norm block with

- rotary layers and position-free (NoPE) ones (no_rope_layers). A rotary layer attends within
  its chunk only (attention_chunk_size: a query at p sees keys from p - p % chunk), its q and k
  RMS-normed without a weight (use_qk_norm; transformers norms after rotary, which preserves
  the norm, so the kernel's before-rotary norm gives the same). A NoPE layer sees the whole
  context, its queries scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
  (attn_temperature_tuning).
- rotary on adjacent channel pairs (2i, 2i + 1), as transformers' complex product: q and k enter
  with their channels reordered (even ones, then odd ones), the kernels' halves layout.
- routed layers (moe_layers) with a top-1 expert whose sigmoid score multiplies the expert's
  input, beside an ungated shared expert; the other layers a dense MLP (intermediate_size_mlp).

Checkpoints store the feed-forward as ``feed_forward`` and the experts fused, gate_up_proj
[E, H, 2I] and down_proj [E, I, H] (x @ W): each expert's matrices are handed to MoEExperts'
loader transposed, one expert read at a time. Per-expert checkpoints (experts.E.gate_proj)
load as other MoE families'.

Chunked attention is masked by the paged attention kernels (CUDA graphs included), and only
where a context can outgrow a chunk (max_model_len > attention_chunk_size); below that it is
plain causal attention."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata, QKNorm
from kvship.layers.linear import ReplicatedLinear
from kvship.layers.moe import MoEExperts
from kvship.layers.norm import RMSNorm
from kvship.layers.rotary import NoRotary, RotaryEmbedding
from kvship.loader.source import WeightRef, apply_slices
from kvship.models.config import ModelConfig
from kvship.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from kvship.parallel import TPContext
from kvship.quant import QuantRef

_SKIPPED = ("vision_model.", "multi_modal_projector.")  # Llama4ForConditionalGeneration's vision side


class Llama4Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, rotary, tp: TPContext, backend: str, index: int, chunk: int | None):
        super().__init__(cfg, rotary, tp, backend)
        spec = cfg.llama4
        self.use_rope = index in spec.rope_layers
        if self.use_rope:
            d = cfg.head_dim
            self.register_buffer("order", torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]), persistent=False)
            self.attn.chunk = chunk
        self.l2_norm = self.use_rope and spec.l2_qk_norm
        if self.l2_norm:  # RMSNorm without a weight: the kernel's norm with ones
            self.register_buffer("unit", torch.ones(cfg.head_dim), persistent=False)
        self.eps = cfg.rms_norm_eps
        self.temperature = None if self.use_rope else spec.temperature

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        norm = None
        if self.use_rope:
            q, k = q.index_select(-1, self.order), k.index_select(-1, self.order)
            if self.l2_norm:
                norm = QKNorm(self.unit, self.unit, self.eps)
        elif self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        out = self.attn(positions, q, k, v, meta, norm)
        return self.o_proj(out.flatten(1))


class Llama4MoE(nn.Module):
    """Top-1 routing: the chosen expert runs on x * sigmoid(its logit); the shared expert on x."""

    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = MoEExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp,
                                  quant=cfg.quantization)
        self.shared_expert = LlamaMLP(cfg, tp, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.gate(x).max(dim=-1, keepdim=True)
        scaled = x * torch.sigmoid(top.float()).to(x.dtype)
        ones = torch.ones_like(top, dtype=torch.float32)
        return self.experts(scaled, ones, ids, add=self.shared_expert(x))


class Llama4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, rotary: tuple[RotaryEmbedding, NoRotary, int | None], tp: TPContext,
                 backend: str, index: int = 0):
        nn.Module.__init__(self)
        rope, nope, chunk = rotary
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index)
        uses_rope = index in cfg.llama4.rope_layers
        self.self_attn = Llama4Attention(cfg, rope if uses_rope else nope, tp, backend, index, chunk)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index + 1)
        self.mlp = Llama4MoE(cfg, tp) if cfg.is_sparse(index) else \
            LlamaMLP(cfg, tp, cfg.llama4.dense_intermediate_size)


class Llama4Model(LlamaModel):
    layer = Llama4DecoderLayer

    @staticmethod
    def rotary(cfg: ModelConfig, max_positions: int):
        """(the rotary layers' table, the NoPE layers' identity, the chunk where a context can pass one)"""
        chunk = cfg.llama4.chunk if cfg.llama4.chunk and max_positions > cfg.llama4.chunk else None
        return (LlamaModel.rotary(cfg, max_positions), NoRotary(cfg.head_dim, max_positions), chunk)


class Llama4ForCausalLM(LlamaForCausalLM):
    backbone = Llama4Model

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        super().load_weights(self._renamed(weights), need_lm_head)

    def _renamed(self, weights):
        """Checkpoint names to the Llama block's, fused experts split per expert (module docstring)."""
        for name, ref in weights:
            if name.startswith(_SKIPPED):
                continue
            name = name.removeprefix("language_model.").replace(".feed_forward.", ".mlp.")
            name = name.replace(".mlp.router.", ".mlp.gate.")
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                yield from _split_experts(name, ref, self.cfg.moe_intermediate_size)
            else:
                yield name, ref


def _split_experts(name: str, ref, inter: int):
    """A fused [E, H, 2I] gate_up_proj (or [E, I, H] down_proj) as per-expert [I, H] gate and up
    ([H, I] down) matrices, each reading its expert's slice only."""
    if isinstance(ref, QuantRef):
        raise ValueError(f"{name}: quantized fused experts are not supported (per-expert checkpoints are)")
    base = name.rsplit(".", 1)[0]
    parts = (("gate_proj", 0), ("up_proj", 1)) if name.endswith("gate_up_proj") else (("down_proj", None),)
    for e in range(ref.shape[0]):
        for part, half in parts:
            def matrix(slices, e=e, half=half):
                t = ref.load((slice(e, e + 1),))[0]
                t = t if half is None else t[:, half * inter:(half + 1) * inter]
                return apply_slices(t.t().contiguous(), slices)
            shape = (ref.shape[2], ref.shape[1]) if half is None else (inter, ref.shape[1])
            yield f"{base}.{e}.{part}.weight", WeightRef(shape, ref.dtype, matrix)

