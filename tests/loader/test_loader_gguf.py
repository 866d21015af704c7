"""GGUF loading: our reader and dequantizers against the `gguf` package, and the bundled
SmolLM2 model against the state dict transformers builds from the same file."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kvship.loader import ModelSourceError, resolve_model
from kvship.loader.gguf import gguf_model_name
from kvship.loader.gguf_blocks import dequantize
from kvship.loader.gguf_file import GGUFFile
from kvship.quant import QuantizedTensor

ALL_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
             QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# byte offsets of the f16 scale fields inside one block, per quantized type
F16_FIELDS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
              QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def _random_blocks(qtype, rows: int, row_len: int, seed: int) -> np.ndarray:
    """Arbitrary block bytes with finite, small f16 scales: dequantization is defined on any
    bit pattern, so this exercises every bit of every field."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * row_len // bs
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    for k, off in enumerate(F16_FIELDS[qtype]):
        raw[:, off:off + 2] = (rng.standard_normal((nb, 1)) * 0.02).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, row_len // bs * ts)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_dequantize_random_blocks_match_gguf(qtype):
    raw = _random_blocks(qtype, rows=8, row_len=1024, seed=int(qtype))
    ref = quants.dequantize(raw, qtype)
    ours = dequantize(raw, int(qtype), ref.shape)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    np.testing.assert_array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1],
                         ids=lambda t: t.name)
def test_dequantize_quantized_data_matches_gguf(qtype):
    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    q = quants.quantize(x, qtype)
    ref = quants.dequantize(q, qtype)
    ours = dequantize(q.view(np.uint8), int(qtype), ref.shape).float().numpy()
    np.testing.assert_array_equal(ours, ref.astype(np.float32))
    assert np.abs(ours - x).max() < 0.5  # and it is an approximation of the input


def test_reader_matches_gguf_package(bundled):
    ref = gguf.GGUFReader(bundled)
    ours = GGUFFile(bundled)
    assert ours.version == 3
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if isinstance(want, float):
            assert got == pytest.approx(want)
        else:
            assert got == want, key
    assert len(ours.metadata) == len([k for k in ref.fields if not k.startswith("GGUF.")])
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    seen = set()
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.dims == tuple(int(d) for d in t.shape)
        assert info.ggml_type == int(t.tensor_type)
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        # real tensors of every type the file holds, dequantized both ways
        if t.tensor_type not in seen:
            seen.add(t.tensor_type)
            want = quants.dequantize(t.data, t.tensor_type)
            got = info.load().numpy()
            np.testing.assert_array_equal(got, want.reshape(got.shape))
    assert {QT.Q8_0, QT.Q4_1, QT.F32} <= seen


def test_bundled_config_and_tokenizer(bundled):
    src = resolve_model(None)
    assert src.path == bundled
    assert src.name == "SmolLM2-135M-Instruct"
    c = src.hf_config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["vocab_size"], c["intermediate_size"], c["head_dim"]) == (30, 576, 9, 3, 49152, 1536, 64)
    assert c["tie_word_embeddings"] is True
    assert c["rope_theta"] == 100000.0 and c["rms_norm_eps"] == 1e-5
    assert c["max_position_embeddings"] == 8192
    assert c["bos_token_id"] == 1 and c["eos_token_id"] == 2
    tok = src.tokenizer
    assert tok.vocab_size == 49152 and tok.eos_token_id == 2 and 2 in tok.eos_token_ids
    assert "<|im_start|>" in tok.chat_template
    refs = dict(src.weights())
    # tied: the head gets the embedding's Q8_0 blocks too (kept quantized on a GPU)
    assert isinstance(refs["lm_head.weight"].load(), QuantizedTensor) and "model.embed_tokens.weight" in refs
    assert len(refs) == 273


def test_weights_equal_transformers_state_dict(bundled):
    """Every parameter equals transformers' own GGUF load of the same file; in particular
    q_proj / k_proj prove the rope row permutation is undone."""
    transformers = pytest.importorskip("transformers")
    folder, fname = os.path.split(bundled)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    ref = model.state_dict()
    src = resolve_model(bundled)
    ours = dict(src.weights())
    assert set(ours) == set(ref)  # tied: HF's alias, ours the embedding's blocks for the head
    for name, w in ours.items():
        t = w.load()
        assert tuple(t.shape) == w.shape == tuple(ref[name].shape), name
        if name == "lm_head.weight":  # the Q8_0 token embedding's blocks
            assert isinstance(t, QuantizedTensor) and t.bits == 8 and t.group_size == 32
            t = t.dequantize()
        elif isinstance(t, QuantizedTensor):  # linear layers stay in their Q4_1 blocks (codes, scales, offsets)
            assert name.endswith("_proj.weight") and t.bits == 4 and t.group_size == 32, name
            t = t.dequantize()
        else:
            assert t.dtype == w.dtype
        torch.testing.assert_close(t.float(), ref[name], rtol=0, atol=0, msg=name)
    # partial loads: head-aligned rows, unaligned rows, columns whole groups at a time
    q = ours["model.layers.3.self_attn.q_proj.weight"]
    full = q.load().dequantize()
    for sl in [(slice(64, 256),), (slice(10, 50), slice(32, 96)), (slice(None), slice(0, 288))]:
        torch.testing.assert_close(q.load(sl).dequantize(), full[sl], rtol=0, atol=0)
    with pytest.raises(ValueError, match="split a quantization group"):
        q.load((slice(None), slice(3, 100)))
    for name in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        ref_full = ours[name].load()
        quantized = isinstance(ref_full, QuantizedTensor)
        full = ref_full.dequantize() if quantized else ref_full
        for sl in [(slice(5, 17),), (slice(64, 128), slice(32, 64))][: full.dim()]:
            part = ours[name].load(sl)
            torch.testing.assert_close(part.dequantize() if quantized else part, full[sl], rtol=0, atol=0, msg=name)
    k = ours["model.layers.3.self_attn.k_proj.weight"]
    torch.testing.assert_close(k.load((slice(64, 128),)).dequantize(), k.load().dequantize()[64:128], rtol=0, atol=0)


def _write_gguf(path, arch, tensors: dict, meta: dict | None = None, tokens=True):
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (meta or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_string(k, v)
    if tokens:
        toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] \
            + ["Ġ", "ab", "Ġa"]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(toks)
        w.add_token_types([3, 3, 3] + [1] * (len(toks) - 3))
        w.add_token_merges(["a b", "Ġ a"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name, (arr, qtype) in tensors.items():
        if qtype in (None, QT.F32):
            w.add_tensor(name, arr)
        else:
            q = quants.quantize(arr, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _qwen_meta(arch):
    return {f"{arch}.block_count": 1, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": 1000000.0,
            f"{arch}.context_length": 4096}


def test_synthetic_qwen2_f16_bf16_biases_no_permutation(tmp_path):
    rng = np.random.default_rng(2)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    tensors = {
        "token_embd.weight": (f(32, 64), QT.F16),
        "blk.0.attn_q.weight": (f(64, 64), QT.BF16),
        "blk.0.attn_q.bias": (f(64), None),
        "blk.0.attn_k.weight": (f(32, 64), QT.Q8_0),
        "blk.0.attn_k.bias": (f(32), None),
        "blk.0.attn_norm.weight": (f(64), None),
        "output_norm.weight": (f(64), None),
        "output.weight": (f(32, 64), QT.Q4_0),
    }
    path = tmp_path / "Tiny-Qwen2-F16.gguf"
    _write_gguf(path, "qwen2", tensors, _qwen_meta("qwen2"))
    src = resolve_model(str(path))
    assert src.name == "Tiny-Qwen2"
    c = src.hf_config
    assert c["architectures"] == ["Qwen2ForCausalLM"] and c["tie_word_embeddings"] is False
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (4, 2, 16, 32)
    assert c["rope_theta"] == 1e6
    w = dict(src.weights())
    assert w["model.embed_tokens.weight"].dtype == torch.float16
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    # qwen2 files are not rope-permuted: values come back in file order
    q = w["model.layers.0.self_attn.q_proj.weight"].load()
    want = quants.dequantize(quants.quantize(tensors["blk.0.attn_q.weight"][0], QT.BF16), QT.BF16)
    np.testing.assert_array_equal(q.float().numpy(), want)
    np.testing.assert_array_equal(w["model.layers.0.self_attn.q_proj.bias"].load().numpy(),
                                  tensors["blk.0.attn_q.bias"][0])
    assert w["lm_head.weight"].shape == (32, 64)
    # tokenizer built from the metadata
    tok = src.tokenizer
    ids = tok.encode("ab a<|im_end|> b")
    assert ids == [tok.token_to_id(t) for t in ("ab", "Ġa")] + [2] + [tok.token_to_id(t) for t in ("Ġ", "b")]
    assert tok.decode(ids) == "ab a b"
    assert tok.decode(ids, skip_special_tokens=False) == "ab a<|im_end|> b"
    assert tok.eos_token_ids == {2}


@pytest.mark.timeout(120)
def test_quantized_output_matrix_comes_as_its_blocks(tmp_path):
    """A file's quantized output.weight reaches the LM head as its blocks (kept quantized on a
    GPU, tests/models/test_quantized_weights.py); the CPU path holds exactly the values the gguf
    library dequantizes, and the logits are those values times the final hidden state."""
    from kvship.llm import LLM
    from kvship.sampling_params import SamplingParams

    rng = np.random.default_rng(4)
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)
    tensors = {"token_embd.weight": (f(32, 64), None), "output_norm.weight": (1 + f(64), None),
               "output.weight": (f(32, 64), QT.Q8_0), "blk.0.attn_norm.weight": (1 + f(64), None),
               "blk.0.ffn_norm.weight": (1 + f(64), None),
               **{f"blk.0.{k}.weight": (f(*s), None) for k, s in (
                   ("attn_q", (64, 64)), ("attn_k", (32, 64)), ("attn_v", (32, 64)), ("attn_output", (64, 64)),
                   ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)), ("ffn_down", (64, 128)))}}
    path = tmp_path / "tiny-llama-q8-head.gguf"
    _write_gguf(path, "llama", tensors, _qwen_meta("llama"))
    w = dict(resolve_model(str(path)).weights())
    assert isinstance(w["lm_head.weight"].load(), QuantizedTensor)
    want = quants.dequantize(quants.quantize(tensors["output.weight"][0], QT.Q8_0), QT.Q8_0)
    llm = LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", max_model_len=64, num_kv_blocks=16)
    head = llm.engine.runner.model.lm_head
    assert head.qweight is None  # the CPU's float32 path: dequantized
    np.testing.assert_array_equal(head.weight.numpy(), want)
    out = llm.generate([[3, 5, 7]], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0].outputs[0]
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ torch.from_numpy(want).T)
    assert out.token_ids and len(out.logprobs[0][1]) == 3


@pytest.mark.timeout(120)
def test_tied_quantized_embedding_also_reaches_the_head_as_blocks(tmp_path):
    """No output.weight and a quantized token embedding: the embedding comes dequantized (lookups
    need it so) and the head gets the same matrix as its blocks too; on the CPU's float32 path the
    head keeps sharing the embedding's table, which holds those values."""
    from kvship.llm import LLM

    rng = np.random.default_rng(6)
    emb = rng.standard_normal((32, 64)).astype(np.float32)
    tensors = {"token_embd.weight": (emb, QT.Q8_0), "output_norm.weight": (np.ones(64, np.float32), None),
               "blk.0.attn_norm.weight": (np.ones(64, np.float32), None),
               "blk.0.ffn_norm.weight": (np.ones(64, np.float32), None),
               **{f"blk.0.{k}.weight": ((rng.standard_normal(s) * 0.3).astype(np.float32), None) for k, s in (
                   ("attn_q", (64, 64)), ("attn_k", (32, 64)), ("attn_v", (32, 64)), ("attn_output", (64, 64)),
                   ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)), ("ffn_down", (64, 128)))}}
    path = tmp_path / "tiny-llama-tied-q8.gguf"
    _write_gguf(path, "llama", tensors, _qwen_meta("llama"))
    src = resolve_model(str(path))
    assert src.hf_config["tie_word_embeddings"] is True
    w = dict(src.weights())
    want = quants.dequantize(quants.quantize(emb, QT.Q8_0), QT.Q8_0)
    np.testing.assert_array_equal(w["model.embed_tokens.weight"].load().float().numpy(), want)
    head = w["lm_head.weight"].load()
    assert isinstance(head, QuantizedTensor)
    np.testing.assert_array_equal(head.dequantize(torch.float32).numpy(), want)
    model = LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", max_model_len=64,
                num_kv_blocks=16).engine.runner.model
    assert model.lm_head.qweight is None and model.lm_head.weight is model.model.embed_tokens.weight


def test_split_gguf_shards_load_together(tmp_path):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    _write_gguf(tmp_path / "m-00001-of-00002.gguf", "qwen3", {"token_embd.weight": (a, None)},
                {**_qwen_meta("qwen3"), "split.count": 2})
    _write_gguf(tmp_path / "m-00002-of-00002.gguf", "qwen3", {"blk.0.attn_q_norm.weight": (b, None)},
                tokens=False)
    src = resolve_model(str(tmp_path / "m-00002-of-00002.gguf"))
    w = dict(src.weights())
    assert set(w) == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight"}
    np.testing.assert_array_equal(w["model.layers.0.self_attn.q_norm.weight"].load().numpy(), b)
    assert src.name == "m" and src.hf_config["model_type"] == "qwen3"
    os.remove(tmp_path / "m-00001-of-00002.gguf")
    with pytest.raises(ModelSourceError, match="shards"):
        resolve_model(str(tmp_path / "m-00002-of-00002.gguf"))


def test_corrupt_gguf_is_a_model_source_error(tmp_path, bundled):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelSourceError, match="not a GGUF"):
        resolve_model(str(bad))
    truncated = tmp_path / "trunc.gguf"
    with open(bundled, "rb") as f:
        truncated.write_bytes(f.read(2_000_000))
    with pytest.raises(ModelSourceError, match="corrupt or truncated|past the end"):
        resolve_model(str(truncated))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelSourceError):
        resolve_model(str(empty))


def test_model_names():
    assert gguf_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert gguf_model_name("/x/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct"
    assert gguf_model_name("/x/llama-3-8b-f16-00001-of-00004.gguf") == "llama-3-8b"
    assert gguf_model_name("/x/plain.gguf") == "plain"
