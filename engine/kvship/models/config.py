"""Model hyper-parameters, parsed from a Hugging Face config.json-shaped dict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvship.models.errors import UnsupportedModelError  # noqa: F401  (raised here; importers take it from config)
from kvship.models.hybrid_config import HYBRID, LinearAttention, hybrid_fields, text_config
from kvship.models.sigmoid_moe_config import PARTIAL_ROTARY, Llama4Layers, sigmoid_moe_fields
from kvship.quant import QuantScheme, checkpoint_format

# HF architecture name -> family (the model file that runs it, see registry.py)
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixture of experts: the same block with a routed feed-forward (layers/moe.py)
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # hybrid Gated DeltaNet + gated attention (models/qwen3_next.py); the vision tower is not served
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    # Phi-3 and Phi-4: the Llama block, stored with fused qkv_proj and gate_up_proj matrices
    "Phi3ForCausalLM": "phi3",
    # Gemma 2 and text-only Gemma 3 (models/gemma.py)
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # DeepSeek-V2 and V2-Lite: multi-head latent attention and routed + shared experts (models/deepseek_v2.py);
    # DeepSeek-V3's architecture (Moonlight): the same, routed by sigmoid scores
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    # GLM-4.5/4.6/4.7: DeepSeek-V3's routed + shared experts behind GQA on part-rotated heads (models/glm4_moe.py)
    "Glm4MoeForCausalLM": "glm4_moe",
    # Llama 4 (Scout, Maverick), text only: the vision tower of ...ForConditionalGeneration is not served (models/llama4.py)
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",
    # MiniMax-M2: sigmoid-routed experts, q/k RMSNorm over all heads at once (models/minimax_m2.py)
    "MiniMaxM2ForCausalLM": "minimax_m2",
    # gpt-oss: attention sinks, biases, clamped SwiGLU experts, MXFP4 experts (models/gpt_oss.py)
    "GptOssForCausalLM": "gpt_oss",
    # base models without the output projection, as embedding models are saved
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
_BY_MODEL_TYPE = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
                  "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
                  "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "deepseek_v2": "deepseek_v2",
                  "deepseek_v3": "deepseek_v3", "glm4_moe": "glm4_moe",
                  "llama4_text": "llama4", "llama4": "llama4", "minimax_m2": "minimax_m2", "gpt_oss": "gpt_oss"}
# architectures refused with a reason of their own
_REFUSED = {"Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (4B and larger) is not supported: kvship "
                                              "runs text-only Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text)"}
GEMMA = ("gemma2", "gemma3")


def family_of(cfg: dict[str, Any]) -> str:
    """The family ("llama", "qwen2", "qwen3") of an HF config dict."""
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in _REFUSED:
            raise UnsupportedModelError(f"{a}: {_REFUSED[a]}")
    if cfg.get("model_type") == "gemma3" and not archs:
        raise UnsupportedModelError(f"model_type gemma3: {_REFUSED['Gemma3ForConditionalGeneration']}")
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    if not archs and cfg.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[cfg["model_type"]]
    got = ", ".join(archs) or cfg.get("model_type") or "unknown"
    raise UnsupportedModelError(f"unsupported model architecture {got}; kvship supports: {', '.join(sorted(FAMILIES))}")


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma 3)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # top-k router weights rescaled to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    sparse_layers: frozenset[int] = frozenset()  # layers whose feed-forward is the experts
    # how the linear layers' weights are stored (kvship.quant.QuantScheme), None: the model's dtype
    quantization: Any = None
    # each layer's attention window (None: global), empty when no layer slides: Mistral v0.1 and
    # Phi-3 slide on every layer, Gemma on its local ones; the context is not limited by it
    layer_windows: tuple[int | None, ...] = ()
    # Gemma
    hidden_act: str = "silu"  # the gated MLP's activation: kvship.kernels.activation.ACTIVATIONS
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power instead of head_dim's
    attn_logit_softcapping: float | None = None  # scores -> tanh(s / cap) * cap
    final_logit_softcapping: float | None = None  # the same on the logits
    rope_local_theta: float | None = None  # Gemma 3's sliding layers' rope base (no scaling); None: rope_theta
    # DeepSeek-V2 (models/deepseek_v2.py): multi-head latent attention when kv_lora_rank > 0. head_dim
    # is then the rotary part of a query/key head (qk_rope_head_dim), as transformers sets it.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj (DeepSeek-V2, not Lite)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    moe_groups: tuple[int, int] | None = None  # (n_group, topk_group): routing within the best groups
    # "softmax" (DeepSeek-V2) or "sigmoid" (V3's noaux_tc: sigmoid scores, chosen with a bias)
    moe_scoring: str = "softmax"
    rope_interleave: bool = True  # DeepSeek's rope channels rotate as adjacent pairs (V3 may say False)
    shared_experts_intermediate_size: int = 0  # DeepSeek's always-on experts, ungated, as one MLP
    linear_attention: LinearAttention | None = None  # the hybrid families' Gated DeltaNet layers
    rotary_dim: int = 0  # channels of each head that rotate (GLM-4.5: half), 0 for the whole head
    # multi-token-prediction layers: stored past num_hidden_layers (DeepSeek-V3, GLM-4.5), as mtp.* (Qwen3.5)
    mtp_layers: int = 0
    llama4: Llama4Layers | None = None
    # gpt-oss (models/gpt_oss.py): experts stored as "mxfp4" (None: the model's dtype), its SwiGLU's clamp
    expert_format: str | None = None
    swiglu_limit: float = 7.0

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides over the same one (Mistral v0.1, Phi-3-mini): the
        KV cache then gives back the blocks out of it. None when any layer sees the whole
        context (Gemma's global layers) or none slides."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = family_of(cfg)
        cfg = text_config(cfg) if arch in (*HYBRID, "llama4") else cfg
        # transformers >= 5 writes rope settings under rope_parameters (Gemma 3: one set per layer type).
        rope_params = dict(cfg.get("rope_parameters") or {})
        local_rope = rope_params.pop("sliding_attention", None) or {}
        rope_params = dict(rope_params.pop("full_attention", None) or rope_params)
        rope_scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's first name for it
            if kind == "default":
                rope_scaling = None
            else:
                rope_scaling["rope_type"] = kind
                if kind == "longrope":  # the lengths it switches between live beside it in config.json
                    rope_scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
                    rope_scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        heads = cfg["num_attention_heads"]
        partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        if arch not in (*HYBRID, *PARTIAL_ROTARY) and partial not in (None, 1, 1.0):  # Phi-4-mini rotates 3/4 of each head
            raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported yet")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        windows = _layer_windows(arch, cfg, window)
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("qk_rope_head_dim") or cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA)),
            attention_bias=bool(cfg.get("attention_bias", arch in ("qwen2", "qwen2_moe"))),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3", *HYBRID) or (arch == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
            quantization=_quantization(arch, cfg),
            layer_windows=windows,
            **_moe_fields(arch, cfg),
            **_gemma_fields(arch, cfg, local_rope),
            **_deepseek_fields(arch, cfg),
            **_gpt_oss_fields(arch, cfg),
            **hybrid_fields(arch, cfg, cfg.get("head_dim") or cfg["hidden_size"] // heads),
            **sigmoid_moe_fields(arch, cfg, cfg.get("head_dim") or cfg["hidden_size"] // heads),
        )


def _quantization(arch: str, cfg: dict[str, Any]) -> QuantScheme | None:
    fmt = checkpoint_format(cfg.get("quantization_config"))
    if fmt is not None and fmt.name == "mxfp4":  # the experts' storage (expert_format); the rest is 16-bit
        if arch != "gpt_oss":
            raise UnsupportedModelError(f"MXFP4 checkpoints are supported for gpt-oss only, not {arch}")
        return None
    return None if fmt is None else QuantScheme(checkpoint=fmt.name)


def _gpt_oss_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if arch != "gpt_oss":
        return {}
    method = str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower()
    return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                sparse_layers=frozenset(range(cfg["num_hidden_layers"])),
                expert_format="mxfp4" if method == "mxfp4" else None,
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _layer_windows(arch: str, cfg: dict[str, Any], window: int | None) -> tuple[int | None, ...]:
    """Each layer's window, from layer_types where transformers >= 4.53 writes them, else by
    each family's rule: Gemma 2 alternates local and global from a local layer, Gemma 3 has
    one global layer every sliding_window_pattern, Qwen2 slides from max_window_layers on,
    Mistral and Phi-3 slide everywhere."""
    if not window:
        return ()
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        slides = [t == "sliding_attention" for t in types]
    elif arch == "gemma2":
        slides = [i % 2 == 0 for i in range(n)]
    elif arch == "gemma3":
        pattern = cfg.get("sliding_window_pattern", 6)
        slides = [(i + 1) % pattern != 0 for i in range(n)]
    elif arch == "qwen2":
        slides = [i >= cfg.get("max_window_layers", 28) for i in range(n)]
    else:
        slides = [True] * n
    return tuple(window if s else None for s in slides)


def _gemma_fields(arch: str, cfg: dict[str, Any], local_rope: dict[str, Any]) -> dict[str, Any]:
    if arch not in GEMMA:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma's MLP activation {act!r} is not supported (gelu_pytorch_tanh is)")
    if cfg.get("use_bidirectional_attention"):  # EmbeddingGemma
        raise UnsupportedModelError("bidirectional attention (use_bidirectional_attention) is not supported")
    fields = dict(hidden_act="gelu_tanh", query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
                  final_logit_softcapping=cfg.get("final_logit_softcapping"))
    if arch == "gemma2":  # Gemma 3's attention does not cap its scores in transformers, whatever its config says
        fields["attn_logit_softcapping"] = cfg.get("attn_logit_softcapping")
    else:
        fields["rope_local_theta"] = float(cfg.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0)))
    return fields


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if arch == "mixtral":  # every layer routed; the experts' size is intermediate_size
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    sparse_layers=frozenset(range(cfg["num_hidden_layers"])))
    # hub configs say num_experts; transformers 5 writes num_local_experts for Qwen3-MoE
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if arch in ("qwen2_moe", "qwen3_moe") and experts:
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
                    sparse_layers=frozenset(i for i in range(cfg["num_hidden_layers"])
                                            if i not in dense and (i + 1) % step == 0))
    return {}


def _deepseek_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's and V3's attention and experts; what their model file does not run is
    refused by name. V2 routes by softmax (greedy, or group_limited_greedy: groups rated by their
    best expert), V3 by noaux_tc (sigmoid scores; groups rated by their best two)."""
    if arch not in ("deepseek_v2", "deepseek_v3"):
        return {}
    name = "DeepSeek-V2" if arch == "deepseek_v2" else "DeepSeek-V3"
    v3 = arch == "deepseek_v3"
    scoring, methods = ("sigmoid", ("noaux_tc",)) if v3 else ("softmax", ("greedy", "group_limited_greedy"))
    # V2 with norm_topk_prob: DeepSeek's own code then skips routed_scaling_factor, transformers ignores it
    wants = [("scoring_func", scoring), ("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")]
    if not v3:
        wants.append(("norm_topk_prob", False))
    for key, want in wants:
        if cfg.get(key, want) != want:
            raise UnsupportedModelError(f"{name} with {key}={cfg[key]!r} is not supported ({want!r} is)")
    method = cfg.get("topk_method") or methods[0]
    if method not in methods:
        raise UnsupportedModelError(f"{name} routing topk_method={method!r} is not supported "
                                    f"({' and '.join(methods)} {'are' if len(methods) > 1 else 'is'})")
    n = cfg["num_hidden_layers"]
    # a key config.json leaves out takes transformers' default for the architecture (V3's: 3 dense
    # layers, 8 groups of which 4 are kept, weights times 2.5)
    first_dense = cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0
    freq = cfg.get("moe_layer_freq", 1) or 1
    grouped = v3 or method == "group_limited_greedy"
    mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0) if v3 else 0
    return dict(num_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
                shared_experts_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0),
                # the MTP layers' blocks are routed too
                sparse_layers=frozenset(i for i in range(n + mtp) if i >= first_dense and i % freq == 0),
                kv_lora_rank=cfg["kv_lora_rank"],
                q_lora_rank=cfg.get("q_lora_rank") or 0, qk_nope_head_dim=cfg["qk_nope_head_dim"],
                v_head_dim=cfg["v_head_dim"],
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
                moe_groups=(cfg.get("n_group", 8 if v3 else 1) or 1, cfg.get("topk_group", 4 if v3 else 1) or 1)
                if grouped else None,
                moe_scoring=scoring, rope_interleave=bool(cfg.get("rope_interleave", True)), mtp_layers=mtp)
