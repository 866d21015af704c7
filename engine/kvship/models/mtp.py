"""DeepSeek-V3's multi-token-prediction (MTP) layer, as GLM-4.5 stores it too: a decoder layer
stored past num_hidden_layers, with the next token's embedding and a hidden state of the model,
each RMS-normed (enorm, hnorm), joined by eh_proj, before it; its output goes through
shared_head's norm to the model's LM head. At position t it takes the hidden state of t and the
embedding of token t + 1, and scores token t + 2 (core/mtp.py drives it for speculative decoding).

The checkpoint's copies of the embedding and the output head in each MTP layer
(``embed_tokens``, ``shared_head.head``) equal the model's own and are not kept."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata
from kvship.layers.linear import ColumnParallelLinear
from kvship.layers.norm import RMSNorm
from kvship.models.config import ModelConfig
from kvship.parallel import SINGLE

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPIES = ("embed_tokens.", "shared_head.head.")


class NextTokenLayer(nn.Module):
    """Mixed into a family's decoder layer: ``add_nextn_parts`` in __init__, then ``predict``."""

    def add_nextn_parts(self, cfg: ModelConfig) -> None:
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, False, SINGLE, cfg.quantization)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def predict(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output hidden states (before shared_head's norm), a row per position."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self(positions, x, None, meta)
        return x + residual

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(hidden)

    def drafting_attention(self):
        """The attention layer whose paged KV the drafter binds."""
        return self.self_attn.attn


def next_token_layers(layer_cls: type, cfg: ModelConfig, rotary, tp, backend: str) -> nn.ModuleList:
    """cfg.mtp_layers layers of ``layer_cls`` (a decoder layer mixed with NextTokenLayer), numbered
    after the model's own layers."""
    layers = nn.ModuleList(layer_cls(cfg, rotary, tp, backend, cfg.num_hidden_layers + i)
                           for i in range(cfg.mtp_layers))
    for layer in layers:
        layer.add_nextn_parts(cfg)
    return layers


def nextn_renamed(weights: Iterable[tuple[str, object]], cfg: ModelConfig, seen: set[int]):
    """The checkpoint's tensors with layers past num_hidden_layers renamed to ``model.mtp.{i}``
    (their indices collected in ``seen``) and their embedding and head copies left out, as are
    layers past the cfg.mtp_layers the config names (a model built without them)."""
    num_hidden_layers = cfg.num_hidden_layers
    for name, ref in weights:
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) < num_hidden_layers:
            yield name, ref
            continue
        rest = name[m.end():]
        if rest.startswith(_COPIES) or int(m.group(1)) >= num_hidden_layers + cfg.mtp_layers:
            continue
        seen.add(int(m.group(1)))
        yield f"model.mtp.{int(m.group(1)) - num_hidden_layers}.{rest}", ref
