"""A byte-level GGUF vocabulary cuts text before BPE as its tokenizer.ggml.pre names: kvship's
pre-tokenizer (the model's tokenizer.json regexes, in the tokenizers library) against llama.cpp's
reimplementation of the same names (its own regex strings, applied one after the other as its
unicode_regex_split does, here with the regex package) on mixed texts: contractions in upper case,
digit runs, punctuation before newlines, CJK, emoji, code."""
from __future__ import annotations

import logging

import pytest
import regex
from tokenizers import pre_tokenizers

from kvship.loader.tokenizer import Tokenizer
from test_tokenizer import TEXTS

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's regex lists (llama-vocab.cpp), as it writes them: case-insensitive groups spelled out
LLAMA_CPP = {
    "llama-bpe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "deepseek-v3": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "smollm": [r"\p{N}", _GPT2],
    "gpt-2": [_GPT2],
    # Mistral's tekken: its tokenizer.json's own (llama.cpp approximates the letter classes)
    "tekken": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
               r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
}
MORE_TEXTS = TEXTS + ["if (x):\n\n\treturn y;\r\n}\n", "(word) [list] {dict} <tag>", "1234567 and 12 and 123456",
                      "Don't STOP, we're 'LL go", "中文1234日本語カタカナ"]


def _llama_cpp_split(text: str, exprs: list[str]) -> list[str]:
    pieces = [text]
    for expr in exprs:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(expr, piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def _tokenizer(pre: str | None, extra: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level vocabulary of the 256 byte symbols (and ``extra`` pieces), no merges."""
    meta = {"tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": sorted(pre_tokenizers.ByteLevel.alphabet()) + list(extra),
            "tokenizer.ggml.merges": []}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("pre", list(LLAMA_CPP))
def test_pre_tokenizer_cuts_as_llama_cpp(pre):
    backend = _tokenizer(pre)._tok
    for text in MORE_TEXTS:
        ours = [text[s:e] for _, (s, e) in backend.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == _llama_cpp_split(text, LLAMA_CPP[pre]), text


def test_the_names_differ_where_they_should():
    """The splits really differ (so the test above can tell them apart): Llama 3 keeps three
    digits and a punctuation run with its newlines, Qwen2 one digit, GPT-2 the whole number."""
    text = "x = 12345;\n\n"
    cut = {pre: [text[s:e] for _, (s, e) in _tokenizer(pre)._tok.pre_tokenizer.pre_tokenize_str(text)]
           for pre in ("llama-bpe", "qwen2", "gpt-2")}
    assert cut["llama-bpe"] == ["x", " =", " ", "123", "45", ";\n\n"]
    assert cut["qwen2"] == ["x", " =", " ", "1", "2", "3", "4", "5", ";\n\n"]
    assert cut["gpt-2"] == ["x", " =", " 12345", ";", "\n\n"]


def test_unknown_pre_tokenizer_warns_and_keeps_gpt2(caplog):
    with caplog.at_level(logging.WARNING, logger="kvship.loader.tokenizer"):
        backend = _tokenizer("some-new-model")._tok
    assert "GGUF pre-tokenizer 'some-new-model' is not known here" in caplog.text
    text = "Hello 123 world's"
    assert [text[s:e] for _, (s, e) in backend.pre_tokenizer.pre_tokenize_str(text)] == \
        _llama_cpp_split(text, LLAMA_CPP["gpt-2"])


def test_llama3_takes_a_whole_piece_without_merges():
    """llama.cpp's ignore_merges for Llama 3 (as its tokenizer.json's): a pre-token that is a
    token of the vocabulary is that token, merges or not; Qwen2 builds it from merges alone."""
    for pre, want in (("llama-bpe", ["Ġworld"]), ("qwen2", ["Ġ", "w", "o", "r", "l", "d"])):
        tok = _tokenizer(pre, extra=("Ġworld",))
        assert [tok._tok.id_to_token(i) for i in tok.encode(" world", add_special_tokens=False)] == want, pre
