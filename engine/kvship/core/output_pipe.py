"""Outputs across the engine process's pipe (core/engine_process.py), without their cumulative parts.

A running request's RequestOutput carries its whole text, tokens and logprobs so far, and its
prompt, every step: pickled as they are, a long answer would cost the engine's loop time growing
with its length each step. ``OutputPacker`` (the engine's side) sends only what each choice
added since its last output, and the prompt's logprobs once; ``OutputUnpacker`` (the server's
side, one per request) adds them back up, so that the server reads the outputs the engine made.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvship.outputs import CompletionOutput, RequestOutput


@dataclass
class Packed:
    """One output as it crosses: ``output`` with each choice's added part only where ``added``
    says so (else whole), no prompt tokens, and the prompt's logprobs only the first time."""

    output: RequestOutput
    added: tuple[bool, ...]


class OutputPacker:
    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[str, int, int]]] = {}  # request -> choice -> (text, tokens, logprobs)

    def pack(self, out: RequestOutput) -> Packed:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        choices, added = [], []
        for whole in out.outputs:
            text, n_tokens, n_logprobs = sent.get(whole.index, ("", 0, 0))
            logprobs = whole.logprobs
            grew = (whole.text.startswith(text) and len(whole.token_ids) >= n_tokens
                    and (logprobs is None or len(logprobs) >= n_logprobs))
            choices.append(replace(whole, text=whole.text[len(text):], token_ids=whole.token_ids[n_tokens:],
                                   logprobs=None if logprobs is None else logprobs[n_logprobs:]) if grew else whole)
            added.append(grew)
            sent[whole.index] = (whole.text, len(whole.token_ids), 0 if logprobs is None else len(logprobs))
        if out.finished:
            del self._sent[out.request_id]
        return Packed(replace(out, prompt_token_ids=[], outputs=choices,
                              prompt_logprobs=out.prompt_logprobs if first else None), tuple(added))


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None


class OutputUnpacker:
    """One request's outputs made whole again, from its prompt (which the server sent)."""

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = None
        self.choices: dict[int, _Choice] = {}

    def unpack(self, packed: Packed) -> RequestOutput:
        out = packed.output
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        choices: list[CompletionOutput] = []
        for c, added in zip(out.outputs, packed.added):
            have = self.choices.get(c.index)
            if have is None or not added:
                have = self.choices[c.index] = _Choice(c.text, list(c.token_ids),
                                                       None if c.logprobs is None else list(c.logprobs))
            else:
                have.text += c.text
                have.token_ids.extend(c.token_ids)
                if c.logprobs is not None:
                    have.logprobs = [] if have.logprobs is None else have.logprobs
                    have.logprobs.extend(c.logprobs)
            final = c.finish_reason is not None  # as the engine's own: the running list shared, a final one copied
            choices.append(replace(c, text=have.text, token_ids=list(have.token_ids) if final else have.token_ids,
                                   logprobs=None if have.logprobs is None else
                                   list(have.logprobs) if final else have.logprobs))
        return replace(out, prompt_token_ids=self.prompt_token_ids, outputs=choices,
                       prompt_logprobs=self.prompt_logprobs)
