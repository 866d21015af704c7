"""From accepted tokens to what a caller sees: incremental text, stop strings, logprobs, deltas
and finished requests. Runs on the host while the device computes the next step."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvship.core.detokenizer import IncrementalDetokenizer
from kvship.core.stop import StopStringMatcher
from kvship.outputs import CompletionOutput, RequestOutput
from kvship.sampling_params import SamplingParams
from kvship.sequence import Sequence


@dataclass
class Accepted:
    """A token read from the device and accepted into its sequence."""

    seq: Sequence
    token: int
    logprob: object  # (TokenLogprob, alternatives) when asked for, else None
    n_out: int  # its place among the sequence's output tokens, from 1
    last: bool  # the sequence's last token (eos, a stop token, max_tokens or the context limit)


@dataclass(eq=False)
class _Choice:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    out: CompletionOutput


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    arrival_time: float
    final_only: bool  # no output until every choice has finished (offline generate)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        self.single_texts: dict[bool, dict[int, str]] = {}  # by skip_special_tokens

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seqs: list[Sequence],
            arrival_time: float, final_only: bool = False) -> None:
        skip = params.skip_special_tokens
        single_texts = self.single_texts.setdefault(skip, {})
        choices = [_Choice(seq, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip, single_texts),
                           StopStringMatcher(params.stop),
                           CompletionOutput(index=seq.index, logprobs=[] if params.logprobs is not None else None))
                   for seq in seqs]
        self.requests[request_id] = _Request(request_id, list(prompt_token_ids), params, choices, arrival_time,
                                             final_only)

    def process(self, accepted: list[Accepted]) -> tuple[list[RequestOutput], list[tuple[Sequence, str]]]:
        """Outputs of the requests these tokens belong to, and the sequences a stop string ended,
        each with that string (the caller ends them)."""
        touched: dict[str, _Request] = {}
        stopped: list[tuple[Sequence, str]] = []
        requests = self.requests
        for a in accepted:
            seq = a.seq
            req = requests.get(seq.request_id)
            if req is None:
                continue
            choice = req.choices[seq.index]
            if choice.seq is not seq:  # aborted meanwhile (its id maybe reused)
                continue
            matched = self._process_token(choice, a)
            if matched is not None:
                stopped.append((seq, matched))
            if self._due(req):
                touched[req.request_id] = req
        return [self.emit(req) for req in touched.values()], stopped

    def _process_token(self, c: _Choice, a: Accepted) -> str | None:
        """The stop string that ended the sequence on this token, if one did."""
        seq, out, token = c.seq, c.out, a.token
        if out.finish_reason is not None:  # already final (a stop string matched earlier)
            return None
        out.token_ids.append(token)
        out.token_ids_delta.append(token)
        if a.logprob is not None and out.logprobs is not None:
            out.logprobs.append(a.logprob)
            out.logprobs_delta = (out.logprobs_delta or []) + [a.logprob]
        new_text = c.detok.push([token])
        matched = None
        if a.n_out > seq.params.min_tokens:  # stop strings count only past min_tokens
            new_text, matched = c.stop.feed(new_text)
        if matched is None and a.last:  # release text held back for stop matching
            tail, matched = c.stop.feed(c.detok.flush())
            new_text += tail if matched is not None else tail + c.stop.flush()
        out.text_delta += new_text
        out.text += new_text
        if matched is not None:
            out.finish_reason, out.stop_reason = "stop", matched
        elif a.last:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        return matched

    def end_without_token(self, seq: Sequence, reason: str) -> RequestOutput | None:
        """The sequence ended with no further token (it outgrew the KV cache): its held-back
        text is released with that finish reason (a final-only request's output waits for its
        other choices)."""
        req = self.requests.get(seq.request_id)
        if req is None:
            return None
        c = req.choices[seq.index]
        c.out.finish_reason = reason
        tail = c.stop.feed(c.detok.flush())[0] + c.stop.flush()
        c.out.text_delta += tail
        c.out.text += tail
        return self.emit(req) if self._due(req) else None

    @staticmethod
    def _due(req: _Request) -> bool:
        """Whether the request has an output to give now: every step while it runs, or, for a
        final-only one, once every choice has finished."""
        return not req.final_only or all(c.out.finish_reason is not None for c in req.choices)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The request's final output, finish_reason "abort" for the choices still running; None
        if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for c in req.choices:
            if c.out.finish_reason is None:
                c.out.finish_reason = "abort"
        return self.emit(req)

    def emit(self, req: _Request) -> RequestOutput:
        outs = []
        finished = True  # every choice's output is final (its last token read and processed)
        for c in req.choices:
            o = c.out
            finished = finished and o.finish_reason is not None
            # While running, the cumulative list is shared (copying it every step costs O(length)).
            token_ids = list(o.token_ids) if o.finish_reason is not None else o.token_ids
            outs.append(CompletionOutput(
                index=o.index, text=o.text, token_ids=token_ids, text_delta=o.text_delta,
                token_ids_delta=o.token_ids_delta, logprobs=o.logprobs, logprobs_delta=o.logprobs_delta,
                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
            o.text_delta, o.token_ids_delta, o.logprobs_delta = "", [], ([] if o.logprobs is not None else None)
        lead = req.choices[0].seq
        if finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, outputs=outs, finished=finished,
            num_cached_tokens=lead.num_cached_tokens, arrival_time=req.arrival_time,
            prompt_logprobs=lead.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            first_scheduled_time=lead.first_scheduled_time, first_token_time=lead.first_token_time,
            finished_time=time.monotonic() if finished else None)
