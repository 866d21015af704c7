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
# DeepSeek-LLM / V2's letter class in llama.cpp's list, its code points escaped (NFC would reverse ranges)
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
_DEEPSEEK_LLM_CPP = ["[\r\n]", "\\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", "\\s+$",
                     "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}+"]
# llama.cpp's regex lists (llama-vocab.cpp), as it writes them: case-insensitive groups spelled out
LLAMA_CPP = {
    "llama-bpe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "deepseek-v3": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    # llama.cpp keeps a digit run whole (\p{N}+) where the model's tokenizer.json cuts every digit (Digits,
    # individual_digits) as kvship does: the same tokens, the vocabulary joining no digits; cut them after it
    "deepseek-llm": _DEEPSEEK_LLM_CPP + [r"\p{N}"],
    "smollm": [r"\p{N}", _GPT2],
    "gpt-2": [_GPT2],
    # Mistral's tekken: its tokenizer.json's own (llama.cpp approximates the letter classes)
    "tekken": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
               r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
}
MORE_TEXTS = TEXTS + ["if (x):\n\n\treturn y;\r\n}\n", "(word) [list] {dict} <tag>", "1234567 and 12 and 123456",
                      "Don't STOP, we're 'LL go", "中文1234日本語カタカナ",
                      "Привет, мир😀 Καλημέρα→ \u1f7d\u1fd3 \u212a\u2126 \U00010400\U00010428 a_b[c]{d}",
                      "한국어 텍스트。\u3000全角：（括弧）！\n\n  end 😀  \t"]


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
