"""Llama family (Llama 2/3/3.1, Mistral, SmolLM2): pre-norm decoder, GQA, SiLU MLP.
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm) differ only in switches of ModelConfig."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata, PagedAttention
from kvship.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvship.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvship.layers.norm import RMSNorm
from kvship.layers.rotary import RotaryEmbedding
from kvship.models.config import ModelConfig
from kvship.parallel import TPContext


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # partial sums: the post-attention norm reduces them (fused with its residual add at TP=2)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, tp,
                                        reduce=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, rotary, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(positions, q, k, v, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp)
        # partial sums: the next layer's input norm (or the final norm) reduces them
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, gated_input=True,
                                           reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # SiLU-and-mul happens in down_proj


class LlamaDecoderLayer(nn.Module):
    """Takes and returns the MLP's partial sums (x) with the residual: the norms reduce over ranks."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str, index: int = 0):
        super().__init__()
        # reduction sites in forward order: 2i (this input norm, from layer 1 on), 2i + 1, ..., 2L (final norm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index)
        self.self_attn = LlamaAttention(cfg, rotary, tp, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index + 1)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, tp, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * cfg.num_hidden_layers)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    packed = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, max_positions, tp, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        """``need_lm_head=False``: the checkpoint may lack the output projection (an embedding
        model, which never computes logits)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, ref in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if not name.startswith(("model.", "lm_head.")):  # a base model's checkpoint (e.g. Qwen3Model,
                name = "model." + name  # as embedding models are saved): same tensors, no "model." prefix
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            shard_id = None
            for ckpt, (ours, sid) in self.packed.items():
                if f".{ckpt}." in name:
                    name, shard_id = name.replace(ckpt, ours), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(ref.load())
            else:
                loader(param, ref, shard_id)
            loaded.add(name)
        missing = set(params) - loaded - ({"lm_head.weight"} if self.cfg.tie_word_embeddings or not need_lm_head else set())
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
