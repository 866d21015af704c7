"""Runs the model on a batch: packs it into flat tensors, runs the forward pass and launches the
sampling of the sequences whose prompt is complete. The step's result stays on the device (an
InFlightStep) while the host goes on; the next step can take its tokens as inputs there."""
from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch
from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

from kvship.config import EngineConfig, default_prefill_beside_decodes, default_token_budget
from kvship.kernels import kv_quant as kvq
from kvship.kernels._triton import HAS_TRITON, track_compiles, watch_compiles
from kvship.kernels.graph_inputs import InFlightInputs
from kvship.kernels.paged_attention import PREFILL_TILE_LENGTHS
from kvship.layers.attention import AttentionMetadata
from kvship.loader import Pooling
from kvship.models.config import ModelConfig
from kvship.models.registry import model_class
from kvship.outputs import TokenLogprob
from kvship.parallel import SINGLE, TPContext
from kvship.runner.cpu_setup import set_cpu_threads, weight_format
from kvship.runner.cuda_graph import DecodeGraphs
from kvship.runner.dummy_weights import dummy_weights
from kvship.runner.lora_manager import LoRAManager
from kvship.runner.model_setup import resolve_backend, resolve_device, resolve_dtype
from kvship.runner.sampler import PendingSample, Sampler, SamplerOutput, SamplerRow
from kvship.runner.verify_graphs import VerifyGraphs, verify_graph_max_batch
from kvship.sequence import Batch, Sequence

log = logging.getLogger(__name__)

KV_SCALE_TOKENS = 256  # the start-up prefill that measures FP8 scales a checkpoint lacks
# ... and the seed of its random tokens: fixed, not --seed (the sampling's): a cache's quality
# should not change with the seed a user picks for sampling.
KV_SCALE_SEED = 0
# The batch cap when --max-num-seqs is not given: as many sequences as the KV cache holds at
# AUTO_SEQ_TOKENS each (the context, if shorter), a multiple of 16 (the decode graphs' sizes),
# within [AUTO_MIN_SEQS, AUTO_MAX_SEQS]. Preemption handles sequences that outgrow it.
AUTO_MIN_SEQS, AUTO_MAX_SEQS, AUTO_SEQ_TOKENS = 256, 1024, 2048


def auto_max_num_seqs(cache_tokens: int, max_model_len: int) -> int:
    n = cache_tokens // min(max_model_len, AUTO_SEQ_TOKENS) // 16 * 16
    return max(AUTO_MIN_SEQS, min(AUTO_MAX_SEQS, n))


@dataclass
class PrefillMeta:
    positions: torch.Tensor
    attention: AttentionMetadata


@dataclass(eq=False)
class InFlightStep:
    """A launched step: the sequences that sample a token in it, where each token will go in its
    sequence, and the sample, still on the device until ``result()``."""

    batch: Batch
    sampled: list[Sequence]
    positions: list[int]  # index in seq.token_ids that each sampled token will take
    sample: PendingSample | None  # None: no sequence completed its prompt in this step (or not sampled yet)
    logits: torch.Tensor | None = None  # between start() and sample(): the sampled rows' logits

    def __post_init__(self) -> None:
        self.rows = {seq: i for i, seq in enumerate(self.sampled)}  # sequence -> row of the sample
        self.last = [False] * len(self.sampled)  # the token ends its sequence (set by the engine at launch)

    @property
    def tokens(self) -> torch.Tensor:
        """The sampled tokens on the device (the next step's decode inputs)."""
        return self.sample.tokens

    def result(self) -> SamplerOutput | None:
        """Waits for the copy of the sampled tokens (and logprobs) to the host."""
        return None if self.sample is None else self.sample.result()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, tp: TPContext = SINGLE):
        """``weights``: the checkpoint's (name, lazy tensor) pairs; None for random weights
        (config.load_format "dummy"), the same ones at every tensor-parallel size."""
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":  # the variants start-up compiles, for the log of later ones
            track_compiles()
        if config.max_num_batched_tokens is None:  # the step's token budget depends on the device
            config.max_num_batched_tokens = default_token_budget(self.device.type)
        if config.prefill_beside_decodes is None:
            config.prefill_beside_decodes = default_prefill_beside_decodes(self.device.type,
                                                                           config.max_num_batched_tokens)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len = config.max_model_len
        self.tp = tp
        if config.calculate_kv_scales and config.kv_cache_dtype not in kvq.FP8_DTYPES:
            raise ValueError("--calculate-kv-scales measures FP8 scales: it needs --kv-cache-dtype fp8, "
                             "fp8_e4m3 or fp8_e5m2")

        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            # An engine dropped earlier in this process may still be waiting for the cycle
            # collector: free it now, or the KV cache sized below counts its memory as taken.
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)  # for the loading peak logged below
        allocated_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        build = model_class(model_config)
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build(model_config, max_model_len, tp, self.backend)
        finally:
            torch.set_default_dtype(torch.float32)
        if weights is None:
            weights = dummy_weights(build, model_config, max_model_len, self.backend, config.seed, self.dtype, self.device)
        else:
            weights = tqdm(weights, desc="Loading weights", unit=" tensors", leave=False)
        self.model.load_weights(weights, need_lm_head=config.task != "embed")
        _drop_weight_loaders(self.model)
        self.lora = self._wrap_lora() if config.enable_lora else None  # before the KV cache: its slots take memory
        # Weights go straight into the tensors the model was built with, one checkpoint tensor at a
        # time (in-situ quantization holds one 16-bit matrix more): the peak should stay near them.
        self.weight_bytes = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        self.loading_peak_bytes = 0
        if self.device.type == "cuda":
            self.loading_peak_bytes = torch.cuda.max_memory_allocated(self.device) - allocated_before
            log.info("weights: %.2f GiB on the GPU, %.2f GiB at the peak of loading",
                     self.weight_bytes / 2**30, self.loading_peak_bytes / 2**30)
        self.model.eval()
        self.sampler = Sampler()
        # before the KV cache: their memory counts
        self.num_state_slots, self.num_state_checkpoints = self._bind_recurrent_state()
        self._verify_rows: dict[Sequence, tuple[int, int]] = {}  # the last verify's (first state row, proposals)
        self._rollbacks: list[tuple[int, int]] = []  # state copies the other tensor-parallel ranks make next step
        self.num_blocks = self._allocate_kv_cache()
        if self.device.type == "cpu":
            self._set_up_cpu()
        if config.max_num_seqs is None:  # resolved here for the scheduler, the server and every rank alike
            config.max_num_seqs = auto_max_num_seqs(self.num_blocks * self.block_size, max_model_len)
            log.info("max_num_seqs %d, from the KV cache's %d tokens (%d a sequence, %d to %d)", config.max_num_seqs,
                     self.num_blocks * self.block_size, min(max_model_len, AUTO_SEQ_TOKENS), AUTO_MIN_SEQS,
                     AUTO_MAX_SEQS)
        if self.device.type == "cuda":
            self._compile_prefill_tiles()
        self.graphs: DecodeGraphs | None = None
        # an MTP proposer (core/mtp.py) reads every forward's hidden states: take_hidden()
        spec = config.speculative_config
        self.keep_hidden = spec is not None and spec.method == "mtp"
        self._hidden: torch.Tensor | None = None
        # graphs: decode only; routed experts only through the fused Triton path (the torch one
        # syncs with the host and its shapes follow the routing), and none with --attention-backend
        # torch (the torch attention reference syncs with the host too)
        if self.device.type == "cuda" and not config.enforce_eager and config.task != "embed" \
                and self.backend != "torch" \
                and (HAS_TRITON or not (model_config.num_experts or self.lora)) and self.model.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, min(config.max_num_seqs, AUTO_MAX_SEQS),
                                       -(-max_model_len // self.block_size), self.device,
                                       self.num_state_slots if self.num_state_slots else None, self.keep_hidden,
                                       None if self.lora is None else self.lora.batch)
            self.graphs.capture()
        self.verify_graphs = self._capture_verify_graphs()
        self.measuring_kv_scales = self._set_up_kv_scales()  # after the runs above: real prefills only
        if self.device.type == "cuda":  # what start-up did not compile, a step waits for
            watch_compiles(_log_compile)

    def _capture_verify_graphs(self) -> VerifyGraphs | None:
        """Beside the decode graphs, in their memory pool, graphs for speculative verify steps;
        none with LoRA (its per-token adapter rows follow the unpadded layout) or a hybrid model."""
        spec, c = self.config.speculative_config, self.config
        if self.graphs is None or spec is None or self.lora is not None or self.num_state_slots:
            return None
        max_bs = verify_graph_max_batch(spec.num_speculative_tokens, spec.disable_by_batch_size, c.max_num_seqs)
        if max_bs < 1:
            return None
        graphs = VerifyGraphs(self.model, max_bs, spec.num_speculative_tokens + 1, self.max_model_len,
                              self.block_size, self.device, self.keep_hidden)
        graphs.capture(self.graphs.pool)
        return graphs

    def _wrap_lora(self) -> LoRAManager:
        c = self.config
        if c.task == "embed":  # "auto" resolved to it (a sentence-transformers folder)
            raise ValueError("LoRA adapters are served for generation, not embeddings (--task embed)")
        return LoRAManager(self.model, self.model_config, c.max_loras, c.max_lora_rank, c.max_cpu_loras,
                           max(c.max_num_batched_tokens, KV_SCALE_TOKENS, AUTO_MAX_SEQS), self.dtype, self.device)

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (before tearing down the communicators captured in them)."""
        if self.graphs is not None:
            self.graphs = self.verify_graphs = None
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Give back what the runner holds on its device: the graphs and their memory pool, the
        KV cache, the weights and the sampler's caches. Tensors are emptied in place, so that a
        reference someone kept to the model or a layer holds no device memory either. The
        runner runs nothing afterwards."""
        self.release_graphs()
        model, self.model = getattr(self, "model", None), None
        self.sampler = None
        if model is not None:
            with torch.no_grad():
                for module in model.modules():
                    for p in module._parameters.values():
                        if p is not None:
                            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    for name in list(module._buffers):
                        module._buffers[name] = None
                    for name, value in list(vars(module).items()):
                        if isinstance(value, torch.Tensor):  # KV caches, rotary tables, scales
                            setattr(module, name, None)

    # -- KV cache ----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Every layer's cache for one block: its keys and values, or keys alone (multi-head
        latent attention: one row of latent and rope key a token, layers/attention.py)."""
        return sum(attn.num_kv_heads * kvq.bytes_per_block_head(self.config.kv_cache_dtype, attn.head_dim, self.dtype,
                                                                self.block_size, attn.cache_values)
                   for attn in self.model.attention_layers())

    def _num_blocks_to_allocate(self) -> int:
        c = self.config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if c.kv_cache_memory:
            return max(1, c.kv_cache_memory // per_block)
        if self.device.type == "cuda":
            return self._blocks_that_fit_on_gpu(per_block)
        # CPU: enough for max_num_seqs full contexts, capped at 1 GiB.
        want = (c.max_num_seqs or AUTO_MIN_SEQS) * -(-self.max_model_len // self.block_size)
        return max(1, min(want, (1 << 30) // per_block))

    @torch.inference_mode()
    def _blocks_that_fit_on_gpu(self, per_block: int) -> int:
        """Run the largest step we will ever run (a full token budget) against a throw-away
        cache, measure the peak, and give KV what --gpu-memory-utilization leaves."""
        c, dev = self.config, self.device
        tokens = min(c.max_num_batched_tokens, self.max_model_len * (c.max_num_seqs or AUTO_MAX_SEQS))
        seq_len = min(tokens, self.max_model_len)
        num_seqs = -(-tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._bind_kv_cache(num_seqs * blocks_per_seq)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.randint(0, self.model_config.vocab_size, (num_seqs * seq_len,), device=dev)
        meta = self._prefill_meta(num_seqs, seq_len)
        self.model.compute_logits(self.model(ids, meta.positions, meta.attention)[meta.attention.logits_indices])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        self._bind_kv_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        others = total - free - torch.cuda.memory_allocated(dev)  # other processes, CUDA context
        vocab = self.model_config.vocab_size

        spec = c.speculative_config
        verify_rows = 0 if spec is None or c.enforce_eager else (spec.num_speculative_tokens + 1) * \
            verify_graph_max_batch(spec.num_speculative_tokens, spec.disable_by_batch_size, c.max_num_seqs or AUTO_MAX_SEQS)

        def reserve(rows: int) -> int:
            """Sampling a full batch (float32 logits and a few temporaries of that size), the
            decode graphs' pool (their activations, shared logits and the 16-bit ones before) and
            the verify graphs' logits and hidden states."""
            graphs = (512 << 20) + 6 * rows * vocab + 6 * verify_rows * vocab
            return 16 * rows * vocab + (0 if c.enforce_eager else graphs)

        budget = total * c.gpu_memory_utilization - others - peak
        rows = c.max_num_seqs or auto_max_num_seqs(
            int(max(0, budget - reserve(AUTO_MIN_SEQS)) // per_block) * self.block_size, self.max_model_len)
        budget -= reserve(rows)  # the cap chosen from the cache that is left is at most rows
        if budget < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: weights and activations take {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB; raise --gpu-memory-utilization, lower --max-num-batched-tokens, "
                "or use more GPUs (--tensor-parallel-size)")
        return int(budget // per_block)

    def _prefill_meta(self, num_seqs: int, seq_len: int) -> "PrefillMeta":
        """A step that prefills num_seqs sequences of seq_len tokens from position 0 into the
        cache's first blocks, one sequence after another (start-up runs only: the blocks are
        not the block manager's yet)."""
        dev = self.device
        blocks_per_seq = -(-seq_len // self.block_size)
        tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=dev).view(num_seqs, -1)
        slots = (tables.long().repeat_interleave(self.block_size, 1) * self.block_size
                 + torch.arange(self.block_size, device=dev).repeat(blocks_per_seq))[:, :seq_len].reshape(-1)
        meta = AttentionMetadata(slots, tables, torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev),
                                 torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32, device=dev),
                                 seq_len, torch.arange(num_seqs, device=dev) * seq_len + seq_len - 1)
        return PrefillMeta(torch.arange(seq_len, device=dev).repeat(num_seqs), meta)

    @torch.inference_mode()
    def _compile_prefill_tiles(self) -> None:
        """A prompt of each of PREFILL_TILE_LENGTHS (up to the model's length) into the cache's
        first blocks: attention's query tiles for short steps compile now, not in a serving step;
        with LoRA, again through the adapters' prefill kernels (slot 0, still zeros: it adds
        nothing). Start-up only: the blocks are nobody's yet (a cached prefix's would be overwritten)."""
        for seq_len in PREFILL_TILE_LENGTHS:
            if seq_len > min(self.max_model_len, self.num_blocks * self.block_size):
                break
            meta = self._prefill_meta(1, seq_len)
            for slot in (-1,) if self.lora is None else (-1, 0):
                if self.lora is not None:
                    self.lora.write_slots([slot] * seq_len, prefill=True)
                self.model(torch.zeros(seq_len, dtype=torch.long, device=self.device), meta.positions, meta.attention)
        if self.lora is not None:
            self.lora.write_slots([], prefill=False)  # each step sets its own
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _bind_kv_cache(self, num_blocks: int, layers: list | None = None) -> None:
        """``layers``: attention layers outside the model's stack (an MTP layer's, core/mtp.py)."""
        for attn in self.model.attention_layers() if layers is None else layers:
            attn.bind_kv_cache(*kvq.allocate(self.config.kv_cache_dtype, num_blocks, self.block_size,
                                             attn.num_kv_heads, attn.head_dim, self.dtype, self.device,
                                             values=attn.cache_values))

    def _bind_recurrent_state(self) -> tuple[int, int]:
        """A hybrid model's recurrent-state slots (models/qwen3_next.py), one per sequence that may
        run, and its state checkpoints for the prefix cache (core/state_checkpoints.py; a
        quarter as many as the slots unless --num-state-checkpoints says: a large model's slot
        is over a hundred MiB); (0, 0) for other models. On a GPU they take at most half of
        what the weights leave, scaled down together when that is too little, and fewer slots
        than --max-num-seqs lower it (the scheduler then runs no more). Tensor rows: the
        sequences' slots, the decode graphs' scratch slot (their padding rows' state), the
        checkpoints, then with speculative decoding k rows for each sequence a verify may hold
        (the states after its proposals, layers/gated_delta.py)."""
        if not hasattr(self.model, "bind_state"):
            return 0, 0
        c = self.config
        if c.max_num_seqs is None:  # the slots come before the cache: no cap from its size
            c.max_num_seqs = AUTO_MIN_SEQS
        per_slot, slots = self.model.state_bytes_per_slot(self.dtype), c.max_num_seqs
        checkpoints = (max(1, slots // 4) if c.num_state_checkpoints is None else c.num_state_checkpoints) \
            if c.enable_prefix_caching else 0
        spec = c.speculative_config
        k = self.spec_rows_per_seq = spec.num_speculative_tokens if spec is not None else 0
        verified = spec.disable_by_batch_size if spec is not None else 0  # the most sequences a verify holds

        def spec_rows(n: int) -> int:
            return min(n, verified) * k
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1] * c.gpu_memory_utilization
            fit = int((total - torch.cuda.memory_allocated(self.device)) / 2 // per_slot) - 1
            want = slots + checkpoints + spec_rows(slots)
            if want > fit:
                checkpoints = checkpoints * max(0, fit) // want
                room = fit - checkpoints  # the slots with their verify rows
                most = room // (1 + k) if room // (1 + k) <= verified else room - verified * k
                slots = max(1, min(slots, most))
        # every rank numbers the same rows: the scratch slot and the checkpoints follow the slots
        slots, checkpoints = self.tp.min_int(slots), self.tp.min_int(checkpoints)
        if slots < c.max_num_seqs:
            log.warning("recurrent state: %d slots of %.1f MiB fit in half the memory left: --max-num-seqs "
                        "lowered from %d to %d", slots, per_slot / 2**20, c.max_num_seqs, slots)
            c.max_num_seqs = slots
        if c.enable_prefix_caching and not checkpoints:
            log.warning("prefix caching is off: no memory left for recurrent-state checkpoints")
            c.enable_prefix_caching = False
        self.first_spec_row, rows = slots + 1 + checkpoints, spec_rows(slots)
        self.model.bind_state(self.first_spec_row + rows, self.dtype, self.device)
        log.info("recurrent state: %d slots, %d prefix-cache checkpoints and %d rows for verified proposals of "
                 "%.1f MiB (%.2f GiB)", slots, checkpoints, rows, per_slot / 2**20,
                 (self.first_spec_row + rows) * per_slot / 2**30)
        return slots, checkpoints

    @property
    def state_checkpoint_slots(self) -> range:
        """The state tensors' rows that hold prefix-cache checkpoints (after the scratch slot)."""
        return range(self.num_state_slots + 1, self.num_state_slots + 1 + self.num_state_checkpoints)

    def copy_states(self, copies: list[tuple[int, int]] | torch.Tensor) -> None:
        """A hybrid model's state copies, (from slot, to slot) pairs (Batch.state_restores and
        state_checkpoints; a tensor-parallel rank receives them as an [n, 2] tensor)."""
        if len(copies):
            src, dst = torch.as_tensor(copies, device=self.device).T
            self.model.copy_state_slots(src, dst)

    @torch.inference_mode()
    def _set_up_cpu(self) -> None:
        """The intra-op threads (--cpu-threads, else the fastest count for a one-token step, which
        writes only the cache's first slot before any request owns it), and the start-up line
        naming them with the compute dtype and what the weights are stored as."""
        meta = self._prefill_meta(1, 1)
        ids = torch.zeros(1, dtype=torch.long)

        def step() -> torch.Tensor:
            hidden = self.model(ids, meta.positions, meta.attention)
            return hidden if self.config.task == "embed" else self.model.compute_logits(hidden[meta.attention.logits_indices])

        if self.tp.size > 1 and self.config.cpu_threads is None:  # the launcher split the cores between the ranks
            threads = f"threads {torch.get_num_threads()} a tensor-parallel rank"
        else:
            threads = set_cpu_threads(self.config.cpu_threads, step)
        log.info("CPU: %s; compute %s; weights %s", threads, str(self.dtype).removeprefix("torch."),
                 weight_format(self.model))

    def keep_accepted_states(self, accepted: list[tuple[Sequence, int]]) -> None:
        """After a hybrid model's verify: each sequence (seq, number of its proposals accepted)
        takes the state after its last accepted token, the rejected ones' updates dropped (the
        step left the state after its last proposal in the slot)."""
        copies = []
        for seq, n in accepted:
            first, proposed = self._verify_rows.get(seq, (0, 0))
            if n < proposed:
                copies.append((first + n, seq.state_slot))
        self._verify_rows = {}
        self.copy_states(copies)
        if self.tp.runtime is not None:  # the other ranks copy before their next forward (run)
            self._rollbacks += copies

    def _allocate_kv_cache(self) -> int:
        n = self.tp.min_int(self._num_blocks_to_allocate())  # every rank holds the same block count
        self._bind_kv_cache(n)
        log.info("KV cache (%s): %d blocks of %d tokens = %d tokens (%.2f GiB)", self.config.kv_cache_dtype, n,
                 self.block_size, n * self.block_size, n * self.kv_bytes_per_block() / 2**30)
        return n

    def _set_up_kv_scales(self) -> bool:
        """What a quantized cache measures before it serves; True while FP8 scales are still to
        be measured (on the first prefill, --calculate-kv-scales). FP8 layers without a
        checkpoint's scales measure theirs now, on a prefill of random tokens: one scale for
        every layer (vLLM's 1.0) puts small values into e4m3's subnormals and saturates large
        ones. (int4 measures nothing: its scales are each block's own.)"""
        layers = self.model.attention_layers()
        if self.config.kv_cache_dtype not in kvq.FP8_DTYPES:
            return False
        if self.config.calculate_kv_scales:
            for attn in layers:
                attn.measure_kv_scales = True
            log.info("FP8 KV cache: k/v scales will be measured on the first prefill")
            return True
        missing = [attn for attn in layers if not attn.kv_scales_from_checkpoint]
        if missing:
            self._measure_kv_scales(missing)
        return False

    @torch.inference_mode()
    def _measure_kv_scales(self, layers: list) -> None:
        """FP8 scales for ``layers`` from one prefill of KV_SCALE_TOKENS
        random tokens drawn from KV_SCALE_SEED (the same on every tensor-parallel rank, so the
        collectives match) into a throw-away cache: they do not depend on the cache's size, and
        the cache is left as it was, nor on the step's token budget (a CPU's is small)."""
        seq_len = min(KV_SCALE_TOKENS, self.max_model_len)
        ids = torch.randint(0, self.model_config.vocab_size, (seq_len,),
                            generator=torch.Generator().manual_seed(KV_SCALE_SEED)).to(self.device)
        meta = self._prefill_meta(1, seq_len)
        caches = [(attn, attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale) for attn in self.model.attention_layers()]
        self._bind_kv_cache(meta.attention.block_tables.numel())
        for attn in layers:
            attn.measure_kv_scales = True
        self.model(ids, meta.positions, meta.attention)
        for attn, *cache in caches:
            attn.bind_kv_cache(*cache)
        # each rank saw its own heads: a layer's scales become the largest over the ranks, as one
        # rank holding every head measures them, so that the cache means the same at any TP size
        both = self.tp.all_max(torch.stack([s for attn in layers for s in (attn.fp8_k_scale, attn.fp8_v_scale)]))
        for attn, (k, v) in zip(layers, both.view(-1, 2, 1)):
            attn.fp8_k_scale.copy_(k)
            attn.fp8_v_scale.copy_(v)
        k = [float(attn.fp8_k_scale) for attn in layers]
        v = [float(attn.fp8_v_scale) for attn in layers]
        log.warning("FP8 KV cache: no k/v scales in the checkpoint for %d layers; measured on %d random tokens "
                    "(largest at 1/%g of the format's range): k %.3g to %.3g, v %.3g to %.3g (--calculate-kv-scales "
                    "measures them on the first prefill instead)", len(layers), seq_len, kvq.FP8_HEADROOM,
                    min(k), max(k), min(v), max(v))

    # -- one step ----------------------------------------------------------------------------
    def launch(self, batch: Batch, previous: InFlightStep | None = None) -> InFlightStep:
        """Start the step on the device and return at once: the forward pass, then the sampling
        of every sequence whose prompt is complete after this step. A sampling row's penalties
        count the sequence's known tokens, so the caller reads ``previous`` first for those."""
        return self.sample(self.start(batch, previous))

    def start(self, batch: Batch, previous: InFlightStep | None = None) -> InFlightStep:
        """The first half of launch(): the forward pass only. The caller may do host work that
        the sampling needs (a grammar's bitmask, which needs the previous token) while the
        device computes, then call sample()."""
        logits = self.run(batch, previous)
        sampled, positions = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            end = seq.num_computed_tokens + n
            if end >= seq.num_tokens:  # every token is computed (a decode's input may be in flight)
                sampled.append(seq)
                positions.append(end)
        return InFlightStep(batch, sampled, positions, None, logits if sampled else None)

    def sample(self, step: InFlightStep, allowed: torch.Tensor | None = None) -> InFlightStep:
        """The second half of launch(): queue the sampling of a started step (``allowed``: the
        grammar bitmask of its sampled rows, see Sampler.launch)."""
        if step.logits is None:
            return step
        rows = [SamplerRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, (s.request_id, s.index))
                if s.params.uses_penalties else SamplerRow(s.params, (), (), s.generator) for s in step.sampled]
        step.sample, step.logits = self.sampler.launch(step.logits, rows, allowed), None
        return step

    def prepare(self, batch: Batch, previous: InFlightStep | None = None, recurrent: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, InFlightInputs | None]:
        """The batch as flat device tensors, sent in two copies (one int64, one int32 buffer).
        A decode input the host does not know yet (sampled by ``previous``) is left 0 in the ids
        and named in the InFlightInputs returned beside them (None where there is none): a
        decode graph writes it in as it copies its inputs, every other path with ``fill``.
        ``recurrent`` False: a batch for attention layers only (an MTP layer's, core/mtp.py),
        whose sequences hold no recurrent-state slot."""
        seqs, num_new = batch.seqs, batch.num_new_tokens
        num_seqs, bs = len(seqs), self.block_size
        input_ids: list[int] = []
        logits_indices: list[int] = []
        fix_at: list[int] = []
        fix_rows: list[int] = []
        offset = 0  # where the sequence's tokens start in the batch
        for seq, n in zip(seqs, num_new):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            offset += n
            drafted = len(seq.draft_token_ids)  # proposed tokens to verify (core/speculative.py)
            if drafted:
                input_ids += seq.draft_token_ids
            elif start + n > seq.num_tokens:  # only a decode's single input can be in flight
                fix_at.append(offset - 1)
                fix_rows.append(previous.rows[seq])
                input_ids.append(0)
            if start + n >= seq.num_tokens:  # every token is computed: sample the next one (each proposal's too)
                logits_indices += range(offset - 1 - drafted, offset)
        # Positions and slots, a token each, from the rows' starts and block tables, in numpy.
        tables = _block_tables(seqs)
        lens = np.asarray(num_new)
        starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, num_seqs)
        seq_lens = starts + lens
        cu = np.zeros(num_seqs + 1, np.int64)
        lens.cumsum(out=cu[1:])  # array methods: numpy's function forms cost a wrapper call more
        row = np.arange(num_seqs).repeat(lens)  # each token's sequence
        positions = np.arange(cu[-1]) - cu[row] + starts[row]
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs

        dev = self.device
        pin = dev.type == "cuda"
        state = [s.state_slot for s in batch.seqs] if self.num_state_slots and recurrent else []
        if state and (None in state or max(state) >= self.num_state_slots):
            raise RuntimeError(f"recurrent-state slots {state} out of the {self.num_state_slots} allocated")
        spec_rows = self._spec_state_rows(batch) if state else []
        longs = _packed([input_ids, positions, slots, logits_indices, fix_at, fix_rows, state, spec_rows], np.int64,
                        pin, dev)
        ints = _packed([seq_lens, cu, tables.reshape(-1)], np.int32, pin, dev)
        ids, pos_t, slot_t, logit_t, fix_at_t, fix_rows_t, state_t, spec_t = longs
        lens_t, cu_t, tables_t = ints
        in_flight = InFlightInputs(fix_at_t, fix_rows_t, previous.tokens) if fix_at else None
        meta = AttentionMetadata(slot_mapping=slot_t, block_tables=tables_t.view(tables.shape), seq_lens=lens_t,
                                 cu_seqlens_q=cu_t, max_seqlen_q=max(batch.num_new_tokens), logits_indices=logit_t,
                                 num_decodes=batch.num_decodes, state_slots=state_t if state else None,
                                 spec_state_rows=spec_t if spec_rows else None)
        return ids, pos_t, meta, in_flight

    def _spec_state_rows(self, batch: Batch) -> list[int]:
        """A verify's state rows (AttentionMetadata.spec_state_rows): k after the checkpoints for
        each sequence with proposals, -1 for the others; [] when none has proposals. Remembered
        for keep_accepted_states."""
        rows, self._verify_rows = [], {}
        for seq in batch.seqs:
            if seq.draft_token_ids:
                first = self.first_spec_row + len(self._verify_rows) * self.spec_rows_per_seq
                self._verify_rows[seq] = (first, len(seq.draft_token_ids))
                rows.append(first)
            else:
                rows.append(-1)
        return rows if self._verify_rows else []

    @torch.inference_mode()
    def run(self, batch: Batch, previous: InFlightStep | None = None) -> torch.Tensor:
        """Float32 logits [num_sampled, vocab] for the sequences whose prompt is complete (and,
        for sequences that asked, prompt logprobs appended to seq.prompt_logprobs); a hybrid
        model's state checkpoints restored before the forward and saved after it."""
        self.copy_states(batch.state_restores)
        logits = self._run(batch, previous)
        self.copy_states(batch.state_checkpoints)
        return logits

    def _run(self, batch: Batch, previous: InFlightStep | None) -> torch.Tensor:
        input_ids, positions, meta, in_flight = self.prepare(batch, previous)
        if self.lora is not None:
            self.lora.prepare(batch)
        wanted = self._prompt_logprob_rows(batch)
        if in_flight is not None and (wanted or self.tp.runtime is not None):  # these run on the ids as sent
            input_ids, in_flight = in_flight.fill(input_ids), None
        if wanted:
            return self._forward_with_prompt_logprobs(input_ids, positions, meta, wanted)
        if self.tp.runtime is not None:  # the other ranks run the same forward on what rank 0 sends
            with self.tp.runtime.guard():
                restores, self._rollbacks = self._rollbacks + batch.state_restores, []
                self.tp.runtime.send_step(input_ids, positions, meta, (restores, batch.state_checkpoints),
                                          self.lora.take_message() if self.lora is not None else ([], []))
                return self.forward(input_ids, positions, meta)
        return self.forward(input_ids, positions, meta, in_flight)

    @torch.inference_mode()
    def embed(self, batch: Batch, pooling: Pooling) -> torch.Tensor:
        """Float32 embeddings [len(batch), hidden] of sequences whose whole prompt is in this
        batch (nothing computed before: mean pooling needs every token's hidden state)."""
        input_ids, positions, meta, _ = self.prepare(batch)  # nothing in flight without a previous step
        hidden = self.model(input_ids, positions, meta).float()
        lens = torch.tensor(batch.num_new_tokens, device=hidden.device)
        ends = lens.cumsum(0)
        if pooling.mode == "last":
            pooled = hidden[ends - 1]
        elif pooling.mode == "cls":
            pooled = hidden[ends - lens]
        else:  # mean
            rows = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
            pooled = torch.zeros(len(lens), hidden.shape[1], device=hidden.device).index_add_(0, rows, hidden)
            pooled /= lens[:, None]
        return torch.nn.functional.normalize(pooled, dim=-1) if pooling.normalize else pooled

    @staticmethod
    def _prompt_logprob_rows(batch: Batch) -> list[tuple[object, list[int], list[int]]]:
        """(sequence, flat rows, target tokens) for prompt positions whose logprob is still owed:
        row p's logits score prompt token p + 1."""
        out, offset = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None:
                first = max(start, len(seq.prompt_logprobs))
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    out.append((seq, [offset + p - start for p in range(first, last)], seq.token_ids[first + 1:last + 1]))
            offset += n
        return out

    def take_hidden(self) -> torch.Tensor | None:
        """With keep_hidden: the last forward's hidden states (the model's output, before the LM
        head), a row per input token in the batch's order; each is handed out once."""
        hidden, self._hidden = self._hidden, None
        return hidden

    def _forward_with_prompt_logprobs(self, input_ids, positions, meta, wanted) -> torch.Tensor:
        hidden = self.model(input_ids, positions, meta)
        self._hidden = hidden if self.keep_hidden else None
        rows = torch.tensor([r for _, rs, _ in wanted for r in rs], device=hidden.device)
        targets = torch.tensor([t for _, _, ts in wanted for t in ts], device=hidden.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        k = max(seq.params.prompt_logprobs for seq, _, _ in wanted)
        top = torch.topk(logprobs, k, dim=-1) if k else None
        top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
        i = 0
        for seq, _, ts in wanted:
            kk = seq.params.prompt_logprobs
            for t in ts:
                alts = [TokenLogprob(a, v) for a, v in zip(top_ids[i][:kk], top_vals[i][:kk])] if kk else []
                seq.prompt_logprobs.append((TokenLogprob(t, chosen[i]), alts))
                i += 1
        return self.model.compute_logits(hidden[meta.logits_indices]).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                in_flight: InFlightInputs | None = None) -> torch.Tensor:
        # FP8 scales to measure: eagerly, as the layers measure in their Python forward
        if self.graphs is not None and not self.measuring_kv_scales and self.graphs.can_run(
                meta.seq_lens.shape[0], meta.max_seqlen_q, meta.block_tables.shape[1]):
            logits = self.graphs.run(input_ids, positions, meta, in_flight)
            if self.keep_hidden:  # a copy: the next replay overwrites the graphs' buffer
                self._hidden = self.graphs.hidden[:input_ids.shape[0]].clone()
            return logits
        verify = self.verify_graphs
        if verify is not None and not self.measuring_kv_scales and verify.can_run(meta, positions):
            logits = verify.run(input_ids, positions, meta, in_flight)
            if self.keep_hidden:  # gathered: a copy
                self._hidden = verify.hidden[verify.padded_rows]
            return logits
        if in_flight is not None:
            input_ids = in_flight.fill(input_ids)
        hidden = self.model(input_ids, positions, meta)
        self._hidden = hidden if self.keep_hidden else None
        self.measuring_kv_scales = False
        return self.model.compute_logits(hidden[meta.logits_indices]).float()


def _drop_weight_loaders(model: torch.nn.Module) -> None:
    """Each parameter's weight_loader is a bound method of its layer, which holds the parameter:
    a reference cycle per layer that only the cycle collector frees, keeping a dropped model's
    weights on the device until it runs. Loading is over: break them."""
    for p in model.parameters():
        if "weight_loader" in vars(p):
            del p.weight_loader


def _log_compile(name: str, seconds: float, new: str) -> None:
    log.log(logging.WARNING if seconds >= 0.1 else logging.INFO,
            "Triton kernel %s compiled in %.0f ms, for arguments this process had not launched it with (%s; a "
            "running engine's step waited, or another engine starting in the process compiled its own)", name,
            seconds * 1e3, new or "its first variant here, or one compiled again for another device")


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    """[len(seqs), most blocks] int32: each sequence's block numbers by position, 0-padded. A
    sequence's row is made again only when its block table changed (a block every block_size
    decode steps): converting every table's Python ints each step cost more than the rest."""
    rows = []
    for s in seqs:
        kept = s.block_row
        if kept is None or kept[0] is not s.block_table or kept[1] != s.num_released_blocks:
            kept = s.block_row = (s.block_table, s.num_released_blocks, _block_row(s))
        rows.append(kept[2])
    tables = np.zeros((len(seqs), max(map(len, rows))), dtype=np.int32)
    for i, row in enumerate(rows):
        tables[i, :len(row)] = row
    return tables


def _block_row(seq: Sequence) -> np.ndarray:
    # Blocks a window model's sequence gave back (core/kv_cache_manager.py) are still loaded,
    # then masked: the torch path gathers the whole table, the Triton kernels the tile holding
    # the window's first position. Their entries name the sequence's first held block rather
    # than the given-back one, which may hold another request's values by now: a masked key
    # still weighs 0 times its value, and a value that is not finite (an fp16 overflow
    # elsewhere) would turn that into NaN.
    r = seq.num_released_blocks
    return np.array(seq.block_table[:1] * r + seq.block_table, dtype=np.int32)


def _packed(parts: list, dtype, pin: bool, device: torch.device) -> list[torch.Tensor]:
    """The parts as views of one device tensor, sent in one copy. Each part starts on a 16-byte
    boundary: Triton specializes kernels on pointer alignment, so unaligned views would compile
    new kernel variants (a second or more each) as batch sizes vary."""
    per16 = 16 // np.dtype(dtype).itemsize
    sizes = [len(p) for p in parts]
    # Python ints: slicing a tensor with numpy scalars costs several times more
    starts = list(itertools.accumulate((-(-n // per16) * per16 for n in sizes), initial=0))
    flat = np.zeros(starts[-1], dtype=dtype)
    for start, p, n in zip(starts, parts, sizes):
        flat[start:start + n] = p
    t = torch.from_numpy(flat)
    t = (t.pin_memory() if pin else t).to(device, non_blocking=True)
    return [t[start:start + n] for start, n in zip(starts, sizes)]
