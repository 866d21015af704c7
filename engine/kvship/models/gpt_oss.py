"""gpt-oss (GptOssForCausalLM: gpt-oss-20b and -120b): Llama's pre-norm block (models/llama.py)
with every feed-forward routed to experts, and

- attention: biases on q, k, v and o; a learned sink per head (a logit in each softmax's
  denominator that attends to nothing: layers/attention.py, kernels/paged_attention.py); layers
  alternating between a sliding window (ModelConfig.layer_windows, from layer_types) and the
  whole context; YaRN rotary (layers/rotary.py);
- the router: a biased linear, the top k of its logits, softmax over them (the same weights as a
  softmax over all experts renormalized over the chosen);
- the experts: biases, a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate)), 16-bit or
  MXFP4 as OpenAI ships them (layers/gpt_oss_moe.py, kernels/gpt_oss_moe.py).

Tensor parallelism shards heads (and their sinks) and the experts' intermediate dimension; the
row-parallel outputs are partial sums, so o_proj's bias and the experts' down bias are added by
rank 0 only. The chat format (harmony) is parsed by server/harmony.py."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata, PagedAttention
from kvship.layers.gpt_oss_moe import GptOssMoEExperts
from kvship.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from kvship.layers.moe import route
from kvship.layers.rotary import RotaryEmbedding
from kvship.models.config import ModelConfig
from kvship.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvship.parallel import TPContext


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str,
                 window: int | None = None):
        super().__init__()
        self.tp, self.head_dim = tp, cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, True, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # partial sums for the post-attention norm to reduce, as LlamaAttention's; the bias beside it
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, tp,
                                        reduce=False)
        # in the model's dtype, as o_proj's output: no conversion kernel before its add each step
        self.o_bias = self._param(cfg.hidden_size, self._load_o_bias, torch.get_default_dtype())
        self.sinks = self._param(self.num_heads, self._load_sinks)  # float32: they join float32 sums
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, rotary, backend,
                                   cfg.head_dim ** -0.5, window)

    @staticmethod
    def _param(size: int, loader, dtype: torch.dtype = torch.float32) -> nn.Parameter:
        p = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        p.weight_loader = loader
        return p

    def _load_sinks(self, param: nn.Parameter, ref, shard_id=None) -> None:
        start = self.tp.rank * self.num_heads
        param.data.copy_(ref.load()[start:start + self.num_heads])

    def _load_o_bias(self, param: nn.Parameter, ref, shard_id=None) -> None:
        param.data.copy_(ref.load() if self.tp.rank == 0 else torch.zeros(param.shape))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        out = self.attn(positions, q.view(-1, self.num_heads, self.head_dim),
                        k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim),
                        meta, sinks=self.sinks)
        return self.o_proj(out.flatten(1)) + self.o_bias


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssMoEExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp,
                                        cfg.expert_format == "mxfp4", limit=cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, True)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention = GptOssAttention
    sparse_mlp = GptOssMoE


class GptOssModel(LlamaModel):
    layer = GptOssDecoderLayer


_EXPERTS = re.compile(r"\.mlp\.experts\.(\w+)$")


def _our_name(name: str) -> str:
    """A checkpoint tensor's name as this model's parameter (the rest as Llama's loader reads them)."""
    m = _EXPERTS.search(name)
    if m is not None and m.group(1) in GptOssMoEExperts.CHECKPOINT:
        return name[:m.start(1)] + GptOssMoEExperts.CHECKPOINT[m.group(1)]
    return name.replace(".self_attn.o_proj.bias", ".self_attn.o_bias")


class GptOssForCausalLM(LlamaForCausalLM):
    backbone = GptOssModel
    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        if cfg.quantization is not None:
            raise ValueError(f"gpt-oss is served as its checkpoint stores it (experts in MXFP4 or 16 bits, the rest "
                             f"in 16 bits); {cfg.quantization.describe()} is not supported for it")
        super().__init__(cfg, max_positions, tp, backend)

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        super().load_weights(((_our_name(name), ref) for name, ref in weights), need_lm_head)
