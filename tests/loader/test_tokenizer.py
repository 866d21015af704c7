"""Tokenizer and chat template: parity with transformers' tokenizer built from the same GGUF,
special tokens, decoding, and the sandboxed template renderer."""
from __future__ import annotations

import os

import pytest

from kvship.loader import ChatTemplateError, Tokenizer
from kvship.loader.gguf_file import GGUFFile

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "multiple     spaces\u00a0and nbsp",
    "Ünïcödé: café, naïve, Straße, ĳ, ﬁ ligature",
    "中文字符和日本語のテキスト、한국어",
    "emoji 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "'s 't 're 've 'm 'll 'd I'M WE'RE",
    "",
    " ",
    "\n",
    "a" * 300,
    "ÀÁÂÃÄÅàáâãäå\u0301\u200b zero-width",
    "<repo_name>x<file_sep>y",
]


@pytest.fixture(scope="module")
def ours(bundled):
    return Tokenizer.from_gguf_metadata(GGUFFile(bundled).metadata)


@pytest.fixture(scope="module")
def hf(bundled):
    transformers = pytest.importorskip("transformers")
    folder, fname = os.path.split(bundled)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)


def test_encode_decode_parity_with_transformers(ours, hf):
    for text in TEXTS:
        for special in (True, False):
            want = hf(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == want, text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), text
    # decoding arbitrary id runs (not only round trips)
    for start in range(0, 49152, 4099):
        ids = list(range(start, min(start + 40, 49152)))
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_round_trip_and_special_tokens(ours):
    for text in TEXTS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2
    assert ours.eos_token_ids == {2}
    assert {0, 1, 2} <= ours.all_special_ids and 100 not in ours.all_special_ids
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special tokens are single ids, never split
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)  # no BOS
    hello = ours.encode(" hello")
    assert len(hello) == 1 and ours.token_to_str(hello[0]) == " hello"
    assert ours.id_to_token(hello[0]) == "Ġhello"
    assert ours.token_to_str(2) == "<|im_end|>"


def test_chat_template_renders_chatml(ours):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    out = ours.apply_chat_template(msgs)
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = ours.apply_chat_template(msgs, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    sys_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    out = ours.apply_chat_template(sys_msgs)
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and "SmolLM" not in out
    assert out.count("<|im_start|>") == 5


def test_chat_template_matches_transformers(ours, hf):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "héllo 😀"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    for gen in (True, False):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_chat_template_helpers_and_errors(ours):
    t = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
         "{{ bos_token }}{{ m | tojson }}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
         "{% if loop.index == 1 %}{% continue %}{% endif %}|{% endfor %}{{ strftime_now('%Y') | length }}")
    out = ours.apply_chat_template([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}],
                                   chat_template=t)
    assert out == '<|im_start|>{"role": "user", "content": "é"}[é]<|im_start|>{"role": "user", "content": "x"}[x]|4'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=t)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours.apply_chat_template([], chat_template="{% for %}")
    # the sandbox refuses access to Python internals
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([], chat_template="{% set _ = messages.append(1) %}")
    no_template = Tokenizer(ours.backend, eos_token="<|im_end|>", chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    assert issubclass(ChatTemplateError, ValueError)
    # extra keyword arguments reach the template
    assert ours.apply_chat_template([], chat_template="{{ tools | length }}", tools=[1, 2]) == "2"
