"""The one configuration object: built from the CLI (or the operator's args) and passed down."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvship.speculative_config import SpeculativeConfig

TASKS = ("auto", "generate", "embed")
QUANTIZATIONS = (None, "fp8", "int8", "int4")
CPU_WEIGHT_FORMATS = ("auto", "int4", "int8", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")
SCHEDULE_POLICIES = ("shortest-prefill", "longest-output")


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig fields, as `--kv-events-config` takes them in JSON."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(sorted(unknown))}")
        config = cls(**data)
        if config.publisher is None:
            config.publisher = "zmq" if config.enable_kv_cache_events else "null"
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, got {config.publisher!r}")
        if config.replay_endpoint:
            raise ValueError("--kv-events-config: replay_endpoint (replaying missed batches) is not implemented")
        if not isinstance(config.endpoint, str) or "://" not in config.endpoint:
            raise ValueError(f"--kv-events-config: endpoint must be a ZMQ address such as tcp://*:5557, "
                             f"got {config.endpoint!r}")
        return config

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass
class EngineConfig:
    model: str | None = None  # hub id, folder, or .gguf file; None -> bundled SmolLM2
    revision: str | None = None
    download_dir: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"  # auto | dummy (random weights of the model's shapes; benchmarks)
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    # In-situ weight quantization while loading (a checkpoint's own quantization_config needs no flag).
    quantization: str | None = None  # None | fp8 | int8 | int4
    # How a CPU holds quantized weights (a GGUF file's blocks, a quantized checkpoint, --quantization)
    # (kernels/cpu_quant_linear.py): auto keeps a checkpoint's 4-bit groups as int4 and the rest as
    # int8 rows; int4 / int8 requantize everything; float32 dequantizes (the reference path, outputs
    # as tested against transformers). The integer paths are faster; last bits depend on a step's rows.
    cpu_weight_format: str = "auto"
    # Sampling defaults from the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty) for requests that leave them out, as model authors intend.
    generation_defaults: bool = True

    max_model_len: int | None = None  # None -> the model's own limit
    # Most sequences in a batch. None: chosen from the KV cache's size once it is allocated
    # (ModelRunner.auto_max_num_seqs): a cache that holds more, an FP8 one say, runs more at once.
    max_num_seqs: int | None = None
    # Token budget per step (chunked prefill); None: default_token_budget(device).
    max_num_batched_tokens: int | None = None
    # Which waiting sequences are admitted first: shortest-prefill (fewest prompt tokens left, for
    # time to first token) or longest-output (most max_tokens: offline batches end sooner; `LLM`'s
    # default, OFFLINE_SCHEDULE_POLICY).
    schedule_policy: str = "shortest-prefill"
    # Once a prompt's prefill ends in a step, later prompts join that step only while it holds at
    # most this many tokens (core/scheduler.py); max_num_batched_tokens or more: they share it all.
    # None: they share it all (offline, for throughput); `kvship serve` defaults to
    # SERVE_PREFILL_JOIN_TOKENS, for time to first token.
    prefill_join_tokens: int | None = None
    # With decodes in a step, a long prompt's prefill (core/scheduler.py) takes at most this many of
    # its tokens: every running request's next token waits for the step, and a CPU's step time
    # grows with each token.
    # None: default_prefill_beside_decodes(device).
    prefill_beside_decodes: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_events: KVEventsConfig | None = None  # publish KV-cache events (vLLM's --kv-events-config)
    # Hybrid models: recurrent-state checkpoints a prefix hit resumes from (core/state_checkpoints.py);
    # None: a quarter of the sequences' state slots (at least 1); 0 turns their prefix cache off.
    num_state_checkpoints: int | None = None

    gpu_memory_utilization: float = 0.90
    kv_cache_memory: int | None = None  # bytes for KV; overrides the utilisation rule
    num_kv_blocks: int | None = None  # exact block count (tests, benchmarks)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 | fp8_e5m2 | int4
    calculate_kv_scales: bool = False  # fp8 KV: measure k/v scales on the first prefill, not at start-up

    tensor_parallel_size: int = 1
    tp_all_reduce: str = "fused"  # fused | one-shot | nccl (symmetric memory on GPUs; NCCL the fallback)
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str = "auto"  # auto | torch | triton
    cpu_threads: int | None = None  # torch's intra-op threads on the CPU; None: the fastest count, measured at start

    # LoRA adapters (vLLM's options): device slots, the largest rank they take, host copies kept
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    max_waiting_requests: int = 1024  # beyond this the server answers 503

    # What the model serves: "generate" (completions and chat), "embed" (/v1/embeddings), or
    # "auto": embed for a folder saved by sentence-transformers (modules.json), else generate.
    task: str = "auto"

    # Speculative decoding (docs/speculative.md): a SpeculativeConfig, or its dict / JSON text.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {self.schedule_policy!r}")
        if self.prefill_join_tokens is not None and self.prefill_join_tokens < 0:
            raise ValueError("prefill_join_tokens must be at least 0")
        if self.prefill_beside_decodes is not None and self.prefill_beside_decodes < 1:
            raise ValueError("prefill_beside_decodes must be at least 1")
        if self.num_state_checkpoints is not None and self.num_state_checkpoints < 0:
            raise ValueError("num_state_checkpoints must be at least 0")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.tp_all_reduce not in ("nccl", "one-shot", "fused"):
            raise ValueError(f"tp_all_reduce must be nccl, one-shot or fused, got {self.tp_all_reduce!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, got {self.quantization!r}")
        if self.cpu_weight_format not in CPU_WEIGHT_FORMATS:
            raise ValueError(f"cpu_weight_format must be one of {', '.join(CPU_WEIGHT_FORMATS)}, "
                             f"got {self.cpu_weight_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.enable_lora:
            if self.task == "embed":
                raise ValueError("LoRA adapters are served for generation, not embeddings (--task embed)")
            if min(self.max_loras, self.max_lora_rank) < 1:
                raise ValueError("max_loras and max_lora_rank must be at least 1")
            self.max_cpu_loras = max(self.max_cpu_loras or self.max_loras, self.max_loras)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


GPU_TOKEN_BUDGET = 8192
# Every running request waits for each step. A GPU's step time hardly grows with its tokens until
# thousands; a CPU's grows from the first (it is compute-bound), so its budget keeps a step of a
# small model to a few tenths of a second, and a short request beside a long prompt's chunks
# gets a token at that pace rather than after the whole prefill.
CPU_TOKEN_BUDGET = 64
# `kvship serve`'s prefill_join_tokens: under a burst, prompts finish one a step rather than all
# at the end of one long step (median time to first token down, the burst's last ones later).
SERVE_PREFILL_JOIN_TOKENS = 512
# `LLM`'s schedule_policy: an offline batch ends with its last sequence, and starting the longest
# outputs first leaves short ones for the end (`kvship serve` keeps shortest-prefill, for TTFT).
OFFLINE_SCHEDULE_POLICY = "longest-output"


def default_token_budget(device_type: str) -> int:
    """max_num_batched_tokens when it is not set: by the device the engine runs on."""
    return GPU_TOKEN_BUDGET if device_type == "cuda" else CPU_TOKEN_BUDGET


# A CPU step of the bundled model costs a few ms a token: with 8 prompt tokens beside them (a
# step then stays on the weight-only kernels' rows), decodes keep a pace near their own while a
# long prompt's prefill goes on. A GPU's step costs about the same up to thousands of tokens.
CPU_PREFILL_BESIDE_DECODES = 8


def default_prefill_beside_decodes(device_type: str, token_budget: int) -> int:
    """prefill_beside_decodes when it is not set: by the device the engine runs on."""
    return token_budget if device_type == "cuda" else min(token_budget, CPU_PREFILL_BESIDE_DECODES)
