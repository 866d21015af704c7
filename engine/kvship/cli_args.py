"""The `kvship serve` arguments, on their own: standard library only (no torch), so that the
operator checks an LLMDeployment's `engine.args` with the very parser the engine uses."""
from __future__ import annotations

import argparse
import re

from kvship import envs
from kvship.config import CPU_WEIGHT_FORMATS, SCHEDULE_POLICIES, SERVE_PREFILL_JOIN_TOKENS
from kvship.speculative_config import SpeculativeConfig

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2e9', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 2000000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def _speculative_json(text: str) -> str:
    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", default=None,
                   help="hub id, local folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--model", dest="model_opt", default=None, metavar="MODEL", help="same as the positional MODEL")
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    g.add_argument("--download-dir", default=None, help="where hub downloads go")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's own)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"],
                   help="weights and activations dtype")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--task", default="auto", choices=["auto", "generate", "embed"],
                   help="what the model serves: generate (completions, chat) or embed (/v1/embeddings); auto "
                        "(default): embed for a sentence-transformers folder (modules.json), else generate")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shapes (benchmarks; a config-only folder is enough)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8", "int8", "int4"],
                   help="quantize the weights while loading: fp8 (per-channel, W8A8 on GPUs with FP8), int8 "
                        "(per-channel, weight-only) or int4 (group 128, weight-only); a checkpoint that is "
                        "already quantized (FP8, GPTQ, AWQ, compressed-tensors, GGUF) needs no flag")
    g.add_argument("--cpu-weight-format", default="auto", choices=list(CPU_WEIGHT_FORMATS),
                   help="on a CPU, how quantized weights (a GGUF file such as the bundled model, a quantized "
                        "checkpoint, --quantization) are multiplied: auto (default: a checkpoint's 4-bit groups "
                        "as int4, anything else as int8 rows), int4 or int8 (everything requantized so), or "
                        "float32 (dequantized at load, the reference); the integer paths take bfloat16 inputs, "
                        "perplexity within 1%% of float32")
    g.add_argument("--seed", type=int, default=0, help="engine seed (requests without a seed draw from it)")
    g.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: requests that leave out temperature/top_p/top_k/min_p/repetition_penalty get the "
                        "model's generation_config.json values; none: the OpenAI defaults")

    g = p.add_argument_group("scheduling and memory")
    g.add_argument("--max-model-len", type=_positive_int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most sequences in a batch (default: from the KV cache's size, 256 to 1024)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="token budget per step (default: 8192 on a GPU, 64 on a CPU)")
    g.add_argument("--prefill-join-tokens", type=int, default=SERVE_PREFILL_JOIN_TOKENS,
                   help="once a prompt's prefill ends in a step, later prompts join it only while the step holds at "
                        "most this many tokens, so that prompts finish one a step, shortest first (default: "
                        f"{SERVE_PREFILL_JOIN_TOKENS}; the token budget or more: they share the whole step)")
    g.add_argument("--prefill-beside-decodes", type=int, default=None,
                   help="with decodes in a step, a long prompt (more than four steps' budgets left) takes at "
                        "most this many of its tokens, so running requests keep their pace during its prefill "
                        "(default: the whole budget on a GPU, 8 on a CPU)")
    g.add_argument("--schedule-policy", default="shortest-prefill", choices=SCHEDULE_POLICIES,
                   help="which waiting requests start first: the fewest prompt tokens left (time to first token) or "
                        "the most max_tokens (offline batches with varied lengths end sooner)")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block (power of two)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\' (docs/kv-cache.md)')
    g.add_argument("--num-state-checkpoints", type=int, default=None,
                   help="hybrid models (Qwen3.5, Qwen3-Next): recurrent-state checkpoints kept for prefix-cache hits "
                        "(default: one per 4 of --max-num-seqs; 0 turns their prefix cache off)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.90,
                   help="fraction of GPU memory the engine may use (weights + activations + KV cache)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for the KV cache, e.g. 4GiB (overrides --gpu-memory-utilization)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4"],
                   help="KV-cache storage: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2, or int4 "
                        "(4 bits with a scale and minimum: keys per channel over each block, values per group of "
                        "32 channels of a token)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV cache: measure the k/v scales on the first prefill instead of the "
                        "checkpoint's (or, without them, on random tokens at start-up)")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="exact number of KV-cache blocks")
    g.add_argument("--max-waiting-requests", type=_positive_int, default=1024,
                   help="queue length beyond which requests get 503 + Retry-After")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1, help="GPUs to shard the model over")
    g.add_argument("--tp-all-reduce", choices=["nccl", "one-shot", "fused"], default="fused",
                   help="all-reduce for small tensors between GPUs (fused: at TP=2 on one host the reduction, "
                        "residual add and RMSNorm in one kernel, NCCL otherwise; one-shot: peer loads over NVLink)")
    g.add_argument("--speculative-config", type=_speculative_json, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT, '
                        '"num_speculative_tokens": 4}; "disable_by_batch_size" (default 32) turns it off for '
                        'larger batches (docs/speculative.md)')
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch's intra-op threads on a CPU (default: 1, 2, 4, ... up to the cores, the fastest for "
                        "a decode step, timed at start)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="paged attention: torch forces the plain-torch reference kernels everywhere; auto "
                        "(default) and triton run the Triton kernels on a GPU (when triton is installed) and the "
                        "torch reference on a CPU")

    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) on the base model")
    g.add_argument("--max-loras", type=_positive_int, default=1,
                   help="adapters held on the device at once, each usable by any number of requests in a batch")
    g.add_argument("--max-lora-rank", type=_positive_int, default=16, help="the largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="adapters kept in host memory, least recently used out first (default: --max-loras)")


# The formats kvship.server.tools and kvship.server.reasoning parse (named here, where the CLI
# and the operator's validation of engine args both read them without importing the server).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "glm45", "harmony")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "harmony")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=envs.api_key(),
                   help="require this key as 'Authorization: Bearer KEY' on /v1/* (default: $KVSHIP_API_KEY)")
    g.add_argument("--no-chat-page", "--disable-chat-page", dest="chat_page", action="store_false",
                   help="do not serve the built-in chat page")
    g.add_argument("--max-prompts-per-request", type=_positive_int, default=256,
                   help="most prompts one /v1/completions request may carry (default: 256); a request is "
                        "admitted to the queue whole or refused whole")
    g.add_argument("--max-request-body-size", type=parse_size, default=8 * 2**20, metavar="SIZE",
                   help="largest request body accepted, e.g. 8MiB (default); larger ones get 413")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='accepted as vLLM takes it; tool_choice "auto" is always served (docs/tools.md)')
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model's own tool-call format: hermes (Qwen2.5/Qwen3, <tool_call> JSON), llama3_json "
                        "(Llama 3.x JSON calls), mistral ([TOOL_CALLS] JSON), glm45 (GLM-4.5+ <arg_key>/<arg_value>), "
                        "harmony (gpt-oss); "
                        "default: chosen from the chat template")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split the model's thinking from its answer: qwen3 or deepseek_r1 (<think>...</think>), "
                        "harmony (gpt-oss: the analysis channel, and its tool calls); the thinking goes to "
                        "message.reasoning_content")
    g.add_argument("--engine-process", action="store_true",
                   help="run the engine's step loop in a process of its own, beside the HTTP server's (each with "
                        "its own interpreter lock: more requests/s at many connections)")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="how much the server logs (default: info)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), each as name=path or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}'; a request's model names one")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
