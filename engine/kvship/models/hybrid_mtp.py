"""The multi-token-prediction (MTP) layers of Qwen3-Next / Qwen3.5 checkpoints (``mtp.*``): the
next token's embedding and the model's last hidden state, each RMS-normed, joined by ``fc``
([hidden, 2 x hidden]), then full-attention decoder layers with the model's feed-forward and a
final norm; the embedding and the LM head are the model's. They draft tokens for speculative
decoding. Loaded and kept on the model (HybridModel.mtp) so that speculative decoding can drive
them; generation does not run them yet."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kvship.layers.linear import ReplicatedLinear
from kvship.quant import QuantizedTensor


class HybridMTP(nn.Module):
    """``layer(i)``: MTP decoder layer i (full attention); ``norm()``: the family's RMSNorm.
    fc is held whole on every rank: it is small beside the layers, and not run yet."""

    def __init__(self, hidden_size: int, num_layers: int, layer: Callable[[int], nn.Module],
                 norm: Callable[[], nn.Module]):
        super().__init__()
        self.fc = ReplicatedLinear(2 * hidden_size, hidden_size, bias=False)
        self.fc.weight.weight_loader = _dense
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.layers = nn.ModuleList(layer(i) for i in range(num_layers))
        self.norm = norm()


def _dense(param, ref, shard_id=None) -> None:
    """fc in the model's dtype, whatever the checkpoint stores (an FP8 checkpoint's blocks)."""
    w = ref.load()
    param.data.copy_(w.dequantize(param.dtype) if isinstance(w, QuantizedTensor) else w)
