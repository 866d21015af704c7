"""Tokenizer: a `tokenizers.Tokenizer` plus the special-token facts and chat template that
serving needs. Built from an HF folder (tokenizer.json and friends) or from GGUF metadata."""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from .chat_template import ChatTemplateError, render_chat_template
from .errors import ModelSourceError

__all__ = ["Tokenizer", "ChatTemplateError"]

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end an assistant turn in common chat formats; a GGUF's control token with one of
# these names stops generation when the chat template uses it (llama.cpp does the same).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# A byte-level ("gpt2") GGUF vocabulary's pre-tokenizer, named by tokenizer.ggml.pre as llama.cpp's
# converter writes it: the regular expressions that cut the text before BPE, applied one after
# the other (each cuts every piece the one before left into its matches and the text between),
# as the model's own tokenizer.json has them and llama.cpp's llama-vocab.cpp reimplements them.
# GPT-2's own split is the byte-level step's built-in one (None here).
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_TEKKEN = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"""
           r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_DEEPSEEK_V3 = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"""
                r""" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""]
# DeepSeek-LLM and DeepSeek-V2 ("deepseek-llm"), as their tokenizer.json has it: newlines apart, words of
# the cased scripts (Latin, Greek, Cyrillic, Armenian, Georgian, ...) with at most one space before them,
# runs of ASCII and full-width punctuation, whitespace at the end of a piece, CJK and Hangul runs, then
# every digit apart (its Digits step, individual_digits). llama.cpp cuts digit runs whole there (\p{N}+);
# the tokens agree, as the vocabulary joins no digits (llama.cpp's tokenizer test data: "333" and "w048"
# come out a digit a token), but the pieces here are the model's own. The code points are written as
# escapes: NFC, which an editor may apply, turns the range ends U+1F7D, U+1FD3, U+1FDB into U+03CE, U+0390,
# U+038A (reversed ranges: the regex no longer compiles) and U+212A (Kelvin sign) into K (a range K-U+212D:
# brackets, "_", "{", ... and most of Latin-1 and General Punctuation would count as letters).
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943")
_DEEPSEEK_LLM = ["[\r\n]", r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
                 "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                 "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"]
_SMOLLM = [r"\p{N}", _GPT2]  # digits one by one, then GPT-2's
# name -> (splits, whether a piece that is a whole token skips the merges: llama.cpp's ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[list[str] | None, bool]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2"), ([_LLAMA3], True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ([_LLAMA3], False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"), ([_QWEN2], False)),
    "deepseek-v3": (_DEEPSEEK_V3, False),
    "deepseek-llm": (_DEEPSEEK_LLM, False),
    "tekken": ([_TEKKEN], True),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (_SMOLLM, False)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"), (None, False)),
}


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[Any, bool]:
    """The pre-tokenizer of a byte-level vocabulary named ``pre`` (tokenizer.ggml.pre), and its
    ignore_merges flag. A file without the key takes GPT-2's split; a name not listed too, with a
    warning: its text may cut otherwise than the model's own tokenizer does."""
    if pre is not None and pre not in _PRE_TOKENIZERS:
        log.warning("GGUF pre-tokenizer %r is not known here: GPT-2's split is used, which may cut some text "
                    "differently from the model's own tokenizer", pre)
    splits, ignore_merges = _PRE_TOKENIZERS.get(pre, (None, False))
    if splits is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True), ignore_merges
    steps = [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in splits]
    return pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                                     use_regex=False)]), ignore_merges


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"cannot read {path!r}: {e}") from None
    return data if isinstance(data, dict) else {}


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if x is not None]
    return [int(v)]


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, unk_token: str | None = None, pad_token: str | None = None,
                 extra_eos_ids: list[int] | tuple[int, ...] = (), chat_template: str | None = None,
                 add_bos_token: bool = False) -> None:
        self._tok = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = backend.token_to_id(eos_token) if eos_token else None
        self.unk_token_id = backend.token_to_id(unk_token) if unk_token else None
        self.pad_token_id = backend.token_to_id(pad_token) if pad_token else None
        self.eos_token_ids: set[int] = set(extra_eos_ids)
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        special |= {i for i in (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
                    if i is not None}
        self.all_special_ids: set[int] = special
        self.chat_template = chat_template
        # Prepend BOS ourselves when the config asks for it but the post-processor does not.
        self._prepend_bos = False
        if add_bos_token and self.bos_token_id is not None:
            probe = backend.encode("a", add_special_tokens=True).ids
            self._prepend_bos = not probe or probe[0] != self.bos_token_id

    # -- encoding / decoding
    # `tokenizers` holds the interpreter's lock through encode() but lets go of it in
    # encode_batch(): for a long text (seconds of work) that is the difference between a server
    # whose other threads (event loop, engine loop) keep running and one that freezes.
    RELEASE_GIL_CHARS = 8192

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.RELEASE_GIL_CHARS:
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        """Display form of one token: the text that token decodes to on its own."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry (e.g. byte-level form 'Ġhello')."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token covers more of a text than
        this (byte-level entries spell one byte per character, so a multi-byte character
        costs several), which bounds a text's token count from below without tokenising it."""
        return max(len(self._tok.id_to_token(i) or "") for i in range(self.vocab_size)) or 1

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        template = kwargs.pop("chat_template", None) or self.chat_template
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "unk_token": self.unk_token, "pad_token": self.pad_token}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=special, **kwargs)

    # -- construction
    @classmethod
    def from_hf_folder(cls, path: str, generation_config: dict | None = None) -> "Tokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ModelSourceError(
                f"{path!r} has no tokenizer.json; only models with a fast (tokenizers) tokenizer "
                "are supported. Save one with transformers' tokenizer.save_pretrained().")
        try:
            backend = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ModelSourceError(f"cannot read {tj!r}: {e}") from None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        smap = _read_json(os.path.join(path, "special_tokens_map.json"))
        if generation_config is None:
            generation_config = _read_json(os.path.join(path, "generation_config.json"))

        def special(name: str) -> str | None:
            return _token_content(cfg.get(name)) or _token_content(smap.get(name))

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if not template and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if not template:
            ct = _read_json(os.path.join(path, "chat_template.json"))
            template = ct.get("chat_template")
        extra = _as_id_list(generation_config.get("eos_token_id"))
        return cls(backend, bos_token=special("bos_token"), eos_token=special("eos_token"),
                   unk_token=special("unk_token"), pad_token=special("pad_token"), extra_eos_ids=extra,
                   chat_template=template or None, add_bos_token=bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """The tokenizer a GGUF file's metadata describes: byte-level BPE with its merges ("gpt2":
        Llama 3, Qwen, Phi-4, SmolLM) or SentencePiece's BPE ("llama": Llama 2, Mistral, Gemma,
        Phi-3), as llama.cpp tokenizes them."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        if kind not in ("gpt2", "llama"):
            raise ModelSourceError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and SentencePiece "
                "'llama' are); use the model's HF folder instead.")
        types = meta.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}

        def tok(key: str) -> str | None:
            i = meta.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        unk = tok("tokenizer.ggml.unknown_token_id")
        bos, eos, pad = tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id"), \
            tok("tokenizer.ggml.padding_token_id")
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            pre, ignore_merges = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
            backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                                      byte_fallback=True, ignore_merges=ignore_merges))
            backend.normalizer = normalizers.Sequence([])
            backend.pre_tokenizer = pre
            backend.decoder = decoders.ByteLevel()
        else:
            backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                         unk, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        # llama.cpp's rule for Phi-3 files (by name, as their tokenizer.json has it): whitespace after
        # a control or user-defined piece is dropped, except after <unk>, <s> and <|endoftext|>
        name = str(meta.get("general.name", "")).lower()
        phi3 = "phi-3" in name or "phi3" in name

        def rstrip(piece: str) -> bool:
            return phi3 and piece not in ("<unk>", "<s>", "<|endoftext|>")

        specials = [AddedToken(tokens[i], normalized=False, special=True, rstrip=rstrip(tokens[i]))
                    for i, t in enumerate(types) if t == _TT_CONTROL]
        if specials:
            backend.add_special_tokens(specials)
        user = [AddedToken(tokens[i], normalized=False, special=False, rstrip=rstrip(tokens[i]))
                for i, t in enumerate(types) if t == _TT_USER_DEFINED]
        if user:
            backend.add_tokens(user)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        single, pair, sp = ["$A:0"], ["$A:0", "$B:1"], []
        if add_bos:
            single, pair = [f"{bos}:0"] + single, [f"{bos}:0", "$A:0", f"{bos}:1", "$B:1"]
            sp.append((bos, vocab[bos]))
        if add_eos:
            single, pair = single + [f"{eos}:0"], pair + [f"{eos}:1"]
            if (eos, vocab[eos]) not in sp:
                sp.append((eos, vocab[eos]))
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=sp)
        template = meta.get("tokenizer.chat_template")
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        if template:
            for name in _END_OF_TURN:
                i = vocab.get(name)
                if i is not None and name in template and types[i] == _TT_CONTROL:
                    extra.append(i)
        return cls(backend, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad, extra_eos_ids=extra,
                   chat_template=template)


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk: str | None,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as llama.cpp runs it from a GGUF vocabulary: spaces become "▁" (and one
    leads the text when ``add_space_prefix``), then adjacent pieces merge, the pair whose joined
    piece scores highest first, and characters no piece holds fall back to their UTF-8 bytes
    (the <0xXX> pieces). The tokenizers library's BPE does the same given the merges ranked by
    the joined piece's score, which the file does not store: every split of a normal piece into
    two pieces of the vocabulary is one (as transformers derives them for SentencePiece models)."""
    # user-defined pieces join merges too: one written with "▁" ("▁▁" in older Gemma files) is
    # never matched in the raw text, only formed from its halves, as llama.cpp's merging does
    normal = {t: i for i, t in enumerate(tokens) if types[i] in (_TT_NORMAL, _TT_UNKNOWN, _TT_USER_DEFINED)}
    merges = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((-scores[i], i, normal[left], normal[right], left, right))
    merges.sort()
    backend = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [(m[4], m[5]) for m in merges],
                                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_space_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend
