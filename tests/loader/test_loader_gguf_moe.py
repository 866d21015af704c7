"""Mixture-of-experts GGUF files (Qwen3-MoE, Qwen2-MoE, Mixtral) in llama.cpp's layout: tiny
random transformers models are written here as llama.cpp's converter writes them (stacked
experts, the router as ffn_gate_inp, the shared expert as *_shexp, Mixtral as a "llama" file with
rope-permuted q/k), then served by kvship and compared with transformers."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

from conftest import make_tiny_model
from kvship.layers.moe import MoEExperts
from kvship.loader import resolve_model
from kvship.parallel import TPContext
from kvship.quant import QuantScheme
from test_loader_gguf import F16_FIELDS
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
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # (dense layers)
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
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


def layer_tensors(model, out: dict[str, np.ndarray]) -> Iterator[tuple[str, str, np.ndarray]]:
    """(llama.cpp's "blk.N." prefix, the HF name below model.layers.N, the fp32 values) of each
    layer tensor of ``model``; its top-level tensors go into ``out`` under llama.cpp's names."""
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if name in TOP:
            out[TOP[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        yield f"blk.{layer}.", rest, w


def routed_expert_tensor(out: dict[str, np.ndarray], blk: str, rest: str, w: np.ndarray) -> bool:
    """A DeepSeek-style routed layer's stacked experts and router bias under llama.cpp's names
    (into ``out``); False for any other tensor."""
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
        out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = np.split(w, 2, axis=1)
    elif rest == "mlp.experts.down_proj":
        out[blk + "ffn_down_exps.weight"] = w
    elif rest == "mlp.gate.e_score_correction_bias":
        out[blk + "exp_probs_b.bias"] = w
    else:
        return False
    return True


def routed_metadata(w, cfg) -> None:
    """The expert keys llama.cpp writes for DeepSeek-style routing (leading dense layers, routed
    and shared experts, the weights' scale and renormalization)."""
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob))


def write_tensors_and_close(w, tensors: dict[str, np.ndarray], qtype_of=None, encode=None) -> None:
    """Add ``tensors`` to the GGUFWriter, each in ``qtype_of(name, array)`` (default F32) encoded by
    ``encode(array, qtype)`` (default the gguf package's quantization), and write the file."""
    for name, arr in tensors.items():
        qtype = qtype_of(name, arr) if qtype_of is not None else QT.F32
        data = encode(arr, qtype) if encode is not None else quants.quantize(np.ascontiguousarray(arr), qtype)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_tensors(model, arch: str, split_experts: bool = False) -> dict[str, np.ndarray]:
    cfg = model.config
    out = {}
    for blk, rest, w in layer_tensors(model, out):
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


def dense_metadata(w, cfg) -> None:
    """The keys every llama.cpp architecture writes (shapes, norm epsilon) and a word-level
    "gpt2" vocabulary of the config's size."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size - 1)] + ["</s>"])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


def _metadata(w, model, arch: str) -> None:
    cfg = model.config
    dense_metadata(w, cfg)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if not (getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)):
        return  # a dense model
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _encoded(arr: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """``arr`` in ``qtype``'s blocks: the gguf package's quantization, or for the k-quants it cannot
    write (Q3_K to Q6_K) random blocks of the same shape, valid once their fp16 scales are finite
    and small (weights of a few hundredths)."""
    try:
        return quants.quantize(np.ascontiguousarray(arr), qtype)  # F32: the array itself
    except NotImplementedError:
        per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (arr.size // per_block, nbytes), dtype=np.uint8)
        for off in F16_FIELDS[qtype]:
            raw[:, off:off + 2] = rng.uniform(2e-5, 1e-4, raw.shape[0]).astype("<f2").view(np.uint8).reshape(-1, 2)
        return raw.reshape(*arr.shape[:-1], arr.shape[-1] // per_block * nbytes)


def write_gguf(path, model, arch: str, expert_type=QT.F32, split_experts: bool = False,
               types: dict[str, QT] | None = None) -> None:
    """``model`` as a GGUF file of ``arch``; the stacked experts in ``expert_type``, a 2-D matrix of
    the attention in it too (so that a quantized dense matrix sits beside them), ``types``
    naming other types for tensors by name, the rest F32."""
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, model, arch)
    rng = np.random.default_rng(0)
    write_tensors_and_close(
        w, _gguf_tensors(model, arch, split_experts),
        lambda name, arr: (types or {}).get(name, expert_type if name.endswith(("_exps.weight", "attn_output.weight"))
                                             else QT.F32),
        lambda arr, qtype: _encoded(arr, qtype, rng))


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

    llm = LLM(str(path), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=64, block_size=4, max_model_len=128)
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


def _loaded_experts(path, layer: int, tp: TPContext = TPContext()) -> MoEExperts:
    """Layer ``layer``'s experts of the GGUF file, loaded as the model loads them (rank ``tp``)."""
    from kvship.models.llama import _expert_name

    src = resolve_model(str(path))
    c = src.hf_config
    experts = MoEExperts(c["num_experts"], c["hidden_size"], c["moe_intermediate_size"], tp,
                         quant=QuantScheme(checkpoint="gguf"))
    for n, r in src.weights():
        if f".layers.{layer}.mlp.experts." in n:
            name, shard = _expert_name(n)
            param = getattr(experts, name.rsplit(".", 1)[1])
            param.weight_loader(param, r, shard)
    return experts


def test_quantized_experts_stay_quantized(q8_0, caplog):
    """Q8_0 experts and attention output are served in their blocks (the experts as stacked
    codes, a byte a weight, with a float16 scale per 32), and the logits and greedy tokens
    equal transformers' on the dequantized weights."""
    path, ref = q8_0
    with caplog.at_level("INFO", logger="kvship.loader.gguf"):
        src = resolve_model(str(path))
    assert src.hf_config["quantization_config"] == {"quant_method": "gguf"}
    assert "GGUF: 8 linear matrices stay quantized (Q8_0); dequantized at load: none" in caplog.text
    experts = _loaded_experts(path, 1)
    assert experts.w13.dtype == torch.uint8 and experts.w13.shape == (8, 64, 64) and experts.w2.shape == (8, 64, 32)
    assert experts.w13_scale.dtype == torch.float16 and experts.w13_scale.shape == (8, 64, 2)
    assert experts.w13_bias is None and experts.groups == {"w13": 32, "w2": 0}  # down: 32 inputs, one group
    # Q8_0's scales are float16 in the file: the kept experts hold transformers' values exactly
    sd = ref.state_dict()
    torch.testing.assert_close(_dequantized(experts)[1], sd["model.layers.1.mlp.experts.down_proj"], rtol=0, atol=0)
    _check_against(ref, path, PROMPTS)


def _dequantized(experts: MoEExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacks' weights ([E, 2I, H], [E, H, I]) in fp32, by the reference's dequantization."""
    from kvship.kernels.fused_moe import expert_weight

    scales, e_range = experts.scales(), range(experts.num_experts)
    return (torch.stack([expert_weight(experts.w13.data, scales, "w13", e, experts.hidden, torch.float32)
                         for e in e_range]),
            torch.stack([expert_weight(experts.w2.data, scales, "w2", e, experts.intermediate, torch.float32)
                         for e in e_range]))


def test_experts_shard_over_two_ranks(q8_0):
    """Each expert goes through MoEExperts.weight_loader: a rank holds its half of every expert's
    intermediate dimension (rows of gate and up with their scales, columns of down with the
    scales of its groups), read from the Q8_0 blocks."""
    path, ref = q8_0
    sd = ref.state_dict()
    gate_up, down = sd["model.layers.1.mlp.experts.gate_up_proj"], sd["model.layers.1.mlp.experts.down_proj"]
    inter = down.shape[2]
    for rank in range(2):
        w13, w2 = _dequantized(_loaded_experts(path, 1, TPContext(rank=rank, size=2)))
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        want = torch.cat([gate_up[:, :inter][:, half], gate_up[:, inter:][:, half]], dim=1)
        torch.testing.assert_close(w13, want, rtol=0, atol=0)
        torch.testing.assert_close(w2, down[:, :, half], rtol=0, atol=0)


# Rows of k-quant blocks hold 256 values: hidden and expert intermediate sizes of 256
WIDE = dict(vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
            norm_topk_prob=True, max_position_embeddings=256, eos_token_id=319, bos_token_id=0)
# A Q4_K_M-like mix: 4-bit gate/up with a 6-bit down (llama.cpp's Q4_K_M gives some layers' ffn_down
# Q6_K), then 5-bit gate/up with a 4-bit down; the attention output in Q8_0
K_QUANTS = {"blk.0.ffn_gate_exps.weight": QT.Q4_K, "blk.0.ffn_up_exps.weight": QT.Q4_K,
            "blk.0.ffn_down_exps.weight": QT.Q6_K, "blk.1.ffn_gate_exps.weight": QT.Q5_K,
            "blk.1.ffn_up_exps.weight": QT.Q5_K, "blk.1.ffn_down_exps.weight": QT.Q4_K}


@pytest.fixture(scope="module")
def k_quants(tmp_path_factory):
    """Qwen3-MoE (hidden 256) with k-quant experts: (path, transformers reading the file)."""
    import transformers

    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**WIDE),
                                                          dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("kq") / "tiny-qwen3moe-Q4_K_M.gguf"
    write_gguf(path, model, "qwen3moe", QT.Q8_0, types=K_QUANTS)
    return path, _transformers_reading(path, model)


@pytest.mark.timeout(120)
def test_k_quant_experts_stay_quantized_and_match_transformers(k_quants):
    """Q4_K, Q5_K and Q6_K experts are held as stacked codes (two a byte for Q4_K; Q5_K and Q6_K
    in 8-bit containers) whose dequantization equals the gguf package's up to their float16
    scales, and the model's logits and greedy tokens match transformers on the file."""
    path, ref = k_quants
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: np.asarray(t.data) for t in reader.tensors}
    for layer, (bits13, bits2, biased2) in enumerate(((4, 8, False), (8, 4, True))):
        experts = _loaded_experts(path, layer)
        assert experts.w13.dtype == experts.w2.dtype == torch.uint8
        assert experts.w13.shape == (8, 512, 256 * bits13 // 8) and experts.w2.shape == (8, 256, 256 * bits2 // 8)
        assert experts.bits == {"w13": bits13, "w2": bits2} and (experts.w2_bias is not None) == biased2
        assert experts.groups == {"w13": 32, "w2": 32 if biased2 else 16}
        w13, w2 = _dequantized(experts)
        for part, got in (("gate", w13[:, :256]), ("up", w13[:, 256:]), ("down", w2)):
            name = f"blk.{layer}.ffn_{part}_exps.weight"
            want = quants.dequantize(raw[name], K_QUANTS[name]).reshape(got.shape)
            # the file's scales (and offsets) are fp16 x 6-bit products, rounded to fp16 here: up to
            # 2**-11 of |code * scale| + |offset| (< 0.1 for these blocks) apart
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-3, atol=5e-5)
    # logits of about 1: the fp16 scales move them by ~1e-3 (relative error 5e-4 to 1e-3, fp32 otherwise)
    _check_against(ref, path, PROMPTS, atol=5e-3)


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


@pytest.mark.timeout(360)  # the interpreter runs every K-quant kernel variant: minutes on a loaded 2-core machine
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only: the Triton kernels in the interpreter")
def test_k_quant_experts_on_the_triton_kernels(k_quants, monkeypatch):
    """The GPU's dispatch, forced: the Q4_K/Q5_K/Q6_K experts on the grouped GEMMs (a prompt's
    prefill) and the one-token kernels (a token at a time) match transformers on the file."""
    from kvship.kernels import fused_moe as fm
    from kvship.kernels._triton import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton not installed")
    path, ref = k_quants
    calls = []
    triton_path = fm.fused_moe_triton
    monkeypatch.setattr(fm, "use_triton", lambda t: True)
    monkeypatch.setattr(fm, "fused_moe_triton", lambda *a, **kw: calls.append(a[0].shape[0]) or triton_path(*a, **kw))
    prompt = [PROMPTS[0][:3]]  # the interpreter is slow: 3 tokens
    with torch.no_grad():
        want = ref(torch.tensor(prompt)).logits[0]
    for chunk in (None, 1):
        torch.testing.assert_close(our_logits(path, prompt, chunk=chunk)[0], want, atol=5e-3, rtol=0)
    assert max(calls) == len(prompt[0]) and min(calls) == 1
