"""``--speculative-config`` / ``LLM(speculative_config=...)``, spelled as vLLM spells it: the
method (n-gram prompt lookup, a draft model, a checkpoint's MTP layers) and how many tokens to
propose a step. Standard library only, like cli_args (the operator validates engine args)."""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "mtp")
# Above this many running sequences a step decodes without speculation: past it a long proposal's
# verify costs more than the tokens it returns (measured: bench/spec_decode.py --shape, docs/speculative.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model (method draft_model)
    prompt_lookup_max: int = 5  # n-gram: the longest suffix looked up in the sequence's tokens
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From JSON text or a dict; None stays None. A bad one raises ValueError saying why."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)} "
                             f"(or give a draft 'model'), got {method!r}")
        if method == "draft_model" and not value.get("model"):
            raise ValueError("speculative_config: method draft_model needs 'model' (the draft's id or path)")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be an integer of at least 1")
        fields = {f: value[f] for f in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
                  if value.get(f) is not None}
        for f, v in fields.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {f} must be an integer of at least 1")
        config = cls(method, k, value.get("model"), **fields)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min exceeds prompt_lookup_max")
        return config
