"""GLM-4.5, 4.6 and 4.7 (Glm4MoeForCausalLM): Llama's pre-norm block with grouped-query attention
(q/k/v biases, per-head q/k RMSNorm when use_qk_norm) on heads of which only the first
rotary_dim channels rotate, and DeepSeek-V3's feed-forward: dense on the first
first_k_dense_replace layers, then experts routed by sigmoid scores with a correction bias in
groups, beside an ungated shared expert (models/deepseek_v2.py's DeepseekV2MoE).

Partial rotary: layers/rotary.py's PartialRotary; q and k enter attention with their channels
reordered so the kernels' whole-head rotation turns only the rotary ones.

Multi-token prediction: the checkpoint's layers past num_hidden_layers (num_nextn_predict_layers)
are loaded into ``mtp`` (models/mtp.py) for speculative decoding (``{"method": "mtp"}``)."""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata, QKNorm
from kvship.layers.rotary import PartialRotary
from kvship.models.config import ModelConfig
from kvship.models.deepseek_v2 import DeepseekV2MoE
from kvship.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvship.models.mtp import NextTokenLayer, next_token_layers, nextn_renamed
from kvship.parallel import TPContext

log = logging.getLogger(__name__)

class Glm4MoeAttention(LlamaAttention):
    """LlamaAttention whose q and k channels are reordered for PartialRotary (v is not)."""

    def __init__(self, cfg: ModelConfig, rotary: PartialRotary, tp: TPContext, backend: str,
                 window: int | None = None, reduce: bool = False):
        super().__init__(cfg, rotary, tp, backend, window, reduce)
        self.order = rotary.order

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(-1, hq, d).index_select(-1, self.order)
        k = k.view(-1, hkv, d).index_select(-1, self.order)
        norm = None
        if self.qk_norm:  # per-head norms are order-blind but for their weights
            norm = QKNorm(self.q_norm.weight[self.order], self.k_norm.weight[self.order], self.q_norm.eps)
        out = self.attn(positions, q, k, v.view(-1, hkv, d), meta, norm)
        return self.o_proj(out.flatten(1))


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention = Glm4MoeAttention
    sparse_mlp = DeepseekV2MoE


class Glm4MoeMTPLayer(Glm4MoeDecoderLayer, NextTokenLayer):
    """A multi-token-prediction layer (models/mtp.py)."""


class Glm4MoeModel(LlamaModel):
    layer = Glm4MoeDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__(cfg, max_positions, tp, backend)
        rotary = self.layers[0].self_attn.attn.rotary
        self.mtp = next_token_layers(Glm4MoeMTPLayer, cfg, rotary, tp, backend)

    @staticmethod
    def rotary(cfg: ModelConfig, max_positions: int) -> PartialRotary:
        return PartialRotary(cfg.head_dim, cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    backbone = Glm4MoeModel
    optional_weights = ("model.mtp.",)  # a checkpoint saved without them (as transformers saves one)

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        """Layers past num_hidden_layers go to ``mtp`` (module docstring), those the config names."""
        seen: set[int] = set()
        super().load_weights(nextn_renamed(weights, self.cfg, seen), need_lm_head)
        if not seen:
            self.model.mtp = nn.ModuleList()  # nothing to keep
        else:
            log.info("GLM-4 MoE: %d multi-token-prediction layer(s) loaded", len(seen))
