"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: one family of hybrid decoders. Most layers mix tokens
with Gated DeltaNet (layers/gated_delta.py: a recurrent state per sequence, no KV cache); every
few (ModelConfig.linear_attention.full_attention_layers) run gated attention over the paged KV
cache: q/k RMSNorm per head, rotary on part of each head, and the output times sigmoid(gate),
the gate coming from q_proj beside the query. Norms multiply by (1 + w), folded at load.
The feed-forward is the gated MLP, or routed experts with a shared expert (llama.py's blocks).

Qwen3-Next stores its DeltaNet projections grouped per key head (in_proj_qkvz, in_proj_ba);
they are reordered at load into Qwen3.5's layout (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
A ...ForConditionalGeneration checkpoint is read for its language model: the vision tower is
skipped (a log line). The multi-token-prediction layers the config announces are loaded into
HybridModel.mtp (models/hybrid_mtp.py): they draft for ``{"method": "mtp"}`` speculative decoding."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvship.layers.attention import AttentionMetadata, PagedAttention, QKNorm
from kvship.layers.gated_delta import GatedDeltaNet
from kvship.layers.linear import QKVParallelLinear, RowParallelLinear
from kvship.layers.norm import RMSNorm
from kvship.layers.rotary import PartialRotary
from kvship.loader.source import RowView, apply_slices
from kvship.models.config import ModelConfig
from kvship.models.hybrid_mtp import HybridMTP
from kvship.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, SparseMoeBlock
from kvship.parallel import TPContext
from kvship.quant import QuantizedTensor

log = logging.getLogger(__name__)


class OnePlusRMSNorm(RMSNorm):
    """RMSNorm times (1 + w): the 1 added as the weight loads, in float32 where it stays (exact,
    as models/gemma.py's)."""

    def __init__(self, dim: int, eps: float, tp: TPContext | None = None, site: int = 0):
        super().__init__(dim, eps, tp, site)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, ref, shard_id=None) -> None:
        param.data.copy_(ref.load().float() + 1.0)


class GatedAttention(nn.Module):
    """q_proj yields each head's query and gate side by side ([q_h, gate_h]): held as 2 x heads
    "heads" of the fused qkv projection."""

    def __init__(self, cfg: ModelConfig, rotary: PartialRotary, tp: TPContext, backend: str):
        super().__init__()
        d = self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.attention_bias, tp, quant=cfg.quantization)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, False, tp, reduce=False,
                                        quant=cfg.quantization)
        self.q_norm = OnePlusRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = OnePlusRMSNorm(d, cfg.rms_norm_eps)
        self.order = rotary.order
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, rotary, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        qg, k, v = self.qkv_proj(x).split([2 * hq * d, hkv * d, hkv * d], dim=-1)
        qg = qg.view(-1, hq, 2, d)
        q, gate = qg[:, :, 0].index_select(-1, self.order), qg[:, :, 1]
        k = k.view(-1, hkv, d).index_select(-1, self.order)
        norm = QKNorm(self.q_norm.weight[self.order], self.k_norm.weight[self.order], self.q_norm.eps)
        out = self.attn(positions, q, k, v.view(-1, hkv, d), meta, norm)
        return self.o_proj((out * torch.sigmoid(gate)).flatten(1))


class HybridDecoderLayer(nn.Module):
    """``mtp``: a multi-token-prediction layer (full attention, routed when the model routes)."""

    def __init__(self, cfg: ModelConfig, rotary: PartialRotary, tp: TPContext, backend: str, index: int,
                 mtp: bool = False):
        super().__init__()
        self.linear = not mtp and cfg.linear_attention.is_linear(index)
        self.input_layernorm = OnePlusRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, tp, backend)
        else:
            self.self_attn = GatedAttention(cfg, rotary, tp, backend)
        self.post_attention_layernorm = OnePlusRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp, site=2 * index + 1)
        sparse = cfg.num_experts > 0 if mtp else cfg.is_sparse(index)
        self.mlp = SparseMoeBlock(cfg, tp) if sparse else LlamaMLP(cfg, tp)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.linear else self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class HybridModel(LlamaModel):
    """Llama's stack of this family's layers, (1 + w) final norm and partial rotary, with the
    checkpoint's MTP layers kept beside it (``mtp``, run only to draft)."""

    layer = HybridDecoderLayer
    final_norm = OnePlusRMSNorm

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPContext, backend: str):
        super().__init__(cfg, max_positions, tp, backend)
        self.mtp = None
        if cfg.mtp_layers:  # they share the attention layers' rotary table
            rotary = next(layer.self_attn.attn.rotary for layer in self.layers if not layer.linear)
            self.mtp = HybridMTP(cfg.hidden_size, cfg.mtp_layers,
                                 lambda i: HybridDecoderLayer(cfg, rotary, tp, backend, i, mtp=True),
                                 lambda: OnePlusRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    @staticmethod
    def rotary(cfg: ModelConfig, max_positions: int) -> PartialRotary:
        return PartialRotary(cfg.head_dim, cfg.linear_attention.rotary_dim, max_positions, cfg.rope_theta,
                             cfg.rope_scaling)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    backbone = HybridModel
    cuda_graphs = True  # decode steps read no host values (the state slots are a graph input)
    packed = {
        **LlamaForCausalLM.packed,
        **{f"in_proj_{p}": ("in_proj", i) for i, p in enumerate(GatedDeltaNet.PARTS)},
    }

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The layers holding a recurrent state per sequence (a slot each, bind_state)."""
        return [layer.linear_attn for layer in self.model.layers if layer.linear]

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(torch.Size(shape).numel() * d.itemsize
                   for layer in self.state_layers() for shape, d in layer.state_shapes(dtype))

    def bind_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        for layer in self.state_layers():
            layer.bind_state(num_slots, dtype, device)

    def copy_state_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's state rows ``src`` into rows ``dst`` (prefix-cache checkpoints)."""
        for layer in self.state_layers():
            for state in (layer.conv_state, layer.delta_state):
                state[dst] = state[src]

    optional_weights = ("model.mtp.",)  # a checkpoint saved without them (as transformers saves one)

    def load_weights(self, weights: Iterable[tuple[str, object]], need_lm_head: bool = True) -> None:
        super().load_weights(self._renamed(weights), need_lm_head)
        if self.model.mtp is not None and not self._mtp_loaded:
            self.model.mtp = None  # announced by the config, absent from the checkpoint: nothing to keep

    def _renamed(self, weights) -> Iterator[tuple[str, object]]:
        """The checkpoint's tensors under the names (and in the layouts) LlamaForCausalLM's
        loader places: language model prefix dropped, DeltaNet projections split into in_proj's
        parts, fused experts split per expert, (1 + w) norms marked by their loaders."""
        skipped: dict[str, int] = {}
        mtp = 0
        for name, ref in weights:
            is_mtp = name.startswith(("mtp.", "model.mtp."))
            if is_mtp and self.model.mtp is not None:  # load_weights puts "model." before "mtp."
                mtp += 1
            elif is_mtp or name.startswith(("model.visual.", "visual.")):
                part = "multi-token-prediction" if is_mtp else "vision"
                skipped[part] = skipped.get(part, 0) + 1
                continue
            name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
            if name.startswith("language_model."):
                name = name[len("language_model."):]
            yield from self._split(name, ref)
        for part, n in skipped.items():
            log.info("skipped the checkpoint's %s weights (%d tensors): not served", part, n)
        self._mtp_loaded = mtp > 0
        if mtp:
            log.info("loaded the checkpoint's multi-token-prediction layers (%d tensors) into model.mtp: they "
                     "draft with --speculative-config '{\"method\": \"mtp\", ...}'", mtp)

    def _split(self, name: str, ref) -> Iterator[tuple[str, object]]:
        la = self.cfg.linear_attention
        if name.endswith("linear_attn.in_proj_qkv.weight"):
            k, v = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
            for part, start, size in (("q", 0, k), ("k", k, k), ("v", 2 * k, v)):
                yield name.replace("in_proj_qkv", f"in_proj_{part}"), RowView(ref, start, size)
        elif name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
            w = ref.load()
            if isinstance(w, QuantizedTensor):  # per-key-head groups need not align with quantized blocks
                log.info("%s: regrouped in 16 bits (dequantized)", name)
                w = w.dequantize()
            yield from self._next_parts(name, w)
        elif name.endswith("linear_attn.conv1d.weight"):
            w = ref.load()
            yield name.replace("conv1d.weight", "conv_weight"), Loaded(w.reshape(w.shape[0], -1))
        elif name.endswith("linear_attn.norm.weight"):
            yield name.replace("norm.weight", "norm_weight"), ref
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            w, prefix = ref.load(), name.rsplit(".", 1)[0]
            for e in range(w.shape[0]):
                if name.endswith("down_proj"):
                    yield f"{prefix}.{e}.down_proj.weight", Loaded(w[e])
                else:
                    gate, up = w[e].chunk(2)
                    yield f"{prefix}.{e}.gate_proj.weight", Loaded(gate)
                    yield f"{prefix}.{e}.up_proj.weight", Loaded(up)
        else:
            yield name, ref

    def _next_parts(self, name: str, w: torch.Tensor) -> Iterator[tuple[str, object]]:
        """Qwen3-Next's projections, grouped per key head ([q_g, k_g, v_g, z_g] and [b_g, a_g]
        for each key head g), as Qwen3.5's separate parts."""
        la = self.cfg.linear_attention
        r, cols = la.num_value_heads // la.num_key_heads, w.shape[-1]
        w = w.view(la.num_key_heads, -1, cols)
        if name.endswith("in_proj_qkvz.weight"):
            sizes, parts = [la.key_head_dim, la.key_head_dim, r * la.value_head_dim, r * la.value_head_dim], "qkvz"
        else:
            sizes, parts = [r, r], "ba"
        for part, piece in zip(parts, w.split(sizes, dim=1)):
            base = name.rsplit(".", 2)[0]
            yield f"{base}.in_proj_{part}.weight", Loaded(piece.reshape(-1, cols))


class Loaded:
    """A tensor already in memory, lazy-shaped like a checkpoint's (WeightRef)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t.contiguous(), tuple(t.shape), t.dtype

    def load(self, slices=None) -> torch.Tensor:
        return apply_slices(self.t, slices if slices is None or isinstance(slices, tuple) else (slices,))
