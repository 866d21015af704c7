"""Per-request sampling parameters (what the OpenAI API exposes, validated once here)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is a signed 64-bit integer (torch takes these)


class InvalidParamsError(ValueError):
    """A client-side mistake in the request; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole (the engine's process hands it to the server's)
        return type(self), (str(self), self.param)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text (grammar-constrained decoding, kvship.core.grammar).
    `spec`: the JSON schema as canonical JSON text (kind "json"), a regex, a JSON list of the
    allowed strings ("choice"), an EBNF grammar, or xgrammar's structural tag as JSON text;
    unused for "json_object" (any JSON object). Equal specs share one compiled grammar."""

    kind: str
    spec: str = ""
    param: str = field(default="response_format", compare=False)  # the request field it came from, for errors

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParamsError(f"unknown structured output kind {self.kind!r}", self.param)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob + top-k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache)
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit before
    # sampling (-100 in effect bans it, 100 all but forces it).
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: StructuredOutput | None = None  # the output must match this (None: free text)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Sampling depends on every token generated so far (including the one just sampled)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidParamsError(msg, param)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)}.", name)
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}.", "n")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}.", "repetition_penalty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad(f"seed must be a signed 64-bit integer (between {SEED_MIN} and {SEED_MAX}), got {self.seed}.", "seed")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).", "min_tokens")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {token_id}.", "logit_bias")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                bad(f"logit_bias values must be between -100 and 100, got {bias} for token {token_id}.", "logit_bias")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}.", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}.", "logprobs")
