"""What is decided before a model runner exists, on every rank alike: the device, the dtype,
the attention backend, the model's parsed config (checked against the engine's options) and
the quantization its weights are held in."""
from __future__ import annotations

import dataclasses
import logging

import torch

from kvship.config import EngineConfig
from kvship.kernels._triton import HAS_TRITON
from kvship.loader import ModelSource, resolve_model
from kvship.models.config import ModelConfig
from kvship.quant import QuantScheme

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_dtype: str | None) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and less accurate
    return torch.float16 if model_dtype == "float16" else torch.bfloat16


def resolve_backend(name: str, device: torch.device) -> str:
    """"torch" forces the reference attention; otherwise kernels dispatch on the tensors' device
    (Triton on CUDA when installed, torch on CPU)."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
    if name != "torch" and device.type == "cuda":
        if not HAS_TRITON:
            log.warning("triton is not installed: the GPU runs the (slow) torch reference kernels")
    return name


def load_model(config: EngineConfig) -> tuple[ModelSource, ModelConfig]:
    """The model's source (tokenizer, generation config, lazy weights) and its parsed config.
    Fills in config.max_model_len (the model's limit when unset) and refuses a larger one, and
    config.task when "auto" (embed for a sentence-transformers folder, else generate).
    Rank 0 and every other tensor-parallel rank load the model through here."""
    source = resolve_model(config.model, revision=config.revision, download_dir=config.download_dir,
                           require_weights=config.load_format != "dummy")
    model_config = ModelConfig.from_hf(source.hf_config)
    model_config.quantization = _weight_quantization(config, model_config)
    spec = config.speculative_config
    if model_config.architecture == "deepseek_v3" and (spec is None or spec.method != "mtp"):
        model_config.mtp_layers = 0  # V3's MTP layer (a routed block) is held only to draft with it
    limit = model_config.max_position_embeddings
    if config.max_model_len and config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's limit of {limit} positions")
    config.max_model_len = config.max_model_len or limit
    if config.task == "auto":
        config.task = "embed" if source.pooling is not None else "generate"
    if model_config.linear_attention is not None and config.enable_prefix_caching and config.num_state_checkpoints == 0:
        log.warning("prefix caching is off for %s: no recurrent-state checkpoints (--num-state-checkpoints 0)",
                    model_config.architecture)
        config.enable_prefix_caching = False
    if model_config.kv_lora_rank and config.kv_cache_dtype == "int4":
        raise ValueError("--kv-cache-dtype int4: DeepSeek's latent KV cache is kept in the model's dtype (auto) or "
                         "in FP8 (fp8, fp8_e4m3, fp8_e5m2), not in 4 bits")
    if config.task == "embed" and config.tensor_parallel_size > 1:
        raise ValueError("embedding models are served with --tensor-parallel-size 1")
    return source, model_config


def _weight_quantization(config: EngineConfig, model_config: ModelConfig) -> QuantScheme | None:
    """The checkpoint's own quantization, or --quantization's in-situ one (from a GGUF file: over it)."""
    scheme = model_config.quantization
    if config.quantization is not None:
        # A GGUF file's blocks are requantized (read, expanded, quantized again); a checkpoint
        # quantized for serving (GPTQ, AWQ, FP8, compressed-tensors) is served as it is.
        if scheme is not None and scheme.checkpoint != "gguf":
            raise ValueError(f"the checkpoint is already quantized ({scheme.checkpoint}); drop --quantization")
        scheme = QuantScheme(checkpoint=scheme and scheme.checkpoint, insitu=config.quantization)
    on_cpu = resolve_device(config.device).type == "cpu"
    if scheme is not None:
        scheme = dataclasses.replace(scheme, cpu_format=config.cpu_weight_format)
        log.info("weights: %s", scheme.describe())
        if on_cpu:
            log.info("CPU weight format: %s", _CPU_FORMATS[scheme.cpu_format])
    elif on_cpu:
        log.info("CPU weight format: the checkpoint's 16-bit weights in float32 (--quantization int8 holds them "
                 "as int8)")
    return scheme


_CPU_FORMATS = {"auto": "auto (a checkpoint's 4-bit groups as int4, other quantized matrices as int8 rows; "
                        "bfloat16 inputs; --cpu-weight-format float32 for the float reference)",
                "int4": "int4 (groups of 32 with a scale and an offset, bfloat16 inputs)",
                "int8": "int8 (a scale per weight row, bfloat16 inputs)",
                "float32": "float32 (quantized weights dequantized at load)"}
