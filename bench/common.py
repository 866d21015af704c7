"""Shared by the benchmarks: model shapes written as config-only folders (served with random
weights, load_format="dummy"), and the hardware ceilings measured in the same run."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch

_GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_experts_per_tok=4, sliding_window=128,
                attention_bias=True, vocab_size=201088, rope_theta=150000.0, swiglu_limit=7.0,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096},
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                quantization_config={"quant_method": "mxfp4"}, torch_dtype="bfloat16", bos_token_id=0,
                eos_token_id=1)

# Qwen3.5 / Qwen3.6 hybrids (models/qwen3_next.py): what their shapes share
_QWEN36 = dict(full_attention_interval=4, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
               rope_theta=10000000.0, max_position_embeddings=262144, rms_norm_eps=1e-6, vocab_size=248320,
               tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)

SHAPES = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=0,
                       eos_token_id=1),
    # Gemma 2 9B: local (4096-token window) and global layers alternating, soft-capping, GeGLU
    "gemma2-9b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584,
                      intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=256, vocab_size=256000, rope_theta=10000.0, max_position_embeddings=8192,
                      rms_norm_eps=1e-6, sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                      torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # Phi-4 (14B): fused qkv_proj and gate_up_proj in the checkpoint
    "phi4": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=5120, intermediate_size=17920,
                 num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10, vocab_size=100352,
                 rope_theta=250000.0, max_position_embeddings=16384, original_max_position_embeddings=16384,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # routed experts in every layer: 8 of 128 per token (param_count counts the 8 a token uses)
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # DeepSeek-V2-Lite (16B, 2.4B active): multi-head latent attention (the cache holds a 512-wide
    # latent and a 64-wide rope key a token), 6 of 64 routed experts and 2 shared ones from layer 1
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
                             intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, vocab_size=102400, q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                             moe_layer_freq=1, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             moe_intermediate_size=1408, routed_scaling_factor=1.0, topk_method="greedy", n_group=1,
                             topk_group=1, norm_topk_prob=False, scoring_func="softmax", rope_theta=10000,
                             rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                                           "beta_fast": 32, "beta_slow": 1,
                                           "original_max_position_embeddings": 4096},
                             max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # Moonlight-16B-A3B: DeepSeek-V3's architecture (sigmoid routing with a correction bias,
    # 6 of 64 experts in 1 group, 2 shared), no rope scaling, 27 layers of MLA
    "moonlight-16b-a3b": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=2048,
                              intermediate_size=11264, num_hidden_layers=27, num_attention_heads=16,
                              num_key_value_heads=16, vocab_size=163840, q_lora_rank=None, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                              moe_layer_freq=1, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                              moe_intermediate_size=1408, routed_scaling_factor=2.446, topk_method="noaux_tc",
                              scoring_func="sigmoid", n_group=1, topk_group=1, norm_topk_prob=True,
                              rope_theta=50000.0, rope_scaling=None, max_position_embeddings=8192, rms_norm_eps=1e-5,
                              tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # gpt-oss: 4 of 32 (20b) or of 128 (120b) experts in MXFP4 as OpenAI ships them, attention
    # sinks, sliding-window (128) layers alternating with full ones, YaRN
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32,
                        layer_types=["sliding_attention", "full_attention"] * 12),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=["sliding_attention", "full_attention"] * 18),
    # GLM-4.5-Air (106B, 12B active): one dense layer, then 8 of 128 routed experts + 1 shared,
    # sigmoid routing; GQA 96/8 heads with biases, half of each head rotated. Fits one GPU only
    # quantized (--quantization fp8: about 110 GB)
    "glm-4.5-air": dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=4096,
                        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
                        num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                        norm_topk_prob=True, routed_scaling_factor=1.0, partial_rotary_factor=0.5,
                        rope_theta=1000000.0, attention_bias=True, use_qk_norm=False, vocab_size=151552,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=0,
                        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # Llama-4-Scout (109B, 17B active): top-1 of 16 experts + a shared one in every layer, chunked
    # attention (8192) on 3 of 4 layers; fits one GPU only quantized (--quantization fp8)
    "llama4-scout": dict(architectures=["Llama4ForCausalLM"], model_type="llama4_text", hidden_size=5120,
                         intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
                         num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=202048,
                         num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
                         attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
                         floor_scale=8192, attn_scale=0.1, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)],
                         rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 16.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                                            "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1),
    # Qwen3.6-27B (Qwen3.5-27B's language model): 16 x (3 Gated DeltaNet + 1 gated attention)
    # layers, DeltaNet 16 q/k heads and 48 value heads of 128, attention 24/4 heads of 256 with a
    # quarter rotated; the recurrent state replaces the KV cache on three layers of four
    "qwen3.6-27b": dict(_QWEN36, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=5120,
                        intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, linear_num_value_heads=48),
    # Qwen3.6-35B-A3B (as Qwen3.5-35B-A3B): 10 x (3 + 1) layers, every one routed (8 of 256
    # experts of 512 and a shared one), DeltaNet 16/32 heads, attention 16/2 heads of 256
    "qwen3.6-35b-a3b": dict(_QWEN36, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                            hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
    # the dense transformer of about the hybrid 27B's size, for the long-context comparison; its
    # positions go past the real model's (YaRN to 128k) so that 128k plus the output fits
    "qwen3-32b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=262144,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0,
                      eos_token_id=1),
    # a 1-layer Llama whose forward costs almost nothing: the host-side benches on a CPU
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                 max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0,
                 eos_token_id=1),
    # a tiny hybrid of each kind: the CPU test of the benchmark's path (tests/bench)
    "hybrid-tiny": dict(_QWEN36, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=64,
                        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, vocab_size=512),
    "hybrid-moe-tiny": dict(_QWEN36, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, vocab_size=512, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32),
}


# In-situ weight formats the benchmarks compare; "int4-g32" is int4 in groups of 32 with offsets,
# the layout GGUF Q4_K blocks load into; "fp8-block" FP8 with a scale per 128 x 128 block, the
# layout of block-wise FP8 checkpoints (Qwen3-FP8, DeepSeek-V3).
WEIGHT_FORMATS = ["fp8", "fp8-block", "int8", "int4", "int4-g32"]


def insitu_method(fmt: str | None) -> str | None:
    """The engine's ``quantization`` for a benchmark weight format (None or "none": 16-bit); sets
    kvship.quant.insitu.INT4_GROUP and FP8_BLOCK, which the int4 and the FP8 formats differ by,
    for the engine built next."""
    from kvship.quant import insitu

    insitu.INT4_GROUP = 32 if fmt == "int4-g32" else 128
    insitu.FP8_BLOCK = 128 if fmt == "fp8-block" else 0
    return {None: None, "none": None, "int4-g32": "int4", "fp8-block": "fp8"}.get(fmt, fmt)


def write_shape_folder(shape: str, root: str | os.PathLike) -> str:
    """config.json + a word-level tokenizer over the whole vocabulary: enough for the engine
    to serve the shape with random weights and detokenize whatever it samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = SHAPES[shape]
    folder = Path(root) / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1", "bos_token": "w0"}))
    return str(folder)


def param_count(shape: str) -> int:
    """Parameters one token computes with: with routed experts (in every layer, as in the shapes
    here), the k it picks and the router, not the others."""
    c = SHAPES[shape]
    if c.get("linear_num_value_heads"):
        return _hybrid_param_count(c)
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    embed = v * h * (1 if c["tie_word_embeddings"] else 2)
    if c.get("kv_lora_rank"):  # DeepSeek: latent attention, dense MLPs first, then routed and shared experts
        assert c.get("q_lora_rank") is None, "the shapes here project the query in one matrix"
        heads, nope, rope, vd, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                    c["v_head_dim"], c["kv_lora_rank"])
        attn = h * heads * (nope + rope) + h * (r + rope) + r + r * heads * (nope + vd) + heads * vd * h
        dense = c["first_k_dense_replace"]
        experts = c["num_experts_per_tok"] + c["n_shared_experts"]
        moe = 3 * h * c["moe_intermediate_size"] * experts + c["n_routed_experts"] * h
        return layers * (attn + 2 * h) + dense * 3 * h * i + (layers - dense) * moe + embed + h
    if c["model_type"] in ("glm4_moe", "llama4_text"):
        return _routed_shared_param_count(c)
    router = 0
    if c.get("num_experts"):
        i, router = c["num_experts_per_tok"] * c["moe_intermediate_size"], c["num_experts"] * h
    d = c.get("head_dim", h // c["num_attention_heads"])
    attn = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    per_layer = attn + 3 * h * i + router + 2 * h
    return layers * per_layer + embed + h


def matmul_param_counts(shape: str) -> tuple[int, int]:
    """(a decoded token's, a prompt token's) parameters in matrix products: param_count less the
    input embedding (a lookup); a prompt token skips the LM head too (only a prompt's last one
    makes logits)."""
    c = SHAPES[shape]
    table = c["vocab_size"] * c["hidden_size"]
    body = param_count(shape) - table * (1 if c["tie_word_embeddings"] else 2)
    return body + table, body


def _routed_shared_param_count(c: dict) -> int:
    """GLM-4 MoE (dense first layers, then k routed + shared experts) and Llama 4 (routed layers
    every interleave_moe_layer_step, top-1 + a shared expert, dense ones of intermediate_size_mlp)."""
    h, layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c["head_dim"]
    attn = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2) + 2 * h
    if c["model_type"] == "glm4_moe":
        dense, dense_i = c["first_k_dense_replace"], c["intermediate_size"]
        experts, expert_i, e = c["num_experts_per_tok"] + c["n_shared_experts"], c["moe_intermediate_size"], \
            c["n_routed_experts"]
    else:
        step = c["interleave_moe_layer_step"]
        dense, dense_i = layers - layers // step, c["intermediate_size_mlp"]
        experts, expert_i, e = c["num_experts_per_tok"] + 1, c["intermediate_size"], c["num_local_experts"]
    moe = 3 * h * expert_i * experts + e * h
    return layers * attn + dense * 3 * h * dense_i + (layers - dense) * moe + 2 * v * h + h


def attention_layers(c: dict) -> int:
    """Layers with a KV cache: all but a hybrid's Gated DeltaNet layers."""
    if c.get("layer_types"):
        return sum(t != "linear_attention" for t in c["layer_types"])
    return c["num_hidden_layers"] // c.get("full_attention_interval", 1)


def _hybrid_param_count(c: dict) -> int:
    """Qwen3.5 / Qwen3.6: Gated DeltaNet layers (in_proj to q|k|v, z, b, a; conv1d; A, dt bias,
    gated norm; out_proj), gated attention ones (q_proj twice as wide: query and gate; q/k norms),
    each with a dense MLP or, routed, the k experts a token picks, the shared one and its gate."""
    h, layers, v, d = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["head_dim"]
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    linear = h * (conv_dim + nv * dv + 2 * nv) + conv_dim * c["linear_conv_kernel_dim"] + 2 * nv + dv + nv * dv * h
    full = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + c["num_attention_heads"] * d * h \
        + 2 * d
    if c.get("num_experts"):
        k, e = c["num_experts_per_tok"], c["num_experts"]
        mlp = 3 * h * (k * c["moe_intermediate_size"] + c["shared_expert_intermediate_size"]) + e * h + h
    else:
        mlp = 3 * h * c["intermediate_size"]
    n_full = attention_layers(c)
    return (layers - n_full) * linear + n_full * full + layers * (mlp + 2 * h) + 2 * v * h + h


def experts_read(shape: str, batch: int) -> float:
    """Routed experts one layer reads in a step of ``batch`` tokens, per expert a token picks:
    E * (1 - (1 - k/E)^batch) / k under uniform routing (1 at batch 1; E/k once every expert is
    picked). 1 for a dense shape."""
    c = SHAPES[shape]
    e = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")  # DeepSeek's, Llama 4's
    if not e:
        return 1.0
    k = c["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** batch) / k


def expert_bytes_per_token(model) -> int:
    """The routed experts' share of weight_bytes_per_token (k of E, in their loaded format)."""
    return sum(p.numel() * p.element_size() for mod in model.modules()
               if getattr(mod, "num_experts", 0) and hasattr(mod, "w13")
               for p in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
               ) * model.cfg.num_experts_per_tok // max(1, model.cfg.num_experts)


def weight_bytes_per_token(model) -> int:
    """Bytes a batch-1 decode step reads of the weights: every parameter and quantized matrix,
    except an untied input embedding (one row per token) and the routed experts a token does not
    pick (stacked experts count k of E, whatever their format)."""
    total, seen = 0, set()
    for name, mod in model.named_modules():
        experts = getattr(mod, "num_experts", 0)
        if experts and hasattr(mod, "w13"):  # layers.moe.MoEExperts: all its tensors are per expert
            for p in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size() * model.cfg.num_experts_per_tok // experts
            continue
        q = getattr(mod, "qweight", None)
        if q is not None:  # its `weight` parameter is the codes, counted here with the scales
            total += q.nbytes()
            seen.add(id(mod.weight))
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen or (name.endswith("embed_tokens") and not model.cfg.tie_word_embeddings):
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def state_bytes_per_token(model, dtype: torch.dtype) -> int:
    """A hybrid's recurrent state (conv inputs and delta-rule matrices of every DeltaNet layer),
    read and written by each decode step whatever the context; 0 for other models."""
    return 2 * model.state_bytes_per_slot(dtype) if hasattr(model, "state_bytes_per_slot") else 0


def start_engine(source: str, max_model_len: int, eager: bool, quantization: str | None = None,
                 device: str = "cuda", **options):
    """An engine of ``source``: a shape folder (random weights) or a .gguf file (its own weights);
    ``options``: more EngineConfig fields."""
    from kvship.llm import LLM

    load_format = "auto" if source.endswith(".gguf") else "dummy"
    return LLM(source, load_format=load_format, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=8,
               enforce_eager=eager, quantization=quantization, device=device, **options)


def bytes_per_token(llm) -> tuple[int, int]:
    """(weight bytes a batch-1 decode step reads as loaded, recurrent-state bytes it reads and writes)."""
    runner = llm.engine.runner
    return weight_bytes_per_token(runner.model), state_bytes_per_token(runner.model, runner.dtype)


def kv_bytes_per_token(shape: str, elem: int = 2, kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes of one token: 16-bit (elem 2) by default, or a --kv-cache-dtype's size
    (in blocks of 16 tokens: int4 keys' scales are per block)."""
    from kvship.kernels.kv_quant import bytes_per_block_head

    c = SHAPES[shape]
    if c.get("kv_lora_rank"):  # one latent row a token and layer, in the model's dtype
        return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * elem
    d = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    if kv_cache_dtype == "auto":
        per_head = 2 * d * elem
    else:
        per_head = bytes_per_block_head(kv_cache_dtype, d, torch.bfloat16, 16) / 16
    return int(attention_layers(c) * c["num_key_value_heads"] * per_head)


def measure_batch1(llm, prompt_len: int, out_len: int, runs: int = 3, warmup_len: int | None = None
                   ) -> tuple[float, float]:
    """Median (TTFT seconds, decode tok/s) of `runs` single random-token requests, after a warm-up
    of `warmup_len` prompt tokens (prompt_len unless given: a long context warms up shorter)."""
    from kvship.sampling_params import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    llm.generate([torch.randint(2, vocab, (warmup_len or prompt_len,), generator=g).tolist()], params)
    ttfts, rates = [], []
    for _ in range(runs):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        t0 = time.monotonic()
        out = llm.generate([prompt], params)[0]
        t_end = time.monotonic()
        ttfts.append(out.first_token_time - t0)
        rates.append((out_len - 1) / (t_end - out.first_token_time))
    return sorted(ttfts)[runs // 2], sorted(rates)[runs // 2]


def _time_cuda(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, bf16 matmul FLOP/s), on random data."""
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 2 * n * 2 / _time_cuda(lambda: dst.copy_(src))
    src = dst = None  # free them before the next allocation
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m**3 / _time_cuda(lambda: a @ b)
    a = b = None
    torch.cuda.empty_cache()
    return bw, flops


def kernel_rows(prof, per: float, top: int, cuda: bool = True) -> list[list[str]]:
    """A torch.profiler run as table rows: each CUDA kernel's device time divided by ``per``
    (steps, or 1 for totals), its launches likewise, and its share, largest first; then the total.
    Without CUDA the top-level aten operators' CPU times stand in for kernels."""
    from collections import defaultdict

    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA if cuda else (e.name.startswith("aten::") and
                                                                         not e.cpu_parent):
            rec = per_kernel[e.name[:90]]
            rec[0] += (e.time_range.elapsed_us() if cuda else e.cpu_time_total) / per
            rec[1] += 1 / per
    total = sum(v[0] for v in per_kernel.values()) or 1.0
    rows = [[name, f"{us:,.1f}", f"{n:,.1f}", f"{100 * us / total:.1f}%"]
            for name, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]]
    rows.append(["total (all kernels)", f"{total:,.1f}", f"{sum(v[1] for v in per_kernel.values()):,.0f}", "100%"])
    return rows


def header(title: str) -> str:
    commit = os.environ.get("BENCH_COMMIT", "")  # set where the tree travels without .git
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True).stdout.strip()
    except OSError:
        commit = "?"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"## {title}\n\n{datetime.date.today()} · {dev} · torch {torch.__version__} · commit {commit or '?'}\n")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (the nearest rank at or above it)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
