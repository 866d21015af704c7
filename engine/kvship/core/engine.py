"""The synchronous engine: requests in, one step at a time, outputs out. Used directly by `LLM`
(offline) and driven from a thread by `AsyncEngine` (serving).

A step overlaps the host with the device: it schedules and launches step N+1, then, while the
device computes it, reads step N's tokens and turns them into outputs. So a decode's input is
the token step N sampled, still on the device; the scheduler and the runner are told which
sequences have one in flight (the previous step, passed as a value), and a sequence only ever
holds tokens whose values the host knows.
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from kvship.config import EngineConfig
from kvship.core.grammar import Grammars
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.core.kv_events import open_publisher
from kvship.core.output_processor import Accepted, OutputProcessor
from kvship.core.scheduler import Scheduler
from kvship.core.speculative import build_speculator, grammar_bitmask, roll_back, step_layout
from kvship.core.state_checkpoints import StateCheckpoints
from kvship.loader import DEFAULT_POOLING
from kvship.loader.lora_adapter import LoRAAdapterError
from kvship.lora_request import LoRARequest
from kvship.outputs import RequestOutput
from kvship.parallel import SINGLE
from kvship.runner.model_runner import InFlightStep, ModelRunner
from kvship.runner.model_setup import load_model
from kvship.runner.rejection import sample_and_verify
from kvship.runner.tp.launch import TPRuntime
from kvship.sampling_params import InvalidParamsError, SamplingParams
from kvship.sequence import Batch, Sequence

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source, self.model_config = load_model(config)
        self.tokenizer = source.tokenizer
        self.model_name = config.served_model_name or source.name
        self.max_model_len = config.max_model_len
        self.tp_runtime = TPRuntime.start(config) if config.tensor_parallel_size > 1 else None  # we are rank 0
        try:
            self.runner = ModelRunner(config, self.model_config,
                                      None if config.load_format == "dummy" else source.weights(),
                                      self.tp_runtime.ctx if self.tp_runtime else SINGLE)
        except BaseException:
            self.shutdown()
            raise
        if self.tp_runtime:
            self.tp_runtime.ready = True
        checkpoints = self.runner.state_checkpoint_slots
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 self.model_config.kv_window,
                                 StateCheckpoints(checkpoints.start, len(checkpoints)) if checkpoints else None)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_loras if config.enable_lora else None, config.prefill_join_tokens,
                                   config.schedule_policy, config.prefill_beside_decodes)
        self.kv_events = open_publisher(config.kv_events)
        if self.kv_events is not None:
            self.kv.events = []
        self.outputs = OutputProcessor(self.tokenizer)
        eos = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_id)
        eos |= set(_as_list(source.generation_config.get("eos_token_id")))
        self.eos_token_ids = eos
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, eos)
        self.sampling_defaults = sampling_defaults(source.generation_config) if config.generation_defaults else {}
        if self.sampling_defaults:
            log.info("sampling defaults from the model's generation config: %s", self.sampling_defaults)
        self.task = config.task  # "generate" or "embed" (load_model resolved "auto")
        self.pooling = (source.pooling or DEFAULT_POOLING) if self.task == "embed" else None
        self.in_flight: InFlightStep | None = None  # the last launched step, its tokens not read yet
        self.speculator = None
        if config.speculative_config is not None and self.task == "generate":
            try:
                self.speculator = build_speculator(config.speculative_config, config, self.model_config,
                                                   self.tokenizer, self.runner)
            except BaseException:
                self.shutdown()
                raise
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.lora_requests_total: dict[str, int] = {}  # adapter name -> requests submitted
        # What start-up left (modules, the model, the tokenizer) lives as long as the engine, yet
        # each full collection of the cycle collector scanned it again: a pause of a tenth of a
        # second among decode steps. Frozen, it is left out until shutdown() unfreezes it.
        gc.collect()
        gc.freeze()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    final_only: bool = False) -> None:
        """``arrival_time`` (time.monotonic()): when the request was accepted, if earlier than now
        (a server stamps it before the request waits for the engine). ``lora_request``: the
        adapter to run it with (read now if new: a bad one is refused here, not mid-step).
        ``final_only``: ``step`` returns the request's output once, finished (offline generate,
        which drops the ones before: not building them saves host time a step at large batches)."""
        if self.task != "generate":
            raise InvalidParamsError("this model serves embeddings (task embed), not completions", "model")
        if request_id in self.outputs.requests:
            raise InvalidParamsError(f"request id {request_id!r} is already in use", "request_id")
        self._check_prompt(prompt_token_ids, room=1)
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise InvalidParamsError("prompt logprobs are not available with tensor parallelism", "logprobs")
        if params.structured is not None:
            if params.ignore_eos:  # the grammar ends where end-of-text is allowed: past it nothing is constrained
                raise InvalidParamsError("ignore_eos cannot be combined with structured output", "ignore_eos")
            self.grammars.prepare(params.structured)  # compiled already when the server prepared it
        if lora_request is not None:
            self.add_lora(lora_request)
            name = lora_request.lora_name
            self.lora_requests_total[name] = self.lora_requests_total.get(name, 0) + 1
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(request_id, i, list(prompt_token_ids), params, leader=seqs[0] if seqs else None,
                           arrival_time=arrival, lora=lora_request)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            if params.structured is not None:
                seq.grammar = self.grammars.matcher(params.structured)
            seqs.append(seq)
        self.outputs.add(request_id, prompt_token_ids, params, seqs, arrival, final_only)
        for seq in seqs:
            self.scheduler.add(seq)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (kept in the host cache); InvalidParamsError naming what this
        engine cannot serve."""
        if self.runner.lora is None:
            raise InvalidParamsError("LoRA adapters are not enabled: start the engine with --enable-lora", "model")
        try:
            self.runner.lora.check(lora_request)
        except LoRAAdapterError as e:
            raise InvalidParamsError(str(e), "lora_path" if e.reason == "not_found" else "model") from None

    def _check_prompt(self, ids: list[int], room: int, param: str = "prompt") -> None:
        """Refuse a prompt that is empty, holds ids outside the vocabulary, or leaves fewer than
        `room` positions of the context (or of the whole KV cache, of which a window model's
        sequence holds only what its steps read) free."""
        n = len(ids)
        if n == 0:
            raise InvalidParamsError("the prompt is empty", param)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidParamsError(f"prompt token ids must be in [0, {vocab})", param)
        if n + room > self.max_model_len:
            raise InvalidParamsError(
                f"This model's maximum context length is {self.max_model_len} tokens; the input has {n} tokens"
                + (", leaving no room for a completion" if room else "") + ". Shorten it.", param)
        capacity = self.kv.num_blocks * self.kv.block_size
        chunk = self.config.max_num_batched_tokens if self.task == "generate" else n  # embed: whole prompts
        if self.kv.most_blocks_held(n + room, chunk) > self.kv.num_blocks:
            raise InvalidParamsError(f"the input ({n} tokens) does not fit in the KV cache ({capacity} tokens)", param)

    def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """The pooled embedding (float32, on the CPU) of each prompt. A prefill-only forward over
        the paged KV cache, which serves as scratch: prompts are batched up to the step's token
        budget (a longer one runs alone) and their blocks are freed at once."""
        if self.pooling is None:
            raise InvalidParamsError("this model serves completions (task generate), not embeddings", "model")
        for ids in prompts:
            self._check_prompt(ids, room=0, param="input")
        out: list[torch.Tensor] = []
        i = 0
        while i < len(prompts):
            batch = Batch()
            while i < len(prompts) and (not batch or batch.num_tokens + len(prompts[i]) <= self.config.max_num_batched_tokens):
                seq = Sequence(f"embed-{i}", 0, list(prompts[i]), _EMBED_PARAMS)
                if not self.kv.allocate(seq, seq.num_tokens):  # nothing else holds blocks in an embedding engine,
                    break  # but a batch of many long prompts can still outgrow the cache: run it in parts
                batch.add(seq, seq.num_tokens)
                i += 1
            try:
                out += list(self.runner.embed(batch, self.pooling).cpu())
            finally:
                for seq in batch.seqs:
                    self.kv.free(seq)
            self.prompt_tokens_total += batch.num_tokens
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop the request and free its blocks; returns its final output (finish_reason "abort"
        for the choices still running), or None if it is unknown or already finished. A token
        of it still in flight is dropped when read."""
        req = self.outputs.requests.get(request_id)
        if req is None:
            return None
        for c in req.choices:
            if c.out.finish_reason is None or not c.seq.finished:  # also one ended at launch, its last token in flight
                self.scheduler.finish(c.seq, "abort")
        if self.speculator is not None:
            self.speculator.forget([c.seq for c in req.choices])
        if self.in_flight is not None and not any(map(_expects, self.in_flight.sampled, self.in_flight.positions)):
            self.in_flight = None  # nothing in it is wanted: no need to read it
        return self.outputs.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def shutdown(self, release_memory: bool = True) -> None:
        """Stop the tensor-parallel ranks this engine started and, with ``release_memory``, give
        back its device memory (CUDA graphs and their pool, KV cache, weights): the engine
        serves nothing afterwards. Safe to call more than once, and on a half-built engine.
        ``release_memory=False`` (a finalizer) stops the ranks only: the model may still be
        referenced from outside and is freed with its last reference."""
        gc.unfreeze()  # what the engine leaves may be cycles: the collector sees them again
        runner = getattr(self, "runner", None)
        publisher, self.kv_events = getattr(self, "kv_events", None), None
        if publisher is not None:
            publisher.close()
        tp_runtime, self.tp_runtime = getattr(self, "tp_runtime", None), None
        if tp_runtime is not None:
            if runner is not None:
                runner.release_graphs()  # graphs hold NCCL work: drop them before the communicators
            tp_runtime.shutdown()
        if not release_memory:
            return
        self.in_flight = None
        speculator = getattr(self, "speculator", None)
        if speculator is not None:
            speculator.release()
        if runner is not None:
            runner.release()
        release_device_memory()

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch step N+1, then finish step N (``previous``) while the device computes it."""
        if self.speculator is not None and self.speculator.active(len(self.scheduler.running)):
            return self._speculative_step()
        t0 = time.perf_counter()
        previous, outputs = self.in_flight, []
        if previous is not None and must_read_before_scheduling(previous):
            previous, outputs = None, self._finish(previous)
        batch = self.scheduler.schedule(previous.rows if previous is not None else ())
        step = None
        if batch:
            layout = step_layout(batch) if self.speculator is not None else None
            step = self.runner.start(batch, previous)  # the device starts step N+1's forward
            self.scheduler.commit(batch)
            if layout is not None:
                self.speculator.observe(layout)
            if previous is not None and must_read_before_sampling(step):
                previous, outputs = None, outputs + self._finish(previous)
            step = self.runner.sample(step, self._grammar_bitmask(step))
            self._end_at_length(step)
        self.in_flight = step
        if previous is not None:
            outputs += self._finish(previous)  # the host finishes step N meanwhile
        for seq in batch.seqs:
            self.kv.cache_full_blocks(seq)  # after the read: a block's hash needs its tokens' values
        if not batch:
            outputs += self._unblock()
        self._publish_kv_events()
        if log.isEnabledFor(logging.DEBUG):  # what serving latency is made of, step by step
            log.debug("step: %d seqs, %d new tokens, %d waiting, %.1f ms", len(batch), batch.num_tokens,
                      len(self.scheduler.waiting), (time.perf_counter() - t0) * 1e3)
        return outputs

    def _speculative_step(self) -> list[RequestOutput]:
        """A step that verifies proposed tokens (core/speculative.py), run to its end: the next
        proposals need its tokens. Each sampling sequence keeps one to k + 1 tokens."""
        outputs = self._finish(self.in_flight) if self.in_flight is not None else []
        self.in_flight = None
        proposed = self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            for seq in proposed:
                seq.draft_token_ids = []
            outputs += self._unblock()
            self._publish_kv_events()
            return outputs
        layout = step_layout(batch)
        logits = self.runner.run(batch)
        self.scheduler.commit(batch)
        sampled = [seq for seq in batch.seqs if seq.num_computed_tokens >= seq.num_tokens]
        allowed = grammar_bitmask(self.grammars, sampled) if any(s.grammar is not None for s in sampled) else None
        verified = sample_and_verify(self.runner.sampler, logits, sampled, allowed)
        self.speculator.record([(len(seq.draft_token_ids), v) for seq, v in zip(sampled, verified)])
        self.runner.keep_accepted_states([(seq, v.num_accepted) for seq, v in zip(sampled, verified)])
        for seq in proposed:
            seq.draft_token_ids = []
        now, accepted = time.monotonic(), []
        for seq, v in zip(sampled, verified):
            roll_back(self.kv, seq, v.num_accepted)  # before the tokens: a finish caches its full blocks
            for token, lp in zip(v.token_ids, v.logprobs):
                last = self._reaches_length(seq, seq.num_tokens)
                if last:
                    self.scheduler.finish(seq, "length")
                accepted.append(self._accept(seq, token, lp, now, last))
                if seq.finished:  # tokens after its last are dropped
                    break
        step_outputs, stopped = self.outputs.process(accepted)
        for seq, stop_string in stopped:
            self.scheduler.finish(seq, "stop", stop_string)
        self.speculator.observe(layout)
        self.speculator.forget([seq for seq in sampled if seq.finished])
        for seq in batch.seqs:
            self.kv.cache_full_blocks(seq)
        self._publish_kv_events()
        return outputs + step_outputs

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())

    def _reaches_length(self, seq: Sequence, pos: int) -> bool:
        """Whether the token at index pos of seq is its last by max_tokens or the context limit."""
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and pos + 1 - seq.num_prompt_tokens >= max_tokens) or pos + 1 >= self.max_model_len

    def _grammar_bitmask(self, step: InFlightStep):
        """The allowed tokens of the step's constrained rows, or None when none is."""
        if not any(s.grammar is not None for s in step.sampled):
            return None
        return self.grammars.bitmask([None if s.finished else s.grammar for s in step.sampled])

    def _end_at_length(self, step: InFlightStep) -> None:
        """At launch: a sampled token is its sequence's last when it reaches max_tokens or the
        context limit, whatever its value; the sequence leaves the schedule now."""
        for i, (seq, pos) in enumerate(zip(step.sampled, step.positions)):
            if seq.finished:  # ended on the token before (read early for a grammar): this one is dropped
                continue
            if self._reaches_length(seq, pos):
                step.last[i] = True
                self.scheduler.finish(seq, "length")

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a step's tokens (waiting for their copy to the host), accept each into its
        sequence, and turn them into outputs."""
        result = step.result()
        if result is None:
            return []
        now = time.monotonic()
        accepted = []
        for seq, pos, last, token, lp in zip(step.sampled, step.positions, step.last, result.token_ids,
                                             result.logprobs):
            if _expects(seq, pos):
                accepted.append(self._accept(seq, token, lp, now, last))
        outputs, stopped = self.outputs.process(accepted)
        for seq, stop_string in stopped:
            self.scheduler.finish(seq, "stop", stop_string)
        return outputs

    def _accept(self, seq: Sequence, token: int, lp, now: float, last: bool) -> Accepted:
        """What the next schedule depends on: a sequence that ends on eos or a stop token leaves
        the schedule now (a token launched after this one is dropped when read)."""
        params = seq.params
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.is_terminated() and not seq.grammar.accept_token(token):
            # The grammar reached a state that allows no token (Grammars.bitmask let end-of-text
            # through): the output cannot be completed, and the client must see that it failed.
            log.warning("request %s: token %d breaks its grammar; finishing it as an error", seq.request_id, token)
            self.scheduler.finish(seq, "error")
            return Accepted(seq, token, lp, seq.num_output_tokens, True)
        n_out = seq.num_output_tokens
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.generation_tokens_total += 1
        if n_out == 1:
            self.prompt_tokens_total += seq.num_prompt_tokens
        if n_out >= params.min_tokens and (
                token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)):
            # "stop" even when max_tokens also ended it on this token
            self.scheduler.finish(seq, "stop", token if token in params.stop_token_ids else None)
            last = True
        return Accepted(seq, token, lp, n_out, last)

    def _unblock(self) -> list[RequestOutput]:
        """Nothing could be scheduled although work is waiting: the head sequence cannot fit in
        the KV cache even alone. Finish it rather than spin."""
        if not self.scheduler.running and self.scheduler.waiting:
            seq = next((s for s in self.scheduler.waiting if not s.gated), None)
            if seq is not None:
                log.warning("request %s outgrew the KV cache; finishing it with reason 'length'", seq.request_id)
                self.scheduler.finish(seq, "length")
                out = self.outputs.end_without_token(seq, "length")
                return [out] if out is not None else []
        return []


def release_device_memory() -> None:
    """Free what nothing references any more (cycles included) and hand the allocator's cached
    blocks back to the driver, so that another engine or process can have them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def must_read_before_scheduling(previous: InFlightStep) -> bool:
    """Penalties count every token sampled so far: step N's tokens are read before N+1 is
    scheduled (a sequence that N ended is then not scheduled again)."""
    return any(s.params.uses_penalties for s in previous.sampled)


def must_read_before_sampling(step: InFlightStep) -> bool:
    """A grammar's mask for step N+1 depends on the token N sampled: step N is read while
    N+1's forward runs, before N+1 samples."""
    return any(s.grammar is not None for s in step.sampled)


def _expects(seq: Sequence, pos: int) -> bool:
    """Whether seq still wants the token launched for position pos: not when it was aborted, or
    ended on an earlier token (eos, a stop token or string) after this one was launched."""
    return seq.finish_reason in (None, "length") and len(seq.token_ids) == pos


_EMBED_PARAMS = SamplingParams(max_tokens=1)  # an embedding's sequence samples nothing; its params are unused

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: dict) -> dict:
    """The sampling settings a model's generation_config.json recommends (only when it samples:
    do_sample=false configs describe greedy decoding, which is already each field's default)."""
    if generation_config.get("do_sample") is False:
        return {}
    return {k: generation_config[k] for k in SAMPLING_DEFAULT_KEYS if generation_config.get(k) is not None}


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [x] if isinstance(x, int) else list(x)
