"""Mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, Mixtral) in llama.cpp's layout: tiny
random transformers models are written here as llama.cpp's converter writes them (stacked
experts, the router as ffn_gate_inp, the shared expert as *_shexp, Mixtral as a "llama" file with
rope-permuted q/k), then served by kvship and compared with transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

from conftest import make_tiny_model
from kvship.loader import resolve_model
from test_models import our_logits

# fp32 on both sides, as in test_models: only the summation order differs.
ATOL = 2e-4

# llama.cpp architecture: (transformers config class, extra config). Every layer routed, top 2 of
# 8 experts; Qwen3-MoE renormalizes the top-k weights and Qwen2-MoE does not, as llama.cpp runs them.
SPECS = {
    "qwen3moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                        norm_topk_prob=False)),
    "llama": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
}

# HF name below model.layers.N -> llama.cpp's
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for "llama" files: per head, interleaved halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _experts(out: dict, blk: str, part: str, w: np.ndarray, split: bool) -> None:
    """[E, rows, cols] as llama.cpp stacks it ("ffn_up_exps"), or as files from before that held
    one matrix per expert ("ffn_up.E")."""
    if split:
        out.update({f"{blk}ffn_{part}.{e}.weight": w[e] for e in range(w.shape[0])})
    else:
        out[f"{blk}ffn_{part}_exps.weight"] = w


def _gguf_tensors(model, arch: str, split_experts: bool = False) -> dict[str, np.ndarray]:
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(w, 2, axis=1)
            _experts(out, blk, "gate", gate, split_experts)
            _experts(out, blk, "up", up, split_experts)
            continue
        if rest == "mlp.experts.down_proj":
            _experts(out, blk, "down", w, split_experts)
            continue
        part, kind = rest.rsplit(".", 1)
        if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _rope_permute(w, cfg.num_attention_heads if part.endswith("q_proj") else cfg.num_key_value_heads)
        out[f"{blk}{_LAYER[part]}.{kind}"] = w.squeeze()  # the converter squeezes: the shexp gate is [H]
    return out


def _metadata(w, model, arch: str) -> None:
    cfg = model.config
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size - 1)] + ["</s>"])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


def write_gguf(path, model, arch: str, expert_type=QT.F32, split_experts: bool = False) -> None:
    """``model`` as a GGUF file of ``arch``; the stacked experts in ``expert_type``, a 2-D matrix of
    the attention in it too (so that a quantized dense matrix sits beside them), the rest F32."""
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, model, arch)
    for name, arr in _gguf_tensors(model, arch, split_experts).items():
        qtype = expert_type if name.endswith(("_exps.weight", "attn_output.weight")) else QT.F32
        data = quants.quantize(np.ascontiguousarray(arr), qtype)  # F32: the array itself
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (GGUF path, transformers model)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch, spec in SPECS.items():
        model = make_tiny_model(root / arch, arch, seed=3, spec=spec)
        path = root / f"tiny-{arch}-F32.gguf"
        write_gguf(path, model, arch)
        out[arch] = path, model
    return out


def _greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    from kvship.llm import LLM
    from kvship.sampling_params import SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _check_against(ref, path, prompts: list[list[int]], atol: float = ATOL) -> None:
    for p, got in zip(prompts, our_logits(path, prompts)):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    for p, got in zip(prompts, _greedy(path, prompts)):
        assert got == _reference_greedy(ref, p), p


def _reference_greedy(ref, prompt: list[int], n: int = 8) -> list[int]:
    """transformers' argmax tokens, the end-of-sequence token allowed like any other (its generate
    would hold that one back until min_new_tokens, where the engine ignores the end)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


PROMPTS = [[3, 17, 250, 9, 44], [100 + i for i in range(19)]]


@pytest.mark.parametrize("arch", list(SPECS))
def test_moe_gguf_matches_transformers(models, arch):
    path, ref = models[arch]
    c = resolve_model(str(path)).hf_config
    family = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}[arch]
    assert c["model_type"] == family and c["num_experts_per_tok"] == 2 and "quantization_config" not in c
    _check_against(ref, path, PROMPTS)


def _transformers_reading(path, like):
    """transformers' own GGUF reader on ``path`` (its gguf package dequantizes), in the model
    ``like``'s config: its GGUF config mapping knows no expert widths, the tensors are what counts."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=like.config, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])  # transformers reads no Mixtral GGUF
def test_transformers_reads_our_files_as_the_original(models, arch):
    """An independent check of the layout written above (names, stacking, gate before up)."""
    path, ref = models[arch]
    want, got = ref.state_dict(), _transformers_reading(path, ref).state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def q8_0(models, tmp_path_factory):
    """The Qwen3-MoE model with Q8_0 experts and attn_output: (path, transformers on its dequantized weights)."""
    _, model = models["qwen3moe"]
    path = tmp_path_factory.mktemp("q8") / "tiny-qwen3moe-Q8_0.gguf"
    write_gguf(path, model, "qwen3moe", QT.Q8_0)
    return path, _transformers_reading(path, model)


def test_quantized_experts_are_expanded_at_load(q8_0, caplog):
    """Experts are not served in GGUF blocks: every quantized tensor of the file, a dense matrix
    too, is expanded at load (and named in the log), and the model is served."""
    path, ref = q8_0
    with caplog.at_level("INFO", logger="kvship.loader.gguf"):
        src = resolve_model(str(path))
    assert "quantization_config" not in src.hf_config
    assert ("dequantized at load (a mixture-of-experts GGUF is expanded whole): blk.*.attn_output.weight "
            "Q8_0 (2 layers), blk.*.ffn_down_exps.weight Q8_0 (2 layers), blk.*.ffn_gate_exps.weight Q8_0 (2 layers), "
            "blk.*.ffn_up_exps.weight Q8_0 (2 layers)") in caplog.text
    # transformers holds the same dequantized values: only the summation order differs
    _check_against(ref, path, PROMPTS)


def test_experts_shard_over_two_ranks(q8_0):
    """Each expert goes through MoEExperts.weight_loader: a rank holds its half of every expert's
    intermediate dimension (rows of gate and up read from their Q8_0 blocks alone, columns of down)."""
    from kvship.layers.moe import MoEExperts
    from kvship.models.llama import _expert_name
    from kvship.parallel import TPContext

    path, ref = q8_0
    sd = ref.state_dict()
    gate_up, down = sd["model.layers.1.mlp.experts.gate_up_proj"], sd["model.layers.1.mlp.experts.down_proj"]
    inter = down.shape[2]
    refs = [(_expert_name(n), r) for n, r in resolve_model(str(path)).weights() if ".layers.1.mlp.experts." in n]
    for rank in range(2):
        experts = MoEExperts(8, 64, inter, TPContext(rank=rank, size=2))
        for (name, shard), r in refs:
            param = getattr(experts, name.rsplit(".", 1)[1])
            param.weight_loader(param, r, shard)
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        want = torch.cat([gate_up[:, :inter][:, half], gate_up[:, inter:][:, half]], dim=1)
        torch.testing.assert_close(experts.w13.data, want, rtol=0, atol=0)
        torch.testing.assert_close(experts.w2.data, down[:, :, half], rtol=0, atol=0)


def test_mixtral_with_one_matrix_per_expert(models, tmp_path):
    """Mixtral files from before llama.cpp stacked the experts: the same tensors as a stacked file."""
    path, model = models["llama"]
    old = tmp_path / "tiny-mixtral-split.gguf"
    write_gguf(old, model, "llama", split_experts=True)
    want = {n: r.load() for n, r in resolve_model(str(path)).weights()}
    got = {n: r.load() for n, r in resolve_model(str(old)).weights()}
    assert got.keys() == want.keys() and "model.layers.1.mlp.experts.7.down_proj.weight" in got
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
