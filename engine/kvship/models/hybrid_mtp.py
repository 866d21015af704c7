"""The multi-token-prediction (MTP) layers of Qwen3-Next / Qwen3.5 checkpoints (``mtp.*``): the
next token's embedding and the model's last hidden state, each RMS-normed, joined by ``fc``
([hidden, 2 x hidden]), then full-attention decoder layers with the model's feed-forward and a
final norm; the embedding and the LM head are the model's. They draft tokens for speculative
decoding (``{"method": "mtp"}``, core/mtp.py drives ``predict``): at position t the model's
hidden state of t and the embedding of token t + 1 score token t + 2."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata
from kvship.layers.linear import ReplicatedLinear
from kvship.quant import QuantizedTensor


class HybridMTP(nn.Module):
    """``layer(i)``: MTP decoder layer i (full attention); ``norm()``: the family's RMSNorm.
    fc is held whole on every rank: it is small beside the layers."""

    def __init__(self, hidden_size: int, num_layers: int, layer: Callable[[int], nn.Module],
                 norm: Callable[[], nn.Module]):
        super().__init__()
        self.fc = ReplicatedLinear(2 * hidden_size, hidden_size, bias=False)
        self.fc.weight.weight_loader = _dense
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.layers = nn.ModuleList(layer(i) for i in range(num_layers))
        self.norm = norm()

    def predict(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The first layer's output, final-normed, a row per position: the LM head's input, and
        the hidden state the next guess takes in place of the model's (as vLLM drafts; the
        checkpoints hold one layer)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None, meta)
        return self.norm(x, residual)[0]

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # normed by predict

    def drafting_attention(self):
        """The attention layer whose paged KV the drafter binds."""
        return self.layers[0].self_attn.attn


def _dense(param, ref, shard_id=None) -> None:
    """fc in the model's dtype, whatever the checkpoint stores (an FP8 checkpoint's blocks)."""
    w = ref.load()
    param.data.copy_(w.dequantize(param.dtype) if isinstance(w, QuantizedTensor) else w)
