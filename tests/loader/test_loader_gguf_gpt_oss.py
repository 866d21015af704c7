"""gpt-oss GGUF files (llama.cpp's "gpt-oss" architecture): a tiny random transformers model
written as llama.cpp's converter writes it (experts stacked per part in llama.cpp's MXFP4 type,
sinks, router with its bias), served by kvship with the experts kept MXFP4, against transformers
on the experts the gguf package dequantizes from the same blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

from conftest import make_tiny_model
from kvship.kernels.gpt_oss_moe import dequantize_mxfp4
from kvship.loader.gguf_gpt_oss import mxfp4_to_openai
from test_loader_gguf_moe import dense_metadata
from test_models import assert_logits_match
from test_models_gpt_oss import SPEC, WINDOW, _liven

pytestmark = pytest.mark.timeout(300)

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _tensors(model, experts: QT) -> dict[str, tuple[np.ndarray, QT]]:
    """llama.cpp's names and types: experts [E, I, H] / [E, H, I] in ``experts`` (MXFP4: quantized by
    the gguf package), their biases and everything else F32."""
    out = {}
    i = model.config.intermediate_size
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if name in TOP:
            out[TOP[name]] = (w, QT.F32)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "self_attn.sinks":
            out[blk + "attn_sinks.weight"] = (w, QT.F32)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate and up columns interleaved
            out[blk + "ffn_gate_exps.weight"] = (np.ascontiguousarray(w[:, :, 0::2].transpose(0, 2, 1)), experts)
            out[blk + "ffn_up_exps.weight"] = (np.ascontiguousarray(w[:, :, 1::2].transpose(0, 2, 1)), experts)
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = (w[:, 0::2], QT.F32), (w[:, 1::2], QT.F32)
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            out[blk + "ffn_down_exps.weight"] = (np.ascontiguousarray(w.transpose(0, 2, 1)), experts)
        elif rest == "mlp.experts.down_proj_bias":
            out[blk + "ffn_down_exps.bias"] = (w, QT.F32)
        else:
            part, kind = rest.rsplit(".", 1)
            out[f"{blk}{_LAYER[part]}.{kind}"] = (w, QT.F32)
    assert i % 32 == 0
    return out


def write_gpt_oss_gguf(path, model, experts: QT = QT.MXFP4) -> dict[str, np.ndarray]:
    """The file, and the experts' MXFP4 blocks as written (llama.cpp's bytes) by tensor name."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    dense_metadata(w, cfg)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    blocks = {}
    for name, (arr, qtype) in _tensors(model, experts).items():
        data = quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
        if qtype == QT.MXFP4:
            blocks[name] = data
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return blocks


def test_repacked_blocks_dequantize_as_gguf_does():
    """llama.cpp's MXFP4 bytes regrouped into OpenAI's pairs give, through kvship's MXFP4
    dequantization, exactly what the gguf package's own dequantization gives."""
    x = np.random.default_rng(0).standard_normal((3, 5, 128)).astype(np.float32) * 3
    raw = quants.quantize(x, QT.MXFP4)
    want = quants.dequantize(raw, QT.MXFP4)
    codes, scales = mxfp4_to_openai(raw, x.shape)
    assert codes.shape == (3, 5, 4, 16) and scales.shape == (3, 5, 4)
    got = dequantize_mxfp4(codes.flatten(-2), scales)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("expert_type", [QT.MXFP4, QT.F32], ids=lambda t: t.name)
def test_gguf_matches_transformers_on_the_dequantized_experts(tmp_path, expert_type):
    """MXFP4 experts stay MXFP4; experts of another type load into the 16-bit layout."""
    from kvship.llm import LLM
    from kvship.loader import resolve_model
    from kvship.models.config import ModelConfig

    ref = make_tiny_model(tmp_path / "hf", "gpt_oss", spec=SPEC)
    _liven(ref)
    path = tmp_path / f"tiny-gpt-oss-{expert_type.name}.gguf"
    blocks = write_gpt_oss_gguf(path, ref, expert_type)
    mxfp4 = expert_type == QT.MXFP4
    cfg = ModelConfig.from_hf(resolve_model(str(path)).hf_config)
    assert cfg.architecture == "gpt_oss" and cfg.expert_format == ("mxfp4" if mxfp4 else None)
    assert cfg.layer_windows == (WINDOW, None) and cfg.rope_scaling["rope_type"] == "yarn"
    with torch.no_grad():  # transformers on what the gguf package reads back from the blocks
        for layer in range(ref.config.num_hidden_layers if mxfp4 else 0):
            def back(part):
                return torch.from_numpy(quants.dequantize(blocks[f"blk.{layer}.ffn_{part}_exps.weight"], QT.MXFP4))
            experts = ref.model.layers[layer].mlp.experts
            gate_up = torch.stack([back("gate"), back("up")], dim=2).flatten(1, 2)  # [E, 2I, H] interleaved
            experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
            experts.down_proj.copy_(back("down").transpose(1, 2))
    prompts = [[3, 17, 250, 9, 44], [100 + i for i in range(19)]]
    assert_logits_match(path, ref, prompts, chunks=(None, 6))
    llm = LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=32, block_size=4, max_model_len=64)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert (experts.w13.dtype == torch.uint8) == mxfp4 and (experts.w13_scale is not None) == mxfp4
