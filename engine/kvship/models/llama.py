"""Llama family (Llama 2/3/3.1, Mistral, SmolLM2, Phi-3/Phi-4): pre-norm decoder, GQA, SiLU MLP.
Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm) differ only in switches of ModelConfig, and
so do their mixture-of-experts variants and Mixtral: the feed-forward of the layers
ModelConfig.is_sparse names is a routed set of experts (SparseMoeBlock)."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata, PagedAttention, QKNorm
from kvship.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvship.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from kvship.layers.moe import MoEExperts, route
from kvship.layers.norm import RMSNorm
from kvship.layers.rotary import RotaryEmbedding
from kvship.loader.source import RowView
from kvship.models.config import ModelConfig
from kvship.parallel import TPContext
from kvship.quant import QuantRef


class LlamaAttention(nn.Module):
    """``window``: this layer's sliding window (ModelConfig.window). ``reduce``: o_proj sums its
    output over ranks itself (Gemma normalizes it before the residual add); otherwise it returns
    partial sums for the post-attention norm to reduce."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str,
                 window: int | None = None, reduce: bool = False):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias, tp,
            quant=cfg.quantization,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # partial sums: the post-attention norm reduces them (fused with its residual add at TP=2)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, tp,
                                        reduce=reduce, quant=cfg.quantization)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, rotary, backend,
                                   cfg.attention_scale, window, cfg.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # the per-head norms run inside the rotary + KV-store kernel (one launch instead of three)
        qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        out = self.attn(positions, q, k, v, meta, qk_norm)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    """The gated MLP (cfg.hidden_act: SiLU, or Gemma's GELU-tanh). ``reduce`` as LlamaAttention's."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, intermediate_size: int | None = None, reduce: bool = False):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, False, tp,
                                                       quant=cfg.quantization)
        # partial sums: the next layer's input norm (or the final norm) reduces them
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, gated_input=True, reduce=reduce,
                                          quant=cfg.quantization, act=cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation-and-mul: in the gate/up GEMV's epilogue (quantized, one row), else in down_proj
        return self.down_proj(self.gate_up_proj(x, self.down_proj.act))


class SparseMoeBlock(nn.Module):
    """The routed feed-forward: a replicated router, the experts (partial sums per rank, like
    LlamaMLP), and for Qwen2-MoE a shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: ModelConfig, tp: TPContext):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = MoEExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp,
                                  quant=cfg.quantization)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, tp, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        shared = None  # the shared expert first: the experts' kernel adds it into their own output
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids, add=shared)


class LlamaDecoderLayer(nn.Module):
    """Takes and returns the MLP's partial sums (x) with the residual: the norms reduce over ranks.
    A family with an attention or routed block of its own (models/deepseek_v2.py) names them in
    a subclass."""

    attention = LlamaAttention
    sparse_mlp = SparseMoeBlock

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TPContext, backend: str, index: int = 0):
        super().__init__()
        # reduction sites in forward order: 2i (this input norm, from layer 1 on), 2i + 1, ..., 2L (final norm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index)
        self.self_attn = self.attention(cfg, rotary, tp, backend, cfg.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index + 1)
        self.mlp = self.sparse_mlp(cfg, tp) if cfg.is_sparse(index) else LlamaMLP(cfg, tp)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    layer = LlamaDecoderLayer
    final_norm = RMSNorm  # a family whose norms multiply by (1 + w) names its own (models/qwen3_next.py)

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = self.rotary(cfg, max_positions)
        self.layers = nn.ModuleList(self.layer(cfg, rotary, tp, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = self.final_norm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * cfg.num_hidden_layers)

    @staticmethod
    def rotary(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The table every layer shares (a family that rotates part of each head builds its own)."""
        return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    backbone = LlamaModel  # the decoder stack a family builds (models/gemma.py has its own)
    cuda_graphs = True  # decode steps may be captured (every layer's kernels are capturable)
    optional_weights: tuple[str, ...] = ()  # parameter prefixes a checkpoint may leave out (GLM's MTP layers)
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
        self.model = self.backbone(cfg, max_positions, tp, backend)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, cfg.quantization)
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
                if isinstance(ref, QuantRef) and need_lm_head:  # the tied matrix in its blocks (a GGUF token embedding)
                    self.lm_head.load_quantized_copy(ref)
                continue
            kv_scale = _KV_SCALE.search(name)
            if kv_scale is not None:  # an FP8 checkpoint's per-layer KV-cache scale
                attn = self.model.layers[int(kv_scale.group(1))].self_attn.attn
                attn.load_kv_scale(kv_scale.group(2), ref.load())
                continue
            if self.cfg.architecture == "phi3" and name.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")):
                self._load_fused(params, name, ref)
                loaded.add(name)
                continue
            name, shard_id = _expert_name(name)
            for ckpt, (ours, sid) in self.packed.items() if shard_id is None else ():
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
        missing = {m for m in missing if not m.startswith(self.optional_weights)}
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


    def _load_fused(self, params: dict, name: str, ref) -> None:
        """Phi-3 stores q, k and v (and gate and up) as one matrix: each part goes to the loader
        as a row view, as if the checkpoint held it alone."""
        c = self.cfg
        if name.endswith("qkv_proj.weight"):
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            parts = (("q", 0, q), ("k", q, kv), ("v", q + kv, kv))
        else:
            parts = ((0, 0, c.intermediate_size), (1, c.intermediate_size, c.intermediate_size))
        param = params[name]
        for shard_id, start, size in parts:
            param.weight_loader(param, RowView(ref, start, size), shard_id)


# vLLM and compressed-tensors write an FP8 KV cache's scales as "layers.N.self_attn.k_scale"
# (older files: "...self_attn.attn.k_scale" or "...k_proj.output_scale" is not read).
_KV_SCALE = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale)$")

# An expert's matrices in a checkpoint: Qwen-MoE "mlp.experts.E.gate_proj", Mixtral
# "block_sparse_moe.experts.E.w1" (w1 gate, w3 up, w2 down).
_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": None, "w2": None}


def _expert_name(name: str) -> tuple[str, tuple[int, int | None] | None]:
    """(our parameter name, MoEExperts shard id) of an expert's matrix; other names pass as
    they are (Mixtral's router and block renamed to ours)."""
    m = _EXPERT.search(name)
    if m is None:
        return name.replace(".block_sparse_moe.", ".mlp."), None
    part = _EXPERT_PART[m.group(2)]
    ours = "w2" if part is None else "w13"
    return name[:m.start()] + f".mlp.experts.{ours}", (int(m.group(1)), part)
