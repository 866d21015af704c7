"""A GGUF file's SentencePiece vocabulary ("llama": Llama 2, Mistral, Gemma, Phi-3) tokenizes as
SentencePiece itself does. A BPE model is trained here by the sentencepiece library on a text
shipped in a package (transformers' package description), with byte fallback, user-defined and
control pieces; its pieces, scores and types are written as llama.cpp's converter writes them
into GGUF metadata, and kvship's tokenizer from that metadata must give SentencePiece's ids and
text back, with and without the leading space; around control and user-defined pieces, llama.cpp's
rule (each run of text between them tokenized on its own)."""
from __future__ import annotations

import importlib.metadata
import io

import pytest

spm = pytest.importorskip("sentencepiece")

from kvship.core.detokenizer import IncrementalDetokenizer  # noqa: E402
from kvship.loader.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TEXTS = [
    "Hello world",
    "  two leading spaces and  doubled   gaps",
    "State-of-the-art Machine Learning for JAX, PyTorch and TensorFlow.",
    "tabs\tand\nnew lines\n\n",
    "unseen letters: ünïcödé, 中文, emoji 🤖 fall back to bytes",
    "a control piece <ctl> inside, and a user piece <usr> too",
    "",
    "1234567890 numbers 3.14159",
]


def _trained(add_dummy_prefix: bool):
    corpus = importlib.metadata.metadata("transformers").get_payload().splitlines()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([line for line in corpus if line.strip()]), model_writer=model,
                                   model_type="bpe", vocab_size=600, byte_fallback=True,
                                   add_dummy_prefix=add_dummy_prefix, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, control_symbols=["<ctl>"],
                                   user_defined_symbols=["<usr>"], minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _gguf_metadata(sp, add_dummy_prefix: bool) -> dict:
    """The keys llama.cpp's converter writes for a SentencePiece model (its token types:
    1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
    types = []
    for i in range(sp.get_piece_size()):
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
                     5 if sp.is_unused(i) else 4 if sp.id_to_piece(i) == "<usr>" else 1)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(len(types))],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(types))],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": sp.bos_id(),
            "tokenizer.ggml.eos_token_id": sp.eos_id(), "tokenizer.ggml.unknown_token_id": sp.unk_id(),
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": add_dummy_prefix}


def _llama_cpp_ids(sp, text: str) -> list[int]:
    """llama.cpp's rule for a text holding control or user-defined pieces: the text is cut at
    them, each piece is its own id, and every run of text between is tokenized by SentencePiece
    on its own (with the leading space, where the vocabulary adds one, again after each piece)."""
    ids: list[int] = []
    for i, part in enumerate(text.replace("<usr>", "\0<usr>\0").replace("<ctl>", "\0<ctl>\0").split("\0")):
        ids += [sp.piece_to_id(part)] if i % 2 else sp.encode(part)
    return ids


@pytest.mark.parametrize("add_dummy_prefix", [True, False])  # Llama 2 / Mistral / Phi-3 prefix a space, Gemma not
def test_gguf_sentencepiece_vocabulary_tokenizes_as_sentencepiece(add_dummy_prefix):
    sp = _trained(add_dummy_prefix)
    ours = Tokenizer.from_gguf_metadata(_gguf_metadata(sp, add_dummy_prefix))
    for text in TEXTS:
        got = ours.encode(text)
        assert got[0] == sp.bos_id() and got[1:] == _llama_cpp_ids(sp, text), text
        if "<" not in text:  # plain text: SentencePiece's own ids and text
            assert got[1:] == sp.encode(text) and ours.decode(got[1:]) == text, text
        assert ours.decode(got[1:]) == sp.decode(got[1:]), text
    assert sp.piece_to_id("<0xF0>") in ours.encode("🤖")  # byte fallback took part
    # streamed a token at a time after a prompt, the text comes out whole (spaces, bytes, pieces)
    prompt, out = ours.encode("Machine"), ours.encode(" ".join(TEXTS), add_special_tokens=False)
    stream = IncrementalDetokenizer(ours, prompt)
    text = "".join(stream.push([i]) for i in out) + stream.flush()
    head = ours.decode(prompt)
    assert text == ours.decode(prompt + out)[len(head):] and text.strip() == ours.decode(out).strip()


def test_phi3_files_drop_whitespace_after_pieces():
    """llama.cpp's rule for Phi-3 files (named so in general.name): whitespace after a control or
    user-defined piece goes, so the next word takes SentencePiece's leading space instead."""
    sp = _trained(True)
    meta = _gguf_metadata(sp, True)
    phi3 = Tokenizer.from_gguf_metadata(meta | {"general.name": "Phi-3-mini-4k-instruct"})
    plain = Tokenizer.from_gguf_metadata(meta)
    for piece in ("<usr>", "<ctl>"):
        text = f"a{piece}\n  b c"
        want = sp.encode("a") + [sp.piece_to_id(piece)] + sp.encode("b c")
        assert phi3.encode(text)[1:] == want
        assert plain.encode(text)[1:] == _llama_cpp_ids(sp, text) != want
