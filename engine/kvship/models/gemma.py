"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP (models/llama.py) in Gemma's
block, which normalizes the outputs of both before adding them to the residual (four norms a
layer), scales the embeddings by sqrt(hidden_size), multiplies by (1 + w) in its norms, runs
GELU-tanh in the MLP and scales queries by query_pre_attn_scalar ** -0.5.

Local (sliding-window) and global layers alternate: Gemma 2 one for one, with soft-capped
attention scores and logits; Gemma 3 five local per global, with per-head q/k norms and a rope
base of their own for the local layers (rope_local_base_freq, unscaled)."""
from __future__ import annotations

import torch
from torch import nn

from kvship.layers.embedding import VocabParallelEmbedding
from kvship.layers.norm import RMSNorm
from kvship.layers.rotary import RotaryEmbedding
from kvship.models.config import ModelConfig
from kvship.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from kvship.parallel import TPContext


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + w). The 1 is added to the weight as it loads, in float32, where the
    weight stays: w.float() + 1 is the very factor transformers' Gemma norm multiplies by, so
    folding it in is exact (held in bf16, 1 + w would be rounded). Never reduces over ranks:
    Gemma's row-parallel linears sum their own outputs."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, ref, shard_id=None) -> None:
        param.data.copy_(ref.load().float() + 1.0)


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str, window: int | None):
        super().__init__(cfg, rotary, tp, backend, window, reduce=True)
        if cfg.qk_norm:  # Gemma 3: the same per-head norms as Qwen3, with Gemma's (1 + w)
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """Takes and returns the last sublayer's (normalized) output with the residual before it."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str, index: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, rotary, tp, backend, cfg.window(index))
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = LlamaMLP(cfg, tp, reduce=True)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # sqrt(hidden) rounded to the model's dtype, as transformers multiplies by it (bf16: 55.5 for 3072)
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=torch.get_default_dtype(), device="cpu"))
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        local = rotary
        if cfg.rope_local_theta is not None:
            local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, None)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, rotary if cfg.window(i) is None else local, tp, backend, i)
            for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and 3 checkpoints name their tensors as Llama's do (plus the extra norms), so
    LlamaForCausalLM's loader places them; the norms' loaders add Gemma's 1."""

    backbone = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
