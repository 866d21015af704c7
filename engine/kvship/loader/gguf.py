"""A GGUF file (or its split shards) as an HF-shaped ModelSource: the config from its metadata,
its tokenizer, and its tensors under HF names, the linear matrices of the types kvship serves
in their blocks as QuantRefs (gguf_blocks.py), the rest dequantized at load.

Reading the file: gguf_file.py; tensor names: gguf_names.py.
"""
from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import replace
from typing import Any, Iterator

import numpy as np
import torch

from kvship.quant import QuantizedTensor, QuantRef

from .errors import ModelSourceError
from .gguf_blocks import NATIVE_TORCH, SPLITTABLE, GGMLType, split_tensor
from .gguf_file import GGUFFile, GGUFTensorInfo
from .gguf_glm import glm4moe_config
from .gguf_gpt_oss import gpt_oss_config, gpt_oss_weights
from .gguf_hybrid import HYBRID_ARCHS, HybridTensors, hybrid_config, hybrid_hf_name
from .gguf_llama4 import llama4_config
from .gguf_names import arch_layer_name, gguf_to_hf_name
from .source import ModelSource, WeightRef, apply_slices
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),  # Phi-3, Phi-3.5 and Phi-4
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # and V3's architecture: _deepseek_config
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),  # loader/gguf_gpt_oss.py
    "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe"),  # loader/gguf_glm.py
    "llama4": ("Llama4ForCausalLM", "llama4_text"),  # loader/gguf_llama4.py
    **HYBRID_ARCHS,  # Gated DeltaNet + gated attention: gguf_hybrid.py
}
# llama.cpp's converter stores Gemma's norm weights as 1 + w (its norms multiply by the weight
# alone); kvship's Gemma norms multiply by 1 + w, as transformers' do: the loader subtracts 1.
_NORM_PLUS_ONE = {"gemma2", "gemma3"}
# llama.cpp's attention scale for Gemma: 1/sqrt(head_dim), except for the 27B models (46 layers
# for Gemma 2, 62 for Gemma 3), whose query_pre_attn_scalar is hidden_size / heads; files do not
# store it, and llama.cpp decides by the model's size.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp writes Mixtral as a "llama" file whose llama.expert_count is above zero
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# architectures whose Q/K rows llama.cpp's converter permuted (to its rope layout)
_PERMUTED_ARCHS = {"llama", "mistral"}
# llama.cpp stores no norm_topk_prob: its graphs renormalize the top-k router weights for
# Qwen3-MoE (and Mixtral) and not for Qwen2-MoE, and transformers' GGUF reader assumes the same.
_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True, "qwen3next": True, "qwen35moe": True}


def shard_paths(path: str) -> list[str]:
    """All shards of a split GGUF (given any one of them), else just [path]."""
    d, base = os.path.split(path)
    m = _SHARD_RE.match(base)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [os.path.join(d, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ModelSourceError(
            f"split GGUF {base!r} needs all {count} shards next to each other; missing: "
            + ", ".join(os.path.basename(p) for p in missing))
    return paths


def gguf_model_name(path: str) -> str:
    base = os.path.basename(path)
    m = _SHARD_RE.match(base)
    stem = m["stem"] if m else base[:-5] if base.endswith(".gguf") else base
    # "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": drop a quantization suffix
    return re.sub(r"[.-](?:[IiQqFfBb][A-Za-z0-9_]*\d[A-Za-z0-9_]*)$", "", stem) or stem


def _f32(v: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def gguf_hf_config(meta: dict, tensor_names: set[str], tensor_types: list[int],
                   rope_factors: dict[str, list[float]] | None = None, tensors: dict | None = None) -> dict:
    """The HF config.json a GGUF file's metadata describes; ``rope_factors``: Phi-3's longrope
    factor tensors ("long", "short"), read from the file; ``tensors``: the file's (gpt-oss reads
    its experts' type there)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ModelSourceError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)}).")
    p = arch + "."
    cls, model_type = _MIXTRAL if arch == "llama" and meta.get(p + "expert_count") else _ARCHS[arch]
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    kv = meta.get(p + "attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer list in some files; uniform for the families we serve
        kv = max(kv)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(meta.get(p + "vocab_size", len(tokens)) or len(tokens))
    if tokens:
        vocab = len(tokens)
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rope_scaling = None
    stype = meta.get(p + "rope.scaling.type")
    if stype and stype != "none":
        rope_scaling = {"rope_type": stype, "factor": _f32(meta.get(p + "rope.scaling.factor", 1.0))}
        orig = meta.get(p + "rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    if any(t in (GGMLType.F32,) for t in tensor_types) and all(
            t in (GGMLType.F32,) for t in tensor_types):
        dtype = "float32"
    elif any(t == GGMLType.F16 for t in tensor_types) and not any(t == GGMLType.BF16 for t in tensor_types):
        dtype = "float16"
    else:
        dtype = "bfloat16"
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        # Qwen3.5-MoE files have no dense feed-forward, nor its size
        "intermediate_size": int(meta.get(p + "feed_forward_length", 0) if arch == "qwen35moe"
                                 else meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": _f32(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch in ("qwen2",):
        cfg["attention_bias"] = True
    elif any(n.endswith("attn_q.bias") for n in tensor_names):
        cfg["attention_bias"] = True
    if arch == "deepseek2":
        cfg.update(_deepseek_config(meta, heads))
        return cfg
    if arch == "gpt-oss":
        cfg.update(gpt_oss_config(meta, tensors or {}, cfg))
        return cfg
    if arch == "glm4moe":
        cfg.update(glm4moe_config(meta, tensor_names, cfg))
        return cfg
    if arch == "llama4":
        cfg.update(llama4_config(meta, tensors or {}, cfg))
        return cfg
    cfg.update(_moe_config(meta, arch, tensor_names, cfg["num_hidden_layers"]))
    if arch in HYBRID_ARCHS:
        cfg.update(hybrid_config(meta, arch, cfg))
        return cfg
    cfg.update(_gemma_config(meta, arch, cfg))
    rope_dims = meta.get(p + "rope.dimension_count")
    if rope_dims and int(rope_dims) != head_dim:  # Phi-4-mini rotates 96 of 128 channels: refused by name
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    if arch == "phi3":
        cfg.update(_phi3_config(meta, rope_factors or {}))
    return cfg


def _gemma_config(meta: dict, arch: str, cfg: dict) -> dict:
    """Gemma 2 / 3's keys of the HF config: the window, the soft caps (Gemma 2), the attention
    scale llama.cpp uses (_GEMMA_27B_LAYERS), Gemma 3's local rope base (10000 in llama.cpp, not
    stored) and its one global layer in six."""
    if arch not in _NORM_PLUS_ONE:
        return {}
    p = arch + "."
    big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    out = {"hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]}
    if meta.get(p + "attention.sliding_window"):  # optional for Gemma 3 (none: every layer global)
        out["sliding_window"] = int(meta[p + "attention.sliding_window"])
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _f32(meta.get(p + "attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = _f32(meta.get(p + "final_logit_softcapping", 30.0))
    else:
        out["rope_local_base_freq"] = 10000.0
        pattern = meta.get(p + "attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # newer files: a flag per layer, true where it slides
            out["layer_types"] = ["sliding_attention" if slides else "full_attention" for slides in pattern]
        else:
            out["sliding_window_pattern"] = int(pattern)
    return out


def _phi3_config(meta: dict, rope_factors: dict[str, list[float]]) -> dict:
    """Phi-3's window (Phi-3-mini slides over 2047 tokens) and longrope: its factors are tensors
    in the file (rope_factors_long / _short), the original context a metadata key."""
    out: dict[str, Any] = {}
    window = meta.get("phi3.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    if rope_factors:
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": rope_factors["long"],
                               "short_factor": rope_factors["short"]}
        out["original_max_position_embeddings"] = int(meta["phi3.rope.scaling.original_context_length"])
    return out


def _deepseek_config(meta: dict, heads: int) -> dict:
    """DeepSeek's keys of the HF config from a "deepseek2" file (V2, V2-Lite and V3's architecture:
    V3 routes by sigmoid, expert_gating_func 2). Files written since llama.cpp split kv_b_proj give
    the query/key and value head sizes as key_length_mla / value_length_mla (key_length and
    value_length are then the latent row's, MQA style, with one KV head); older ones give them as
    key_length / value_length. llama.cpp's YaRN keeps one mscale (yarn_log_multiplier = 0.1 x
    mscale_all_dim), which DeepSeek's configs set equal to mscale; its beta_fast / beta_slow are
    32 / 1. Groups of experts (V2's group_limited_greedy, V3's) only where the file states them."""
    p = "deepseek2."
    rope = int(meta[p + "rope.dimension_count"])
    key = int(meta.get(p + "attention.key_length_mla") or meta[p + "attention.key_length"])
    value = int(meta.get(p + "attention.value_length_mla") or meta[p + "attention.value_length"])
    sigmoid = int(meta.get(p + "expert_gating_func") or 1) == 2
    groups, kept = int(meta.get(p + "expert_group_count") or 1), int(meta.get(p + "expert_group_used_count") or 1)
    q_lora = meta.get(p + "attention.q_lora_rank")
    out = {
        "num_key_value_heads": heads, "head_dim": rope, "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope,
        "v_head_dim": value, "kv_lora_rank": int(meta[p + "attention.kv_lora_rank"]),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "first_k_dense_replace": int(meta.get(p + "leading_dense_block_count") or 0), "moe_layer_freq": 1,
        "n_routed_experts": int(meta[p + "expert_count"]), "num_experts_per_tok": int(meta[p + "expert_used_count"]),
        "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
        "n_shared_experts": int(meta.get(p + "expert_shared_count") or 0),
        "routed_scaling_factor": _f32(meta.get(p + "expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", False)),
        "scoring_func": "sigmoid" if sigmoid else "softmax", "n_group": groups, "topk_group": kept,
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
    }
    if sigmoid:
        out["architectures"], out["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
    if meta.get(p + "rope.scaling.type") == "yarn":
        mscale = _f32(meta.get(p + "rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        out["rope_scaling"] = {"type": "yarn", "factor": _f32(meta[p + "rope.scaling.factor"]),
                               "original_max_position_embeddings": int(meta[p + "rope.scaling.original_context_length"]),
                               "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32, "beta_slow": 1}
    return out


def _moe_config(meta: dict, arch: str, tensor_names: set[str], layers: int) -> dict:
    """The mixture-of-experts keys of the HF config, named as its config.json names them ({} for
    a dense model). Mixtral's experts are feed_forward_length wide and route in every layer."""
    p = arch + "."
    experts = int(meta.get(p + "expert_count") or 0)
    if not experts:
        return {}
    top_k = int(meta[p + "expert_used_count"])
    if arch == "llama":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
        "shared_expert_intermediate_size": int(meta.get(p + "expert_shared_feed_forward_length") or 0),
        # a file that states it (llama.cpp's key for the families that vary) is taken at its word
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", _NORM_TOPK_PROB[arch])),
        # a layer without a router is dense (HF's mlp_only_layers); llama.cpp writes none such
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of Q/K rows: per head, rows were reordered from
    [first half | second half] to interleaved pairs; put them back."""
    rows = t.shape[0]
    head_dim = rows // n_head
    rest = t.shape[1:]
    return t.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def _make_ref(info: GGUFTensorInfo, permute_heads: int | None, hf_shape: tuple[int, ...] | None = None) -> WeightRef:
    """``hf_shape``: the HF tensor's shape where it differs from the file's by unit dimensions."""
    dtype = NATIVE_TORCH.get(info.ggml_type, torch.float32)
    shape = info.shape

    def load(slices: tuple[slice, ...] | None) -> torch.Tensor:
        rows = None
        rest = slices
        if slices and isinstance(slices[0], slice) and slices[0].step in (None, 1) and len(shape) >= 2:
            start, stop, _ = slices[0].indices(shape[0])
            head_dim = shape[0] // permute_heads if permute_heads else 1
            if stop > start and start % head_dim == 0 and stop % head_dim == 0:
                rows = (start, stop)
                rest = (slice(None),) + tuple(slices[1:])
        t = info.load(rows)
        if permute_heads:
            n = permute_heads if rows is None else (rows[1] - rows[0]) // (shape[0] // permute_heads)
            t = _unpermute_rows(t, n)
        if hf_shape is not None:
            t = t.reshape(hf_shape)
        return apply_slices(t, rest)

    return WeightRef(hf_shape or shape, dtype, load)


# Linear layers' matrices, and the output matrix (layers/embedding.py ParallelLMHead): kept in
# their quantized blocks when their type is in SPLITTABLE.
_LINEARS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                         "lm_head", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "in_proj_qkv",
                                         "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_ba", "out_proj"))


def _make_quant_ref(info: GGUFTensorInfo, permute_heads: int | None) -> QuantRef:
    def read() -> QuantizedTensor:
        qt = split_tensor(info.raw(), info.ggml_type, info.shape)
        return qt.map_rows(lambda t: _unpermute_rows(t, permute_heads)) if permute_heads else qt

    return QuantRef(read, f"GGUF {info.type_name} {info.name}", info.shape)


def _minus_one(ref: WeightRef) -> WeightRef:
    """A Gemma norm weight as HF stores it (the file's 1 + w, _NORM_PLUS_ONE)."""
    return WeightRef(ref.shape, ref.dtype, lambda slices: ref.load(slices).float() - 1.0)


def _kept_quantized(hf_name: str, info: GGUFTensorInfo) -> bool:
    """A linear matrix, or a stack of experts' matrices ([E, rows, cols], one per expert), in a
    type kvship serves in its blocks: dense layers with kernels/quant_linear.py, experts with
    kernels/fused_moe.py. The router (mlp.gate) is not among them: it stays 16-bit."""
    return hf_name.endswith(_LINEARS) and info.ggml_type in SPLITTABLE and len(info.shape) == (3 if "{}" in hf_name else 2)


# A mixture-of-experts layer's tensors (llama.cpp's name -> HF's below model.layers.N): the router,
# Qwen2-MoE's shared expert and its sigmoid gate, and the experts, stacked in one 3-D tensor each
# ("{}": the expert). Mixtral's block_sparse_moe is called mlp, as the model's loader calls it.
_MOE_PARTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_MOE_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
# Mixtral files converted before llama.cpp stacked the experts hold one matrix per expert
# ("blk.N.ffn_gate.E.weight"); llama.cpp still reads them.
_SPLIT_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


# DeepSeek-V3's router bias (HF's e_score_correction_bias, a float32 vector)
_ROUTER_BIAS = re.compile(r"^blk\.(\d+)\.exp_probs_b\.bias$")


def _hf_name(gname: str, arch: str) -> str | None:
    if arch in HYBRID_ARCHS and (hf := hybrid_hf_name(gname)):
        return hf
    m = _SPLIT_EXPERT.match(gname)
    if m:
        return f"model.layers.{m[1]}.mlp.experts.{m[3]}.{m[2]}_proj.weight"
    m = _ROUTER_BIAS.match(gname)
    if m:
        return f"model.layers.{m[1]}.mlp.gate.e_score_correction_bias"
    m = _MOE_TENSOR.match(gname)
    part = (arch_layer_name(arch, m[2]) or _MOE_PARTS.get(m[2])) if m else None
    return f"model.layers.{m[1]}.{part}.weight" if part else gguf_to_hf_name(gname, arch)


def _joined_kv_b(k_b: GGUFTensorInfo, v_b: GGUFTensorInfo) -> WeightRef:
    """DeepSeek's kv_b_proj [heads * (nope + v), rank] (per head: its W_UK rows, then its W_UV
    rows) from the halves llama.cpp's converter writes it as since it split it: attn_k_b [heads,
    rank, nope] (each head's W_UK transposed) and attn_v_b [heads, v, rank]. Dequantized: the
    model holds kv_b_proj in 16 bits (models/deepseek_v2.py)."""
    heads, rank, nope = k_b.shape
    v = v_b.shape[1]

    def load(slices: tuple[slice, ...] | None) -> torch.Tensor:
        kb = k_b.load(None).float().reshape(heads, rank, nope).transpose(1, 2)
        t = torch.cat([kb, v_b.load(None).float().reshape(heads, v, rank)], dim=1)
        return apply_slices(t.reshape(heads * (nope + v), rank), slices)

    return WeightRef((heads * (nope + v), rank), torch.float32, load)


def _expert(info: GGUFTensorInfo, e: int) -> GGUFTensorInfo:
    """Expert ``e``'s matrix of a stacked [E, rows, cols] tensor: the 2-D tensor its bytes form
    (contiguous in the file), so that a rank reads only its rows of it."""
    size = info.nbytes // info.dims[2]
    return replace(info, name=f"{info.name}[{e}]", dims=info.dims[:2], offset=info.offset + e * size, nbytes=size)


def _refs(hf: str, info: GGUFTensorInfo, permute_heads: int | None, kept: bool) -> Iterator[tuple[str, Any]]:
    """The HF tensors one GGUF tensor holds: one per expert for stacked experts (each goes to
    MoEExperts.weight_loader under its checkpoint name, as from safetensors), else itself."""
    if "{}" in hf:
        for e in range(info.shape[0]):
            yield hf.format(e), _make_quant_ref(_expert(info, e), None) if kept else _make_ref(_expert(info, e), None)
    elif kept:
        yield hf, _make_quant_ref(info, permute_heads)
    else:  # Qwen2-MoE's shared expert gate is a [H] vector in files, a [1, H] matrix in HF
        yield hf, _make_ref(info, permute_heads, (1, info.shape[-1]) if hf.endswith("shared_expert_gate.weight") else None)


def _describe(gnames: set[str], tensors: dict[str, GGUFTensorInfo]) -> str:
    """GGUF tensor names with their layer folded: "blk.*.ffn_up_exps.weight Q4_K (48 layers)"."""
    groups = Counter((re.sub(r"^blk\.\d+\.", "blk.*.", g), tensors[g].type_name) for g in gnames)
    return ", ".join(f"{n} {t}" + (f" ({c} layers)" if c > 1 else "") for (n, t), c in sorted(groups.items())) or "none"


def _log_storage(tensors: dict[str, GGUFTensorInfo], kept: set[str]) -> None:
    expanded = {g for g, t in tensors.items() if g not in kept and t.ggml_type not in NATIVE_TORCH}
    if kept:
        log.info("GGUF: %d linear matrices stay quantized (%s); dequantized at load: %s", len(kept),
                 ", ".join(sorted({tensors[g].type_name for g in kept})), _describe(expanded, tensors))
    elif expanded:
        log.info("GGUF: dequantized at load: %s", _describe(expanded, tensors))


def load_gguf(path: str) -> ModelSource:
    if not os.path.isfile(path):
        raise ModelSourceError(f"GGUF file {path!r} does not exist; check the path.")
    files = [GGUFFile(p) for p in shard_paths(path)]
    meta = dict(files[0].metadata)
    tensors: dict[str, GGUFTensorInfo] = {}
    for f in files:
        tensors.update(f.tensors)
    for k in list(meta):
        if k.startswith("split."):
            meta.pop(k)
    factors = {kind: tensors[f"rope_factors_{kind}.weight"].load(None).flatten().tolist()
               for kind in ("long", "short") if f"rope_factors_{kind}.weight" in tensors}
    try:
        cfg = gguf_hf_config(meta, set(tensors), [t.ggml_type for t in tensors.values()], factors, tensors)
    except KeyError as e:
        raise ModelSourceError(f"GGUF file {path!r} lacks metadata key {e}; is it a complete model?") from None
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except (KeyError, ValueError) as e:
        raise ModelSourceError(f"GGUF file {path!r} has no usable tokenizer metadata ({e}).") from None
    gen = {k: v for k, v in (("bos_token_id", cfg["bos_token_id"]), ("eos_token_id", cfg["eos_token_id"]))
           if v is not None}
    if tokenizer.eos_token_ids and len(tokenizer.eos_token_ids) > 1:
        gen["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    arch = meta["general.architecture"]
    permute = arch in _PERMUTED_ARCHS
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {g: _hf_name(g, arch) for g in tensors}
    # gpt-oss keeps its experts in MXFP4 (gguf_gpt_oss.py) and the rest in 16 bits
    kept = {g for g, hf in names.items() if hf is not None and _kept_quantized(hf, tensors[g]) and arch != "gpt-oss"}
    if kept:
        cfg["quantization_config"] = {"quant_method": "gguf"}
    _log_storage(tensors, kept)
    # A tied output matrix is the token embedding: lookups need it dequantized, and the LM head
    # also gets it in its blocks (layers/embedding.py ParallelLMHead.load_quantized_copy).
    embed = tensors.get("token_embd.weight")
    tied_head = cfg["tie_word_embeddings"] and embed is not None and _kept_quantized("lm_head.weight", embed)
    if tied_head:
        log.info("GGUF: the tied output matrix (token_embd.weight %s) is also kept in its blocks for the "
                 "LM head", embed.type_name)

    hybrid = HybridTensors(arch, cfg) if arch in HYBRID_ARCHS else None

    def weights() -> Iterator[tuple[str, WeightRef]]:
        if arch == "gpt-oss":
            yield from gpt_oss_weights(tensors, names)
            return
        for gname, info in tensors.items():
            hf = names[gname]
            if arch == "deepseek2" and gname.endswith(("attn_k_b.weight", "attn_v_b.weight")):
                if gname.endswith("attn_k_b.weight"):
                    v_b = tensors.get(gname.replace("attn_k_b", "attn_v_b"))
                    if v_b is None:
                        raise ModelSourceError(f"GGUF file {path!r} holds {gname} without its attn_v_b half")
                    hf = gname.replace("blk.", "model.layers.").replace("attn_k_b", "self_attn.kv_b_proj")
                    yield hf, _joined_kv_b(info, v_b)
                continue
            if hf is None:
                if gname not in ("rope_freqs.weight",):
                    log.warning("GGUF tensor %s has no known HF name; skipped", gname)
                continue
            heads = None
            if permute and hf.endswith(("q_proj.weight", "q_proj.bias")):
                heads = n_head
            elif permute and hf.endswith(("k_proj.weight", "k_proj.bias")):
                heads = n_kv
            if hybrid is not None:
                ref = _make_quant_ref(info, None) if gname in kept else _make_ref(info, None)
                moved = hybrid.moved(hf, ref, gname in kept)
                if moved is not None:
                    yield hf, moved
                    continue
            if arch in _NORM_PLUS_ONE and hf.endswith("norm.weight"):
                yield hf, _minus_one(_make_ref(info, None))
                continue
            yield from _refs(hf, info, heads, gname in kept)
            if tied_head and gname == "token_embd.weight":
                yield "lm_head.weight", _make_quant_ref(info, None)

    return ModelSource(name=gguf_model_name(path), path=path, hf_config=cfg, generation_config=gen,
                       tokenizer=tokenizer, _weights=weights)
