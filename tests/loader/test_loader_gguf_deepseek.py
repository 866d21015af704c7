"""DeepSeek GGUF files ("deepseek2": V2, V2-Lite, V3's architecture) in llama.cpp's layout: tiny
random transformers models written here as llama.cpp's converter writes them, then served by
kvship and compared with transformers on the same weights.

The converter's layout: one KV head of the latent row (key_length kv_lora_rank + rope,
value_length kv_lora_rank) with the heads' sizes in key_length_mla / value_length_mla, and
kv_b_proj split into attn_k_b (each head's W_UK, transposed: [heads, rank, nope]) and attn_v_b
([heads, v, rank]); files from before that split keep attn_kv_b and the heads' sizes in
key_length / value_length. The rope rows stay as HF has them (adjacent pairs: llama.cpp's "norm"
rope for this architecture), the experts are stacked, the shared experts are *_shexp, V3's router
bias is exp_probs_b.bias, YaRN's mscale is yarn_log_multiplier = 0.1 x mscale_all_dim."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT

from conftest import make_tiny_model
from kvship.loader import resolve_model
from test_loader_gguf_moe import (
    PROMPTS,
    TOP,
    _check_against,
    _encoded,
    dense_metadata,
    layer_tensors,
    routed_expert_tensor,
    routed_metadata,
    write_tensors_and_close,
)
from test_models_deepseek import DEEPSEEK

pytestmark = pytest.mark.timeout(300)

# llama.cpp keeps one YaRN mscale: the tiny models set mscale equal to mscale_all_dim, as
# DeepSeek's checkpoints do
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8, "mscale_all_dim": 0.8,
         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
# name -> (tiny model, kv_b_proj as the newer converter splits it, a Q8_0 attention and experts)
CASES = {
    "v2-lite": ("v2-lite", True, False),
    "v2-old-kv-b": ("v2", False, False),  # the low-rank query, group-limited routing
    "v3-q8": ("v3", True, True),  # sigmoid routing with its bias
}

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
          "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
def _gguf_tensors(model, split_kv_b: bool) -> dict[str, np.ndarray]:
    cfg = model.config
    out = {}
    for blk, rest, w in layer_tensors(model, out):
        if routed_expert_tensor(out, blk, rest, w):
            continue
        if rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = w.reshape(cfg.num_attention_heads, nope + v, w.shape[-1])
            out[blk + "attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            out[blk + "attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        elif rest == "self_attn.kv_b_proj.weight":
            out[blk + "attn_kv_b.weight"] = w
        else:
            part, kind = rest.rsplit(".", 1)
            out[f"{blk}{_LAYER[part]}.{kind}"] = w
    return out


def _metadata(w, cfg, split_kv_b: bool) -> None:
    """What llama.cpp's converter writes for DeepSeek (the newer layout: one KV head of the latent
    row; the older: the heads' own sizes)."""
    rope, nope, rank = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    dense_metadata(w, SimpleNamespace(**{**vars(cfg), "num_key_value_heads": 1 if split_kv_b else cfg.num_attention_heads,
                                         "head_dim": rank + rope if split_kv_b else nope + rope}))
    if split_kv_b:
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_value_length(cfg.v_head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(rope)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope_parameters["mscale_all_dim"])
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    routed_metadata(w, cfg)
    sigmoid = getattr(cfg, "scoring_func", "softmax") == "sigmoid" or cfg.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if (cfg.n_group or 1) > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)


# in Q8_0 (blocks of 32 inputs: the tiny matrices of 64): the low-rank query's and the latent's
# projections (their rope rows reordered in their blocks), the experts' gate/up, the shared ones'
_Q8 = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "attn_q_a.weight", "attn_kv_a_mqa.weight",
       "ffn_gate_shexp.weight", "ffn_up_shexp.weight")


def write_deepseek_gguf(path, model, split_kv_b: bool, q8: bool, drop: str | None = None) -> None:
    """``drop``: a tensor left out of the file."""
    w = gguf.GGUFWriter(str(path), "deepseek2")
    _metadata(w, model.config, split_kv_b)
    rng = np.random.default_rng(0)
    tensors = {name: arr for name, arr in _gguf_tensors(model, split_kv_b).items() if name != drop}
    write_tensors_and_close(w, tensors, lambda name, arr: QT.Q8_0 if q8 and name.endswith(_Q8) else QT.F32,
                            lambda arr, qtype: _encoded(arr, qtype, rng))


def _reference_from(model, tensors: dict[str, np.ndarray], split_kv_b: bool):
    """transformers' model holding the values the file holds (Q8_0 blocks dequantized)."""
    sd = model.state_dict()
    back = {v: k for k, v in _LAYER.items()}
    with torch.no_grad():
        for gname, arr in tensors.items():
            if gname in TOP.values():
                sd[{v: k for k, v in TOP.items()}[gname]].copy_(torch.tensor(arr))
                continue
            _, layer, part, kind = gname.split(".")
            pre = f"model.layers.{layer}."
            if part in ("ffn_gate_exps", "ffn_up_exps"):
                half = sd[pre + "mlp.experts.gate_up_proj"].shape[1] // 2
                rows = slice(0, half) if part == "ffn_gate_exps" else slice(half, None)
                sd[pre + "mlp.experts.gate_up_proj"][:, rows].copy_(torch.tensor(arr))
            elif part == "ffn_down_exps":
                sd[pre + "mlp.experts.down_proj"].copy_(torch.tensor(arr))
            elif part == "attn_k_b":
                kv_b = sd[pre + "self_attn.kv_b_proj.weight"]
                heads, rank, nope = arr.shape
                kv_b.view(heads, -1, rank)[:, :nope].copy_(torch.tensor(arr).transpose(1, 2))
            elif part in ("attn_v_b", "attn_kv_b", "exp_probs_b"):
                continue  # stored as written (F32)
            else:
                sd[pre + back[part] + "." + kind].copy_(torch.tensor(arr))
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (GGUF path, transformers model with the file's values)."""
    root = tmp_path_factory.mktemp("deepseek-gguf")
    out = {}
    for case, (arch, split_kv_b, q8) in CASES.items():
        cls, spec = DEEPSEEK[arch]
        model = make_tiny_model(root / case, arch, seed=5, spec=(cls, spec | {"rope_parameters": _YARN}))
        with torch.no_grad():  # attention weights scaled up, as test_models_deepseek's, so that it moves the logits
            for pname, p in model.named_parameters():
                if ".self_attn." in pname and "norm" not in pname:
                    p.mul_(8.0)
            for pname, b in model.named_buffers():
                if pname.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(pname)))
        path = root / f"tiny-{case}.gguf"
        tensors = _gguf_tensors(model, split_kv_b)
        write_deepseek_gguf(path, model, split_kv_b, q8)
        if q8:  # the values the Q8_0 blocks hold, into the reference
            for name in tensors:
                tensors[name] = _gguf_values(path, name)
        out[case] = path, _reference_from(model, tensors, split_kv_b)
    return out


def _gguf_values(path, name: str) -> np.ndarray:
    """A tensor's values as the gguf package reads them (Q8_0 blocks dequantized)."""
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_gguf_matches_transformers(files, case):
    path, ref = files[case]
    arch, split_kv_b, q8 = CASES[case]
    c = resolve_model(str(path)).hf_config
    assert c["model_type"] == ("deepseek_v3" if arch == "v3" else "deepseek_v2")
    assert c["kv_lora_rank"] == ref.config.kv_lora_rank and c["qk_nope_head_dim"] == ref.config.qk_nope_head_dim
    assert ("quantization_config" in c) == q8
    _check_against(ref, path, PROMPTS)


def test_half_of_a_split_kv_b_missing_is_named(files, tmp_path):
    from kvship.llm import LLM
    from kvship.loader import ModelSourceError

    path = tmp_path / "no-v-b.gguf"
    write_deepseek_gguf(path, files["v2-lite"][1], True, False, drop="blk.0.attn_v_b.weight")
    with pytest.raises(ModelSourceError, match="holds blk.0.attn_k_b.weight without its attn_v_b half"):
        LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=16, max_model_len=64)
