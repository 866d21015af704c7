"""Grammar-constrained decoding with xgrammar: a request's StructuredOutput (JSON schema, any
JSON, regex, choice, EBNF grammar or structural tag) is compiled once per distinct spec (an LRU
of compiled grammars, filled off the engine thread by `prepare`), each sequence walks it with a
matcher of its own, and before each sampling the matchers write which tokens may come next into
a bitmask the sampler applies on the device.

The grammar ends where the model's own end-of-text tokens are allowed: xgrammar lets only those
through once the structure is complete, so a constrained sequence ends with finish_reason
"stop" through the ordinary eos check, and with "length" only when max_tokens runs out first.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from kvship.loader.tokenizer import Tokenizer
from kvship.sampling_params import InvalidParamsError, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

COMPILED_CACHE_SIZE = 256  # distinct specs kept compiled (a compiled JSON schema is KBs to a few MBs)


class Grammars:
    """Compiles specs (thread-safe: the server compiles in worker threads, the engine thread
    looks up) and hands out matchers and bitmasks. Built lazily on first use: engines that
    never see a constrained request never build the tokenizer's grammar tables."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # xgrammar is imported on first use: importing it (and transformers) costs ~1 s, which
        # an engine that never sees a constrained request should not pay at start-up.
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast  # xgrammar's own dependency

        with self._lock:
            if self._compiler is None:

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self._stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def prepare(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache, or compiled now: call it off the
        engine thread first). InvalidParamsError naming the request field when xgrammar cannot
        serve the spec (an unsupported schema keyword, a malformed regex or grammar)."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        compiled = self._compile(self._get_compiler(), spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
        if spec.kind == "json":
            check_schema(json.loads(spec.spec), spec.param)
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                choices = json.loads(spec.spec)
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.spec)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for what it cannot serve
            raise InvalidParamsError(f"the {_NAMES[spec.kind]} cannot be used to constrain the output: "
                                     f"{_first_line(exc)}", spec.param) from None
        raise InvalidParamsError(f"unknown structured output kind {spec.kind!r}", spec.param)

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.prepare(spec))

    def bitmask(self, matchers: list[xgr.GrammarMatcher | None]) -> torch.Tensor | None:
        """[len(matchers), words] int32 on the host: the tokens each row's matcher allows next
        (every token for rows without one), or None when no row has one. A matcher whose
        structure is complete allows only the end-of-text tokens."""
        if all(m is None for m in matchers):
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # all allowed
        # One by one: xgrammar caches each grammar state's mask, so 32 rows of a 128k
        # vocabulary take ~0.1 ms; its thread pool (BatchGrammarMatcher) took 1-3 ms.
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)
        return mask


# JSON-schema keywords xgrammar enforces (each checked against its converter, accepting and
# refusing sample strings); annotations change nothing. Anything else (allOf, not, if/then,
# uniqueItems, contains, patternProperties, propertyNames, ...) it would ignore, so that the
# output could break the schema: such a schema is refused rather than half-enforced.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "format", "minProperties",
    "maxProperties"})
SCHEMA_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "discriminator"})
SCHEMA_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "uuid", "hostname", "ipv4", "ipv6", "uri", "uri-reference"})


def check_schema(schema: object, param: str, path: str = "#") -> None:
    """Refuse (InvalidParamsError naming the keyword and where it sits) a JSON schema that uses
    what xgrammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidParamsError(f"the JSON schema at {path} must be an object or a boolean", param)
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS and key not in SCHEMA_ANNOTATIONS:
            raise InvalidParamsError(f"the JSON schema keyword {key!r} (at {path}) is not supported for "
                                     "constrained output", param)
        if key == "format" and value not in SCHEMA_FORMATS:
            raise InvalidParamsError(f"the JSON schema string format {value!r} (at {path}) is not supported for "
                                     f"constrained output; supported: {', '.join(sorted(SCHEMA_FORMATS))}", param)
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, param, f"{path}/{key}/{name}")
        elif key in ("items", "additionalProperties"):
            check_schema(value, param, f"{path}/{key}")
        elif key in ("prefixItems", "anyOf", "oneOf") and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{path}/{key}/{i}")


_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
          "choice": "choice list", "grammar": "grammar", "structural_tag": "structural tag"}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def canonical_json(value: Any) -> str:
    """Compact JSON text of a schema (a cache key). Key order is kept: it is the order in which
    the constrained output writes an object's properties."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
