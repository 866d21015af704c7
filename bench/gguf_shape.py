"""A GGUF file of a benchmark shape (Llama-architecture dense shapes), its tensors in the types
llama.cpp's quantizer picks for a file type, their blocks random: what a random-weight `Q4_K_M`
file of the shape holds, byte for byte in size and type, so the engine loads it as it would the
real file (k-quants kept quantized) and the benchmark reads the same bytes per token.

The type of each tensor follows llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) for
`Q4_K_M` on a Llama-3-8B-like model: the output matrix Q6_K; attn_v and ffn_down Q6_K in the
layers `use_more_bits` picks (the first and last eighth and every third one between: 16 of 32),
Q4_K in the others; every other matrix, the token embedding included, Q4_K; norms F32. For
Llama-3-8B that is 4.92 GB (the published file: 4.92 GB).

Blocks hold random codes and sub-block scales, their float16 scales drawn small so that the
weights stay near ±0.02 as a random-weight model's are (the values do not change the speed, but
NaN or inf would make the run meaningless).

    python bench/gguf_shape.py llama3-8b /tmp/llama3-8b-q4_k_m.gguf
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES  # noqa: E402

# byte offsets of each block's float16 scale fields, and the size of the block and its weights
F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}
SCALE = {"Q4_K": 2e-5, "Q6_K": 2e-5}  # |d|: 6-bit sub-scales x codes up to 63 keep weights ~0.02


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers a `_M` file gives more bits (attn_v, ffn_down)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_types(layers: int) -> dict[str, str]:
    """GGUF tensor name -> type for a Llama-architecture model of ``layers`` layers."""
    types = {"token_embd.weight": "Q4_K", "output_norm.weight": "F32", "output.weight": "Q6_K"}
    for i in range(layers):
        more = "Q6_K" if use_more_bits(i, layers) else "Q4_K"
        types.update({f"blk.{i}.attn_norm.weight": "F32", f"blk.{i}.ffn_norm.weight": "F32",
                      f"blk.{i}.attn_q.weight": "Q4_K", f"blk.{i}.attn_k.weight": "Q4_K",
                      f"blk.{i}.attn_v.weight": more, f"blk.{i}.attn_output.weight": "Q4_K",
                      f"blk.{i}.ffn_gate.weight": "Q4_K", f"blk.{i}.ffn_up.weight": "Q4_K",
                      f"blk.{i}.ffn_down.weight": more})
    return types


def tensor_shapes(shape: str) -> dict[str, tuple[int, int] | tuple[int]]:
    """GGUF tensor name -> (rows, row length) as numpy holds it (GGUF's ne reversed)."""
    c = SHAPES[shape]
    assert c["model_type"] == "llama" and not c["tie_word_embeddings"], f"{shape}: a dense untied Llama shape"
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.attn_q.weight": (q, h), f"blk.{i}.attn_k.weight": (kv, h),
                       f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, q),
                       f"blk.{i}.ffn_gate.weight": (inter, h), f"blk.{i}.ffn_up.weight": (inter, h),
                       f"blk.{i}.ffn_down.weight": (h, inter)})
    return shapes


def random_blocks(qtype: str, rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8 of random blocks with small float16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = rows * row_len // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = np.full((n, 1), SCALE[qtype], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, row_len // block * size)


def write(shape: str, path: str | Path, seed: int = 0) -> Path:
    """Write the shape as a Q4_K_M-typed GGUF file at ``path``, tensor by tensor (memory stays
    near the largest tensor), with a word-level vocabulary ("w0", "w1", ...) as its tokenizer."""
    import gguf

    c = SHAPES[shape]
    types, shapes = q4_k_m_types(c["num_hidden_layers"]), tensor_shapes(shape)
    w = gguf.GGUFWriter(str(path), "llama")
    p = "llama."
    w.add_uint32(p + "block_count", c["num_hidden_layers"])
    w.add_uint32(p + "embedding_length", c["hidden_size"])
    w.add_uint32(p + "feed_forward_length", c["intermediate_size"])
    w.add_uint32(p + "attention.head_count", c["num_attention_heads"])
    w.add_uint32(p + "attention.head_count_kv", c["num_key_value_heads"])
    w.add_float32(p + "attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(p + "rope.freq_base", c["rope_theta"])
    w.add_uint32(p + "context_length", c["max_position_embeddings"])
    w.add_uint32("general.file_type", 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"w{i}" for i in range(c["vocab_size"])])
    w.add_token_types([1] * c["vocab_size"])
    w.add_token_merges([])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    for name, qtype in types.items():
        rows, *rest = shapes[name]
        if qtype == "F32":
            w.add_tensor_info(name, shapes[name], np.dtype(np.float32), 4 * rows)
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        byte_shape = (rows, rest[0] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1],
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, qtype in types.items():
        rows, *rest = shapes[name]
        if qtype == "F32":
            w.write_tensor_data(np.ones(rows, dtype=np.float32))
        else:
            w.write_tensor_data(random_blocks(qtype, rows, rest[0], rng))
    w.close()
    return Path(path)


if __name__ == "__main__":
    out = write(sys.argv[1], sys.argv[2])
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB")
