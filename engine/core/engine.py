"""The synchronous engine: requests in, one scheduling + model step at a time, outputs out.
Used directly by `LLM` (offline) and driven from a thread by `AsyncEngine` (serving)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvship.config import EngineConfig
from kvship.core.detokenizer import IncrementalDetokenizer
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.core.model_runner import ModelRunner
from kvship.core.sampler import PendingSample, Sampler, SamplerRow
from kvship.core.scheduler import ScheduledBatch, Scheduler
from kvship.core.sequence import PLACEHOLDER, Sequence
from kvship.core.stop import StopStringMatcher
from kvship.loader import resolve_model
from kvship.models.config import ModelConfig
from kvship.outputs import CompletionOutput, RequestOutput
from kvship.sampling_params import InvalidParamsError, SamplingParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Choice:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    out: CompletionOutput


@dataclass(eq=False)
class _InFlight:
    seqs: list[Sequence]
    positions: list[int]  # index of each one's placeholder in its token_ids
    sample: PendingSample

    @property
    def tokens(self):
        return self.sample.tokens

    def is_live(self, seq: Sequence, pos: int) -> bool:
        """Its placeholder is still there: not aborted, not ended on an earlier token."""
        return 0 <= pos < len(seq.token_ids) and seq.token_ids[pos] == PLACEHOLDER

    def any_live(self) -> bool:
        return any(self.is_live(s, p) for s, p in zip(self.seqs, self.positions))


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    arrival_time: float

    @property
    def finished(self) -> bool:  # every choice's output is final (its last token read and processed)
        return all(c.out.finish_reason is not None for c in self.choices)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source = resolve_model(config.model, revision=config.revision, download_dir=config.download_dir,
                               require_weights=config.load_format != "dummy")
        self.tokenizer = source.tokenizer
        self.model_config = ModelConfig.from_hf(source.hf_config)
        self.model_name = config.served_model_name or source.name
        limit = self.model_config.max_position_embeddings
        if config.max_model_len and config.max_model_len > limit:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's limit of {limit} positions")
        self.max_model_len = config.max_model_len or limit
        config.max_model_len = self.max_model_len
        torch.manual_seed(config.seed)
        weights = None if config.load_format == "dummy" else source.weights()
        self.tp_runtime = None
        if config.tensor_parallel_size > 1:  # start the other ranks; this process is rank 0
            from kvship.distributed.launch import TPRuntime

            self.tp_runtime = TPRuntime.start(config)
        try:
            self.runner = ModelRunner(config, self.model_config, source.hf_config, weights, self.max_model_len,
                                      **({"tp": self.tp_runtime.ctx} if self.tp_runtime else {}))
        except BaseException:
            self.shutdown()
            raise
        if self.tp_runtime:
            self.tp_runtime.ready = True
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        eos = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_id)
        eos |= set(_as_list(source.generation_config.get("eos_token_id")))
        self.eos_token_ids = eos
        self.sampling_defaults = sampling_defaults(source.generation_config) if config.generation_defaults else {}
        if self.sampling_defaults:
            log.info("sampling defaults from the model's generation config: %s", self.sampling_defaults)
        self.requests: dict[str, _Request] = {}
        # Tokens accepted last step whose text and outputs are finished during the next one.
        self._pending: list[tuple[Sequence, int, object, int]] = []
        self._inflight: _InFlight | None = None  # the last launched sample, not yet read
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise InvalidParamsError(f"request id {request_id!r} is already in use", "request_id")
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise InvalidParamsError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParamsError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if n_prompt >= self.max_model_len:
            raise InvalidParamsError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n_prompt} tokens, "
                "leaving no room for a completion. Shorten the prompt.", "messages")
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise InvalidParamsError("prompt logprobs are not available with tensor parallelism", "logprobs")
        capacity = self.kv.num_blocks * self.kv.block_size
        if n_prompt + 1 > capacity:
            raise InvalidParamsError(
                f"the prompt ({n_prompt} tokens) does not fit in the KV cache ({capacity} tokens)", "prompt")
        choices = []
        leader = None
        for i in range(params.n):
            seq = Sequence(request_id, i, list(prompt_token_ids), params, leader=leader)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            leader = leader or seq
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            out = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
            choices.append(_Choice(seq, detok, StopStringMatcher(params.stop), out))
        self.requests[request_id] = _Request(request_id, list(prompt_token_ids), params, choices, time.monotonic())
        for c in choices:
            self.scheduler.add(c.seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop the request and free its blocks; returns its final output (finish_reason "abort"
        for the choices still running), or None if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._pending = [p for p in self._pending if p[0].request_id != request_id]
        for c in req.choices:
            while c.seq.token_ids and c.seq.token_ids[-1] == PLACEHOLDER:  # its launched token is dropped
                c.seq.token_ids.pop()
            if not c.seq.finished:
                self.scheduler.finish(c.seq, "abort")
            if c.out.finish_reason is None:
                c.out.finish_reason = "abort"
        if self._inflight is not None and not self._inflight.any_live():
            self._inflight = None
        return self._emit(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this engine started (no-op with one rank)."""
        if getattr(self, "tp_runtime", None) is not None:
            if getattr(self, "runner", None) is not None:
                self.runner.release_graphs()  # graphs hold NCCL work: drop them before the communicators
            self.tp_runtime.shutdown()

    # -- one step ----------------------------------------------------------------------------
    # A step: schedule, launch the forward pass and the sampling, and only then read the
    # previous step's tokens (which the GPU finished before starting this step's work), apply
    # eos / stop ids, and finish their text, stop strings and outputs, all while the GPU runs.
    # The host therefore never waits for the step it has just launched: a decoding sequence's
    # next input is its sampled token read on the device (a placeholder stands in token_ids),
    # and a sequence that ended on eos costs one discarded token. max_tokens and the context
    # limit do not depend on the token's value, so they end a sequence at launch. Batches with
    # penalties need the last token's value before sampling, so they read it first.
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self._read_inflight()
            return self._finish_pending() + self._unblock()
        outputs = self._step(batch)
        if log.isEnabledFor(logging.DEBUG):  # what serving latency is made of, step by step
            log.debug("step: %d seqs, %d new tokens, %d waiting, %.1f ms", len(batch), batch.num_tokens,
                      len(self.scheduler.waiting), (time.perf_counter() - t0) * 1e3)
        return outputs

    def _step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        prev = self._inflight
        logits = self.runner.run(batch, prev.tokens if prev is not None else None)
        sampled = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        if sampled:
            if any(s.params.uses_penalties for s in sampled):
                self._read_inflight()
            rows = [SamplerRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, (s.request_id, s.index))
                    if s.params.uses_penalties else SamplerRow(s.params, (), (), s.generator) for s in sampled]
            launched = self.sampler.launch(logits, rows)
            positions = []
            for i, seq in enumerate(sampled):
                if seq.finished:  # ended by the read above (penalties): this row is dropped
                    positions.append(-1)
                    continue
                seq.token_ids.append(PLACEHOLDER)
                seq.sample_row = i
                positions.append(seq.num_tokens - 1)
                self._end_at_length(seq)
        self._read_inflight()
        if sampled:
            self._inflight = _InFlight(sampled, positions, launched)
        for seq in batch.seqs:
            self.kv.cache_full_blocks(seq)  # after the read: a block's hash needs its tokens' values
        return self._finish_pending()

    def _end_at_length(self, seq: Sequence) -> None:
        """At launch: the token just sampled is seq's last one when it reaches max_tokens or the
        context limit, whatever its value."""
        params = seq.params
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _read_inflight(self) -> None:
        """The launched sample's tokens replace their placeholders (waiting for its copy to the
        host), and each is accepted."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        result = inflight.sample.result()
        now = time.monotonic()
        for seq, pos, token, lp in zip(inflight.seqs, inflight.positions, result.token_ids, result.logprobs):
            if inflight.is_live(seq, pos):
                seq.token_ids[pos] = token
                self._accept_token(seq, pos, token, lp, now)

    def _unblock(self) -> list[RequestOutput]:
        """Nothing could be scheduled although work is waiting: the head sequence cannot fit in
        the KV cache even alone. Finish it rather than spin."""
        if not self.scheduler.running and self.scheduler.waiting:
            seq = next((s for s in self.scheduler.waiting if not s.gated), None)
            if seq is not None:
                log.warning("request %s outgrew the KV cache; finishing it with reason 'length'", seq.request_id)
                req = self.requests[seq.request_id]
                choice = req.choices[seq.index]
                self.scheduler.finish(seq, "length")
                choice.out.finish_reason = "length"
                tail = choice.stop.feed(choice.detok.flush())[0] + choice.stop.flush()
                choice.out.text_delta += tail
                choice.out.text += tail
                return [self._emit(req)]
        return []

    def _accept_token(self, seq: Sequence, pos: int, token: int, lp, now: float) -> None:
        """What the next schedule depends on: a sequence that ended on eos or a stop token frees
        its blocks now and drops the token launched after this one."""
        params = seq.params
        n_out = pos + 1 - seq.num_prompt_tokens
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.generation_tokens_total += 1
        if n_out == 1:
            self.prompt_tokens_total += seq.num_prompt_tokens
        stop = n_out >= params.min_tokens and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos))
        if stop:  # "stop" even when max_tokens also ended it on this token
            del seq.token_ids[pos + 1:]
            if not seq.finished:
                self.scheduler.finish(seq, "stop")
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
        self._pending.append((seq, token, lp, n_out))

    def _finish_pending(self) -> list[RequestOutput]:
        """Text, stop strings, logprobs and outputs for the tokens accepted last step."""
        pending, self._pending = self._pending, []
        touched: dict[str, _Request] = {}
        for seq, token, lp, n_out in pending:
            req = self.requests.get(seq.request_id)
            if req is None or req.choices[seq.index].seq is not seq:  # aborted meanwhile (its id maybe reused)
                continue
            self._process_token(req.choices[seq.index], token, lp, n_out)
            touched[req.request_id] = req
        return [self._emit(req) for req in touched.values()]

    def _process_token(self, c: _Choice, token: int, lp, n_out: int) -> None:
        seq, out, params = c.seq, c.out, c.seq.params
        if out.finish_reason is not None:  # already final (a stop string matched earlier)
            return
        out.token_ids.append(token)
        out.token_ids_delta.append(token)
        if lp is not None and out.logprobs is not None:
            out.logprobs.append(lp)
            out.logprobs_delta = (out.logprobs_delta or []) + [lp]
        new_text = c.detok.push([token])
        matched = None
        if n_out > params.min_tokens:  # stop strings count only past min_tokens
            new_text, matched = c.stop.feed(new_text)
        ended = seq.finished and n_out == seq.num_output_tokens  # ended by _accept_token on this token
        if matched is None and ended:  # release text held back for stop matching
            tail, matched = c.stop.feed(c.detok.flush())
            new_text += tail if matched is not None else tail + c.stop.flush()
        out.text_delta += new_text
        out.text += new_text
        if matched is not None:
            if not seq.finished:
                self.scheduler.finish(seq, "stop")
            seq.finish_reason, seq.stop_reason = "stop", matched
            if seq.num_output_tokens > n_out:  # a token sampled after the match is not output
                del seq.token_ids[seq.num_prompt_tokens + n_out:]
        if matched is not None or ended:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason

    def _emit(self, req: _Request) -> RequestOutput:
        outs = []
        for c in req.choices:
            o = c.out
            # While running, the cumulative list is shared (copying it every step costs O(length)).
            outs.append(CompletionOutput(
                index=o.index, text=o.text, token_ids=list(o.token_ids) if o.finish_reason is not None else o.token_ids,
                text_delta=o.text_delta,
                token_ids_delta=o.token_ids_delta, logprobs=o.logprobs, logprobs_delta=o.logprobs_delta,
                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
            o.text_delta, o.token_ids_delta, o.logprobs_delta = "", [], ([] if o.logprobs is not None else None)
        lead = req.choices[0].seq
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, outputs=outs, finished=finished,
            num_cached_tokens=lead.num_cached_tokens, arrival_time=req.arrival_time,
            prompt_logprobs=lead.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            first_scheduled_time=lead.first_scheduled_time, first_token_time=lead.first_token_time,
            finished_time=time.monotonic() if finished else None)


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
