"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE GGUF files ("qwen3next", "qwen35", "qwen35moe") in
llama.cpp's layout: tiny random transformers models written here as llama.cpp's converter
writes them (names from the gguf package's own map; A_log stored as -exp(A_log), norm weights
as 1 + w but the DeltaNet's gated norm, the conv1d squeezed, Qwen3-Next's in_proj_qkvz split
into attn_qkv and attn_gate, and Qwen3.5's value heads reordered from grouped to tiled), then
served by kvship: the logits equal the safetensors path's and transformers', and one file with
its linear matrices in Q8_0 blocks (value heads reordered in their blocks) matches transformers
on the same blocks dequantized."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

from kvship.loader import resolve_model
from kvship.sampling_params import SamplingParams
from test_loader_gguf_moe import dense_metadata, write_tensors_and_close
from test_models_qwen3_next import COMMON, SPECS, greedy_reference, our_logits

pytestmark = pytest.mark.timeout(300)
ATOL = 2e-4  # fp32 on both sides
# every second layer full attention: llama.cpp's files give the pattern as an interval
LAYERS = ["linear_attention", "full_attention"] * 2
GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
MODEL_ARCH = {"qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35": gguf.MODEL_ARCH.QWEN35,
              "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}
# matrices of the layers the Q8_0 file keeps in blocks (the routers, conv and norms stay F32)
QUANTIZED = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "attn_qkv.", "attn_gate.", "ssm_out.", "ssm_alpha.",
             "ssm_beta.", "ssm_ba.", "ffn_gate.", "ffn_up.", "ffn_down.", "_shexp.")


def interval_hybrid(arch: str, folder, **overrides):
    """The tiny transformers model of tests/models/test_models_qwen3_next.py with llama.cpp's
    layer pattern (Qwen3-Next: every layer routed, as llama.cpp builds it), saved to ``folder``."""
    import transformers

    from conftest import write_word_tokenizer

    cls_name, extra = SPECS[arch]
    kw = dict(COMMON, **extra, layer_types=LAYERS, full_attention_interval=2, **overrides)
    kw.pop("mlp_only_layers", None)
    if arch == "qwen3_5_moe":
        del kw["intermediate_size"]
    cfg = getattr(transformers, cls_name)(**kw)
    cfg.rope_parameters["partial_rotary_factor"] = 0.5
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, cfg.vocab_size)
    return model


def _tile(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """The converter's value-head order: grouped by key head -> tiled."""
    t = t.movedim(dim, 0)
    rest = t.shape[1:]
    return t.reshape(hk, r, d, *rest).transpose(0, 1).reshape(-1, *rest).movedim(0, dim).contiguous()


def _converted(model, gguf_arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's tensors for the model's state dict, each transform as its converter applies it."""
    c = model.config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r, key_dim = hv // hk, hk * dk
    names = gguf.TensorNameMap(MODEL_ARCH[gguf_arch], c.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if gguf_arch != "qwen3next" and r > 1 and ".linear_attn." in name:
            if "in_proj_qkv" in name or "conv1d" in name:
                t = t.squeeze(1) if "conv1d" in name else t
                t = torch.cat([t[:2 * key_dim], _tile(t[2 * key_dim:], 0, hk, r, dv)])
            elif "in_proj_z" in name:
                t = _tile(t, 0, hk, r, dv)
            elif "in_proj_b" in name or "in_proj_a" in name or name.endswith(("A_log", "dt_bias")):
                t = _tile(t, 0, hk, r, 1)
            elif "out_proj" in name:
                t = _tile(t, 1, hk, r, dv)
        if name.endswith("A_log"):
            t = -torch.exp(t)
        elif name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith("in_proj_qkvz.weight"):  # [q, k, v, z] per key head -> q|k|v rows, and z
            blk = name.split(".")[2]
            q, k, v, z = t.view(hk, -1, t.shape[1]).split([dk, dk, r * dv, r * dv], dim=1)
            out[f"blk.{blk}.attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
            out[f"blk.{blk}.attn_gate.weight"] = z.reshape(-1, t.shape[1])
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            parts = {"gate_proj.weight": gate, "up_proj.weight": up}
        elif name.endswith("mlp.experts.down_proj"):
            parts = {"down_proj.weight": t}
        else:
            parts = {None: t}
        for suffix, x in parts.items():
            full = name if suffix is None else f"{name.rsplit('.', 1)[0]}.{suffix}"
            gname = names.get_name(full, try_suffixes=(".weight", ".bias"))
            assert gname is not None, full
            out[gname] = x
    if c.tie_word_embeddings:
        out.pop("output.weight", None)
    return {k: v.numpy() for k, v in out.items()}


def write_gguf(path, model, gguf_arch: str, linear_type=QT.F32) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), gguf_arch)
    # Qwen3.5-MoE has no dense feed-forward: its files state a size of 0 (or none)
    dense_metadata(w, SimpleNamespace(**{**c.to_dict(), "intermediate_size": getattr(c, "intermediate_size", 0)}))
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(c.full_attention_interval)
    if getattr(c, "num_experts", 0):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    write_tensors_and_close(w, _converted(model, gguf_arch), lambda name, arr: linear_type if (
        arr.ndim == 2 and name.startswith("blk.") and any(p in name for p in QUANTIZED)) else QT.F32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (GGUF path, safetensors folder, transformers model)."""
    root = tmp_path_factory.mktemp("gguf-hybrid")
    out = {}
    for arch, g in GGUF_ARCH.items():
        model = interval_hybrid(arch, root / arch)
        path = root / f"tiny-{g}-F32.gguf"
        write_gguf(path, model, g)
        out[arch] = path, root / arch, model
    return out


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_hybrid_gguf_equals_safetensors_and_transformers(files, arch):
    path, folder, ref = files[arch]
    cfg = resolve_model(str(path)).hf_config
    assert cfg["model_type"] == {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text",
                                 "qwen3_5_moe": "qwen3_5_moe_text"}[arch]
    assert cfg["layer_types"] == LAYERS and cfg["partial_rotary_factor"] == 0.5
    prompts = _prompts(4, (70, 5, 33))
    with torch.no_grad():
        want = [ref(torch.tensor([p])).logits[0] for p in prompts]
    for chunk in (None, 24):
        from_file, from_folder = our_logits(path, prompts, chunk), our_logits(folder, prompts, chunk)
        for got, same, w in zip(from_file, from_folder, want):
            torch.testing.assert_close(got, same, atol=1e-5, rtol=0)
            torch.testing.assert_close(got, w, atol=ATOL, rtol=0)


def test_hybrid_gguf_greedy_matches_transformers(files):
    from kvship.llm import LLM

    path, _, ref = files["qwen3_5_moe"]
    prompts = _prompts(5, (3, 40, 21))
    llm = LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=16,
              max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == greedy_reference(ref, prompts, 8)


@pytest.mark.parametrize("dv", [32, 8])
def test_quantized_hybrid_keeps_blocks_through_value_reorder(tmp_path, dv):
    """Q8_0 projections of a Qwen3.5 file whose value heads llama.cpp tiled: the DeltaNet's rows
    put back in their blocks, and out_proj's columns too where a value head holds whole blocks
    (32 channels), else dequantized (8); the logits those blocks define against transformers on
    the same blocks dequantized."""
    ref = interval_hybrid("qwen3_5", tmp_path / "st", linear_value_head_dim=dv)
    path = tmp_path / "tiny-qwen35-Q8_0.gguf"
    write_gguf(path, ref, "qwen35", QT.Q8_0)
    assert resolve_model(str(path)).hf_config["quantization_config"] == {"quant_method": "gguf"}
    deq = interval_hybrid("qwen3_5", tmp_path / "deq", linear_value_head_dim=dv)
    with torch.no_grad():
        for name, p in deq.named_parameters():
            if p.dim() == 2 and ".layers." in name and "norm" not in name:
                q = quants.quantize(np.ascontiguousarray(p.numpy()), QT.Q8_0)
                p.copy_(torch.from_numpy(quants.dequantize(q, QT.Q8_0)).view_as(p))
    prompts = _prompts(6, (40, 9))
    moved = 0.0
    for p, got in zip(prompts, our_logits(path, prompts)):
        with torch.no_grad():
            want, exact = deq(torch.tensor([p])).logits[0], ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        moved = max(moved, (want - exact).abs().max().item())
    assert moved > 10 * ATOL  # the blocks' rounding shows: a 16-bit load would fail the comparison
