"""Incremental detokenization with a sliding window (prefix offset / read offset).

Decoding token by token cannot be done by decoding each token alone: byte-level tokens may
carry part of a UTF-8 character, and some decoders change a token's text depending on its
neighbours (leading-space handling). Re-decoding the whole output each step is correct but
O(n) per token. The window method decodes only ids[prefix_offset:]:

    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])
    emit new_text[len(prefix_text):] and slide the window (prefix_offset <- read_offset,
    read_offset <- len(ids)), unless it ends in an incomplete character ("\\ufffd"): then emit
    only the text before that tail and leave the window where it is.

The window starts on a character boundary each time, so its cost stays O(window) per token.
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context for the first output tokens (for decoders whose text for
# a token depends on what precedes it, e.g. SentencePiece's leading-space handling).
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 single_texts: dict[int, str] | None = None):
        """``single_texts``: a token's text alone, by id, which the caller may share between the
        detokenizers of one tokenizer and skip_special_tokens value: a window usually starts with
        one token, the last one pushed, so this saves one of the two decodes of most tokens."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._single_texts = {} if single_texts is None else single_texts
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # Context that ends in the middle of a character would glue its bytes onto the first
        # output character; context that decodes to nothing is useless. Start clean then.
        if context:
            ctx_text = self._decode(context)
            if not ctx_text or REPLACEMENT_CHAR in ctx_text:
                context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        # Characters of the current window, past the prefix, already emitted while its tail
        # was still an incomplete character.
        self._partial = 0
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if len(ids) == 1:
            text = self._single_texts.get(ids[0])
            if text is None:
                text = self._single_texts[ids[0]] = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
            return text
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Adds generated tokens; returns only the text they complete (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: releases whatever is held back, except an incomplete
        character at the very end (generation stopped inside it, e.g. at max_tokens): a full
        decode would show it as "\\ufffd"; the final text leaves it out, as the streamed deltas
        did. (A model that really generates U+FFFD as its last character loses it too.)"""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        start = len(prefix_text) + self._partial
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            # The tail is an incomplete UTF-8 sequence: emit only what precedes it and keep
            # the window where it is until the character completes.
            end = len(new_text.rstrip(REPLACEMENT_CHAR))
            delta = new_text[start:end] if end > start else ""
            self._partial += len(delta)
        elif not final and len(new_text) <= len(prefix_text):
            return ""  # nothing visible yet (e.g. a skipped special token)
        else:
            delta = new_text[start:]
            if final:
                delta = delta.rstrip(REPLACEMENT_CHAR)
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._partial = 0
        self.text += delta
        return delta
