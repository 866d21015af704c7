"""MiniMax-M2 (MiniMaxM2ForCausalLM): Llama's pre-norm block with GQA whose q and k are RMS-normed
over all heads at once (q_norm [heads x head_dim], k_norm [kv heads x head_dim]) before rotary on
the first rotary_dim channels of each head (models/glm4_moe.py's reordering for PartialRotary),
and on every layer experts routed by sigmoid scores plus a correction bias, top-k renormalized,
without a shared expert (models/deepseek_v2.py's DeepseekV2MoE, one group).

The checkpoint names its feed-forward as Mixtral does (block_sparse_moe, experts' w1/w3/w2), the
router's bias beside the router (block_sparse_moe.e_score_correction_bias).

Tensor parallelism is refused: the q/k norms span every head, which ranks would have to sum
over. Multi-token-prediction modules, where a checkpoint stores them, are skipped."""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from kvship.layers.attention import AttentionMetadata
from kvship.layers.norm import RMSNorm
from kvship.models.config import ModelConfig, UnsupportedModelError
from kvship.models.glm4_moe import Glm4MoeAttention, Glm4MoeDecoderLayer, Glm4MoeModel
from kvship.models.llama import LlamaForCausalLM
from kvship.parallel import TPContext

log = logging.getLogger(__name__)


class MiniMaxM2Attention(Glm4MoeAttention):
    def __init__(self, cfg: ModelConfig, rotary, tp: TPContext, backend: str, window: int | None = None,
                 reduce: bool = False):
        if tp.size > 1:
            raise UnsupportedModelError("MiniMax-M2 with tensor parallelism is not supported (its q/k norms span "
                                        "every head)")
        super().__init__(cfg, rotary, tp, backend, window, reduce)
        d = cfg.head_dim
        self.q_norm = RMSNorm(cfg.num_attention_heads * d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_key_value_heads * d, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = self.q_norm(q.contiguous()).view(-1, hq, d).index_select(-1, self.order)
        k = self.k_norm(k.contiguous()).view(-1, hkv, d).index_select(-1, self.order)
        out = self.attn(positions, q, k, v.view(-1, hkv, d), meta)
        return self.o_proj(out.flatten(1))


class MiniMaxM2DecoderLayer(Glm4MoeDecoderLayer):
    attention = MiniMaxM2Attention


class MiniMaxM2Model(Glm4MoeModel):
    layer = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    backbone = MiniMaxM2Model

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        skipped = []

        def renamed(weights):
            for name, ref in weights:
                if name.startswith(("mtp.", "model.mtp.")):
                    skipped.append(name)
                    continue
                yield name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"), ref
        super().load_weights(renamed(weights), need_lm_head)
        if skipped:
            log.info("MiniMax-M2: %d multi-token-prediction tensors skipped (not run)", len(skipped))
