"""Gemma 2, Gemma 3 and Phi-3 GGUF files in llama.cpp's layout: tiny random transformers models
written here as llama.cpp's converter writes them (Gemma's norm weights stored as 1 + w and its
four norms a layer under their own names; Phi-3's fused attn_qkv and gate/up in ffn_up, its
longrope factors as tensors), each layout first read back by transformers' own GGUF reader
(it must give the model's logits), then served by kvship against the model, one file with its
linear matrices in Q8_0 blocks (kept quantized)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

from conftest import write_word_tokenizer
from kvship.loader import resolve_model
from test_loader_gguf_moe import TOP, dense_metadata, write_tensors_and_close
from test_models import our_logits

pytestmark = pytest.mark.timeout(300)
ATOL = 2e-4  # fp32 on both sides
WINDOW = 8
# llama.cpp architecture -> (transformers config class, config); query_pre_attn_scalar is
# head_dim, as llama.cpp assumes below the 27B models, and Gemma 3 has six layers (its one
# global layer in six) with llama.cpp's local rope base
SPECS = {
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                    sliding_window=WINDOW, attn_logit_softcapping=0.3, final_logit_softcapping=1.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=6, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
                                original_max_position_embeddings=64,
                                rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                              "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down",
          # Gemma's (Phi-3's post-attention norm is the Llama block's ffn_norm)
          "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm",
          # Phi-3's
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def _model(arch: str):
    import transformers

    cls, extra = SPECS[arch]
    cfg = getattr(transformers, cls)(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     max_position_embeddings=256, eos_token_id=319, bos_token_id=0, **extra)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if arch != "phi3" else 1.0, 0.1)  # Gemma's norms multiply by 1 + w
    if arch != "phi3":
        model.set_attn_implementation("eager")  # transformers' SDPA path drops Gemma 2's score cap
    return model


def _tensors(model, arch: str) -> dict[str, np.ndarray]:
    out = {}
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0
        if name in TOP:
            if not (arch.startswith("gemma") and name == "lm_head.weight"):  # tied: no output.weight
                out[TOP[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        part, kind = rest.rsplit(".", 1)
        gname = "ffn_norm" if arch == "phi3" and part == "post_attention_layernorm" else _LAYER[part]
        out[f"blk.{layer}.{gname}.{kind}"] = w
    if arch == "phi3":
        scaling = model.config.rope_parameters
        out["rope_factors_long.weight"] = np.array(scaling["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(scaling["short_factor"], dtype=np.float32)
    return out


def _write(path, model, arch: str, linear_type=QT.F32) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    dense_metadata(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    if arch == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
        w.add_rope_freq_base(float(rope["rope_theta"]))
    elif arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        w.add_rope_freq_base(float(rope["rope_theta"]))
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    write_tensors_and_close(w, _tensors(model, arch),
                            lambda name, arr: linear_type if arr.ndim == 2 and name.startswith("blk.") else QT.F32)


PROMPTS = [[3, 17, 250, 9, 44], [100 + i for i in range(21)]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (GGUF path, transformers model)."""
    root = tmp_path_factory.mktemp("gguf-families")
    out = {}
    for arch in SPECS:
        model = _model(arch)
        path = root / f"tiny-{arch}-F32.gguf"
        _write(path, model, arch)
        out[arch] = path, model
    return out


def _logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("arch", list(SPECS))
def test_writer_layout_reads_back_in_transformers(files, arch, tmp_path):
    """transformers' GGUF reader (its own name map, Gemma's norm shift, Phi-3's fused split) gives
    the model's logits from the file: the layout written here is llama.cpp's as that library reads it."""
    import transformers

    path, ref = files[arch]
    write_word_tokenizer(tmp_path, ref.config.vocab_size)
    read = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=ref.config,
                                                             dtype=torch.float32).eval()
    if arch != "phi3":
        read.set_attn_implementation("eager")
    for p in PROMPTS:
        torch.testing.assert_close(_logits(read, p), _logits(ref, p), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", list(SPECS))
def test_family_gguf_matches_transformers(files, arch):
    path, ref = files[arch]
    c = resolve_model(str(path)).hf_config
    assert c["model_type"] == {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}[arch]
    for p, got in zip(PROMPTS, our_logits(path, PROMPTS)):
        torch.testing.assert_close(got, _logits(ref, p), atol=ATOL, rtol=0)
    for p, got in zip(PROMPTS, our_logits(path, PROMPTS, chunk=7)):  # over the cached prefix, windows sliding
        torch.testing.assert_close(got, _logits(ref, p), atol=ATOL, rtol=0)


def test_gemma3_layer_pattern_as_flags(files, tmp_path):
    """Files that give Gemma 3's pattern as a flag per layer (true: sliding) serve the same layers."""
    path, ref = files["gemma3"]
    cfg = resolve_model(str(path)).hf_config
    flagged = tmp_path / "flags.gguf"
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(flagged), "gemma3")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, field.contents())
        else:
            w.add_key_value(field.name, field.contents(), kind)
    w.add_array("gemma3.attention.sliding_window_pattern", [(i + 1) % 6 != 0 for i in range(6)])
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    flags = resolve_model(str(flagged)).hf_config
    assert flags["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] and cfg["sliding_window_pattern"] == 6
    for p, got in zip(PROMPTS, our_logits(flagged, PROMPTS)):
        torch.testing.assert_close(got, _logits(ref, p), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_quantized_linears_stay_quantized(files, arch, tmp_path):
    """Q8_0 linear matrices (Phi-3's fused ones split by rows in their blocks): kept quantized, and
    the logits those blocks define, against transformers on the same blocks dequantized."""
    _, ref = files[arch]
    path = tmp_path / f"tiny-{arch}-Q8_0.gguf"
    _write(path, ref, arch, QT.Q8_0)
    assert resolve_model(str(path)).hf_config["quantization_config"] == {"quant_method": "gguf"}
    deq = _model(arch)
    with torch.no_grad():
        for name, p in deq.named_parameters():
            if p.dim() == 2 and ".layers." in name:
                q = quants.quantize(np.ascontiguousarray(p.numpy()), QT.Q8_0)
                p.copy_(torch.from_numpy(quants.dequantize(q, QT.Q8_0)).view_as(p))
    moved = 0.0
    for p, got in zip(PROMPTS, our_logits(path, PROMPTS)):
        want = _logits(deq, p)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        moved = max(moved, (want - _logits(ref, p)).abs().max().item())
    assert moved > 10 * ATOL  # the blocks' rounding shows: the comparison would catch a 16-bit load


def _meta(arch: str, **keys) -> dict:
    base = {"general.architecture": arch, f"{arch}.embedding_length": 512, f"{arch}.attention.head_count": 4,
            f"{arch}.feed_forward_length": 1024, f"{arch}.block_count": 4, "tokenizer.ggml.tokens": ["a"] * 10}
    return base | {f"{arch}.{k}": v for k, v in keys.items()}


def test_partial_rotary_phi_is_refused_by_name():
    """Phi-4-mini rotates 3/4 of each head (rope.dimension_count 96 of 128): refused as the HF
    config is, not built with the wrong rotation (or a longrope table of the wrong width)."""
    from kvship.loader.gguf import gguf_hf_config
    from kvship.models.config import ModelConfig, UnsupportedModelError

    cfg = gguf_hf_config(_meta("phi3", **{"rope.dimension_count": 96}), set(), [])
    assert cfg["partial_rotary_factor"] == 0.75
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        ModelConfig.from_hf(cfg)
    assert "partial_rotary_factor" not in gguf_hf_config(_meta("phi3", **{"rope.dimension_count": 128}), set(), [])


def test_gemma3_without_a_window_is_global():
    from kvship.loader.gguf import gguf_hf_config
    from kvship.models.config import ModelConfig

    cfg = ModelConfig.from_hf(gguf_hf_config(_meta("gemma3", **{"attention.key_length": 128}), set(), []))
    assert cfg.kv_window is None and all(cfg.window(i) is None for i in range(4))
