"""Grammar-constrained decoding with xgrammar: a request's StructuredOutput (JSON schema, any
JSON, regex, choice, EBNF grammar or structural tag) is compiled once per distinct spec (an LRU
of compiled grammars bounded by bytes, filled off the engine thread by `prepare`), each sequence
walks it with a matcher of its own, and before each sampling the matchers write which tokens may
come next into a bitmask the sampler applies on the device.

The grammar ends where the model's own end-of-text tokens are allowed: xgrammar lets only those
through once the structure is complete, so a constrained sequence ends with finish_reason
"stop" through the ordinary eos check, and with "length" only when max_tokens runs out first.

A spec that can produce no complete output is refused when it is compiled (`check_schema` for
what a JSON schema says, `_check_can_finish` for the compiled grammar). A sequence that still
reaches a state where no token is allowed ends with finish_reason "error", never "stop".
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvship.loader.tokenizer import Tokenizer
from kvship.sampling_params import InvalidParamsError, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

# Compiled grammars kept, in bytes, in our LRU and again in xgrammar's own cache (a compiled JSON
# schema is KBs to a few MBs): every distinct schema a client sends would stay otherwise.
CACHE_BYTES = 64 << 20
# Compile-time search for an output that completes: states explored, and the most tokens a state
# may allow for the search to go on (a dead end is usually a forced path; wide states are left to
# the run-time check).
SEARCH_STATES = 256
SEARCH_WIDTH = 16


class Grammars:
    """Compiles specs (thread-safe: the server compiles in worker threads, the engine thread
    looks up) and hands out matchers and bitmasks. Built lazily on first use: engines that
    never see a constrained request never build the tokenizer's grammar tables."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._bytes = 0
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
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True,
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    @property
    def cached_bytes(self) -> int:
        """Bytes of compiled grammars held in this LRU."""
        return self._bytes

    def prepare(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache, or compiled now: call it off the
        engine thread first). InvalidParamsError naming the request field when xgrammar cannot
        serve the spec (an unsupported schema keyword, a malformed regex or grammar) or when the
        spec can produce no complete output."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit[0]
        compiled = self._compile(self._get_compiler(), spec)
        self._check_can_finish(compiled, spec)
        size = compiled.memory_size_bytes
        with self._lock:
            if spec not in self._compiled:
                self._compiled[spec] = (compiled, size)
                self._bytes += size
            while self._bytes > CACHE_BYTES and len(self._compiled) > 1:
                self._bytes -= self._compiled.popitem(last=False)[1][1]
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
                                     f"{clean_error(exc)}", spec.param) from None
        raise InvalidParamsError(f"unknown structured output kind {spec.kind!r}", spec.param)

    def _check_can_finish(self, compiled: xgr.CompiledGrammar, spec: StructuredOutput) -> None:
        """Refuse a grammar that can produce no complete output: a rule that cannot end (it
        refers only to itself, or every way through it does), or, found by a small search over
        the matcher's states, a start whose every path reaches a state that allows no token."""
        what = _NAMES[spec.kind]
        stuck = unfinishable_rules(str(compiled.grammar))
        if stuck:
            rules = f" (rule {', '.join(sorted(stuck)[:5])})" if spec.kind == "grammar" else ""
            head = (f"the {what} can produce no complete output" if "root" in stuck else
                    f"part of the {what} can never be completed")
            raise InvalidParamsError(f"{head}{rules}: it refers to itself with no way to end", spec.param)
        if self._search(compiled) is False:
            raise InvalidParamsError(f"the {what} can produce no complete output: every way through it reaches "
                                     "a point where nothing may follow (e.g. a pattern that matches nothing)",
                                     spec.param)

    def _search(self, compiled: xgr.CompiledGrammar) -> bool | None:
        """Whether some output completes: True when one is found, False when every path was
        followed to a state that allows no token, None when the search was left (too wide or
        too long). Depth-first, to ever greater depths: a short way to the end is found before
        a long way into a recursion."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        stop = set(self._stop)
        budget = SEARCH_STATES
        cut = False  # some path was left at the depth limit

        def walk(depth: int) -> bool:
            nonlocal budget, cut
            if matcher.is_terminated():
                return True
            budget -= 1
            if budget < 0:
                raise _Undecided
            xgr.reset_token_bitmask(mask)
            matcher.fill_next_token_bitmask(mask, 0)
            allowed = allowed_ids(mask[0], self.vocab_size)
            if stop.intersection(allowed):
                return True
            if len(allowed) > SEARCH_WIDTH:
                raise _Undecided
            if allowed and depth == 0:
                cut = True
                return False
            for token in allowed:
                if matcher.accept_token(token):
                    found = walk(depth - 1)
                    matcher.rollback(1)
                    if found:
                        return True
            return False

        depth = 2
        try:
            while True:
                cut = False
                if walk(depth):
                    return True
                if not cut:
                    return False
                depth *= 2
        except _Undecided:
            return None

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.prepare(spec))

    def bitmask(self, matchers: list[xgr.GrammarMatcher | None]) -> torch.Tensor | None:
        """[len(matchers), words] int32 on the host: the tokens each row's matcher allows next
        (every token for rows without one), or None when no row has one. A matcher whose
        structure is complete allows only the end-of-text tokens; one that reached a state that
        allows nothing (a dead end the compile-time checks did not find) lets its end-of-text
        tokens through too, which it then refuses: the engine ends that sequence as an error."""
        if all(m is None for m in matchers):
            return None
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # all allowed
        # One by one: xgrammar caches each grammar state's mask, so 32 rows of a 128k
        # vocabulary take ~0.1 ms; its thread pool (BatchGrammarMatcher) took 1-3 ms.
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)
                if not bool(mask[i].any()):
                    for t in self._stop:
                        mask[i, t // 32] |= _bit(t % 32)
        return mask


class _Undecided(Exception):
    pass


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else 1 << i  # int32: bit 31 is the sign


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row ([words] int32, bit i of word w is token 32w + i) allows."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


# -- what a compiled grammar can finish ---------------------------------------------------------
# xgrammar prints a grammar one rule a line, `name ::= body (=lookahead)`: choices of sequences of
# string literals, character classes (perhaps starred), rule references, "" and built-ins such as
# Regex(...) and TagDispatch(...). A rule can finish when one of its choices holds only parts that
# can; what this reading does not know counts as finishing, so that it refuses only sure cases.
_LEX = re.compile(r'''\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\]\*?)
                      |(?P<name>[A-Za-z_][\w.\-]*)|(?P<rep>\{\d*,?\d*\})|(?P<op>[()|*+?=,]))''', re.X)
_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= (.*)$")


def unfinishable_rules(text: str) -> set[str]:
    """Rules reachable from `root` that can produce no complete string, read from xgrammar's
    printed grammar; empty when the text cannot be read."""
    texts: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        m = _RULE.match(line)
        if m:
            name = m.group(1)
            texts[name] = m.group(2)
        elif name is not None:  # a body printed over several lines (TagDispatch)
            texts[name] += " " + line
    try:
        rules = {name: _Reader(body).body() for name, body in texts.items()}
    except (ValueError, IndexError):
        return set()
    if "root" not in rules:
        return set()
    done: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in done and _finishes(body, done, rules):
                done.add(name)
                changed = True
    reach, todo = set(), ["root"]
    while todo:
        name = todo.pop()
        if name in reach or name not in rules:
            continue
        reach.add(name)
        todo.extend(_refs(rules[name]))
    return {n for n in reach if n not in done}


def _finishes(node: tuple, done: set[str], rules: dict) -> bool:
    kind = node[0]
    if kind == "alt":
        return any(_finishes(n, done, rules) for n in node[1])
    if kind == "seq":
        return all(_finishes(n, done, rules) for n in node[1])
    if kind == "rule":
        return node[1] in done or node[1] not in rules
    if kind == "more":  # one or more
        return _finishes(node[1], done, rules)
    return True  # a terminal, an optional part, what is not known


def _refs(node: tuple) -> list[str]:
    if node[0] == "rule":
        return [node[1]]
    if node[0] in ("alt", "seq"):
        return [r for n in node[1] for r in _refs(n)]
    if node[0] in ("more", "opt"):
        return _refs(node[1])
    return []


class _Reader:
    def __init__(self, text: str):
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _LEX.match(text, pos)
            if m is None or m.end() == pos:
                raise ValueError(text[pos:pos + 20])
            self.toks.append(next((k, v) for k, v in m.groupdict().items() if v is not None))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def body(self) -> tuple:
        node = self.alt()
        if self.peek() is not None:
            raise ValueError(f"unread {self.peek()}")
        return node

    def alt(self) -> tuple:
        seqs = [self.seq()]
        while self.peek() == ("op", "|"):
            self.i += 1
            seqs.append(self.seq())
        return ("alt", seqs)

    def seq(self) -> tuple:
        items = []
        while (tok := self.peek()) is not None and tok not in (("op", "|"), ("op", ")"), ("op", ",")):
            items.append(self.item())
        return ("seq", items)

    def item(self) -> tuple:
        kind, value = self.toks[self.i]
        self.i += 1
        if kind in ("str", "cls"):
            node: tuple = ("term",)
        elif kind == "name" and self.peek() == ("op", "("):  # a built-in: Regex(...), TagDispatch(...)
            self._skip_group()
            node = ("term",)
        elif kind == "name":
            node = ("rule", value)
        elif (kind, value) == ("op", "("):
            if self.peek() == ("op", "="):  # a lookahead: it constrains, it does not produce
                self.i += 1
                self.alt()
                self._expect(")")
                return ("term",)
            node = self.alt()
            self._expect(")")
        else:
            raise ValueError(f"unexpected {value!r}")
        tok = self.peek()
        if tok in (("op", "*"), ("op", "?")) or (tok is not None and tok[0] == "rep" and _min_rep(tok[1]) == 0):
            self.i += 1
            return ("opt", node)
        if tok == ("op", "+") or (tok is not None and tok[0] == "rep"):
            self.i += 1
            return ("more", node)
        return node

    def _expect(self, op: str) -> None:
        if self.peek() != ("op", op):
            raise ValueError(f"expected {op!r}")
        self.i += 1

    def _skip_group(self) -> None:
        depth = 0
        while True:
            kind, value = self.toks[self.i]
            self.i += 1
            if (kind, value) == ("op", "("):
                depth += 1
            elif (kind, value) == ("op", ")"):
                depth -= 1
                if depth == 0:
                    return


def _min_rep(rep: str) -> int:
    low = rep[1:-1].split(",")[0]
    return int(low) if low else 0


# -- JSON schemas -------------------------------------------------------------------------------
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
# The most characters, items or properties a schema may demand: no reply holds more (a context
# window is at most a few hundred thousand tokens), and xgrammar unrolls such counts into rules.
MAX_SCHEMA_COUNT = 100_000
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # keys are names


def check_schema(schema: object, param: str) -> None:
    """Refuse (InvalidParamsError naming the keyword and where it sits) a JSON schema that is
    not a valid Draft 2020-12 schema, that uses what xgrammar would not enforce, that refers to
    anything outside itself, or that no value can satisfy in ways cheap to see (an empty enum,
    a minimum above its maximum, a required property that may not appear, a count no reply can
    hold)."""
    _check_valid_then(_check_node, schema, param)


def check_tool_parameters(schema: object, param: str) -> None:
    """A function's `parameters`: a valid JSON schema of an object (a call's arguments are a
    JSON object, whatever the tool_choice), referring to nothing outside itself."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        kind = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
        raise InvalidParamsError(f"a function's 'parameters' must be a JSON schema of type 'object' (a call's "
                                 f"arguments are a JSON object), got type {_short(str(kind))!r}", param)
    _check_valid_then(_check_refs, schema, param)


def _check_valid_then(check, schema: object, param: str) -> None:
    """A valid Draft 2020-12 schema, then ``check(schema, param, path)`` of kvship's own rules:
    each failure as an InvalidParamsError on ``param``."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        # No format checker: `pattern` is an ECMA regex that Python's re may not read; xgrammar
        # parses it and a bad one is refused when it is compiled.
        Draft202012Validator.check_schema(schema, format_checker=None)
        check(schema, param, "#")
    except SchemaError as exc:
        raise InvalidParamsError(_schema_error(exc), param) from None
    except RecursionError:
        raise InvalidParamsError("the JSON schema is nested too deeply", param) from None


def _check_refs(schema: object, param: str, path: str) -> None:
    if isinstance(schema, dict):
        _check_local_ref(schema.get("$ref"), param, path)
        for key, value in schema.items():
            _check_refs(value, param, f"{path}/{_escape(str(key))}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            _check_refs(value, param, f"{path}/{i}")


def _check_local_ref(ref: object, param: str, path: str) -> None:
    if isinstance(ref, str) and not ref.startswith("#"):
        raise InvalidParamsError(f"the JSON schema's '$ref' {_short(ref)!r} (at {path}) refers outside the "
                                 "schema; only references within it (#/$defs/...) are followed, nothing is "
                                 "fetched", param)


def _schema_error(exc: Any) -> str:
    """A jsonschema SchemaError as a message naming the keyword at fault and where it sits."""
    path = list(exc.absolute_path)
    keyword = next((p for i, p in reversed(list(enumerate(path)))
                    if isinstance(p, str) and (i == 0 or path[i - 1] not in _NAMED)), exc.validator)
    return f"the JSON schema's {keyword!r} (at {_pointer(path)}) is invalid: {_short(exc.message)}"


def _check_node(schema: object, param: str, path: str) -> None:
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
        if key == "$ref":
            _check_local_ref(value, param, path)
    _check_satisfiable(schema, param, path)
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                _check_node(sub, param, f"{path}/{key}/{_escape(name)}")
        elif key in ("items", "additionalProperties"):
            _check_node(value, param, f"{path}/{key}")
        elif key in ("prefixItems", "anyOf", "oneOf") and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_node(sub, param, f"{path}/{key}/{i}")


def _check_satisfiable(schema: dict, param: str, path: str) -> None:
    """What no value can satisfy, in one schema object alone."""
    def refuse(keyword: str, why: str) -> None:
        raise InvalidParamsError(f"the JSON schema's {keyword!r} (at {path}) {why}; no value can satisfy it", param)

    if schema.get("enum") == []:
        refuse("enum", "is empty")
    for low, high in _BOUNDS:
        if schema.get(low, 0) > MAX_SCHEMA_COUNT:
            refuse(low, f"asks for {schema[low]:.0f}, more than any reply can hold (at most {MAX_SCHEMA_COUNT})")
        if low in schema and high in schema and schema[low] > schema[high]:
            refuse(low, f"({schema[low]}) is greater than {high!r} ({schema[high]})")
    lows = [(schema[k], k) for k in ("minimum", "exclusiveMinimum") if _number(schema.get(k))]
    highs = [(schema[k], k) for k in ("maximum", "exclusiveMaximum") if _number(schema.get(k))]
    if lows and highs:
        (lo, lo_key), (hi, hi_key) = max(lows), min(highs)
        if lo > hi or (lo == hi and "exclusive" in lo_key + hi_key):
            refuse(lo_key, f"({lo}) leaves no number up to {hi_key!r} ({hi})")
    required = schema.get("required", [])
    props = schema.get("properties", {})
    if required and isinstance(props, dict):
        # Constrained output is strict: properties not declared may appear only where
        # additionalProperties allows them.
        closed = schema.get("additionalProperties", False) is False
        for name in required:
            if props.get(name) is False or (name not in props and closed):
                refuse("required", f"names {_short(name)!r}, which "
                       + ("its schema forbids" if name in props else
                          "is not among 'properties' while 'additionalProperties' is "
                          + ("false" if "additionalProperties" in schema else "not given (no other property "
                             "may appear)")))
        if len(set(required)) > schema.get("maxProperties", len(required)):
            refuse("required", f"names {len(set(required))} properties, more than 'maxProperties' "
                   f"({schema['maxProperties']})")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _pointer(path: list) -> str:
    return "#" + "".join(f"/{_escape(str(p))}" for p in path)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
          "choice": "choice list", "grammar": "grammar", "structural_tag": "structural tag"}
# xgrammar's messages start with a time and the C++ source line ("[06:42:34] /project/cpp/x.cc:83:
# "); failed internal checks say so ("Check failed: (...) is false").
_SOURCE_PREFIX = re.compile(r"^\s*(?:\[[\d:.]+\]\s*)?(?:\S+\.(?:cc|cpp|h|hpp):\d+:\s*)?")
_SOURCE_PATH = re.compile(r"\S*/\S+\.(?:cc|cpp|h|hpp)(?::\d+)?:?")


def clean_error(exc: BaseException) -> str:
    """The first line of an xgrammar error, without the C++ source location or internals."""
    text = str(exc).strip() or type(exc).__name__
    line = _SOURCE_PREFIX.sub("", text.splitlines()[0])
    if line.startswith("Check failed"):  # "Check failed: (<C++ condition>) is false: <message, if any>"
        line = line.partition(") is false:")[2]
    if not line.strip() or _SOURCE_PATH.search(line):
        return "it is not supported by the grammar engine"
    return _short(line.strip(), 500) or type(exc).__name__


def canonical_json(value: Any) -> str:
    """Compact JSON text of a schema (a cache key). Key order is kept: it is the order in which
    the constrained output writes an object's properties."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
