"""The hybrid Gated DeltaNet families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers
on tiny random checkpoints: logits batched over prompts of different lengths, whole and in
chunks that cut through the delta rule's 64-token chunks, one token a step; greedy tokens
through the engine with chunked prefill, with preemption, and with the prefix cache (hits resume
from recurrent-state checkpoints: tests/models/test_qwen3_next_prefix_cache.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import write_word_tokenizer
from kvship.config import EngineConfig
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.loader import resolve_model
from kvship.models.config import ModelConfig
from kvship.runner.model_runner import ModelRunner
from kvship.sampling_params import SamplingParams
from test_models import ATOL, runner_logits, save_checkpoint

LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=319, bos_token_id=0,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, layer_types=LAYERS)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
SPECS = {
    # routed experts with a shared one, one dense layer, DeltaNet projections grouped per key head
    "qwen3_next": ("Qwen3NextConfig", dict(**MOE, norm_topk_prob=True, mlp_only_layers=[2])),
    "qwen3_5": ("Qwen3_5TextConfig", dict(tie_word_embeddings=True)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE),
}


def make_hybrid(folder: Path, arch: str, seed: int = 0):
    import transformers

    cls_name, extra = SPECS[arch]
    kw = dict(COMMON, **extra)
    if arch == "qwen3_5_moe":
        del kw["intermediate_size"]  # not a field of Qwen3.5-MoE
    cfg = getattr(transformers, cls_name)(**kw)
    cfg.rope_parameters["partial_rotary_factor"] = 0.5  # 8 of 16 channels rotate
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from their initial values, so that (1 + w) is checked
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, cfg.vocab_size)
    return model


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: (root / arch, make_hybrid(root / arch, arch)) for arch in SPECS}


def our_logits(folder, prompts, chunk: int | None = None) -> list[torch.Tensor]:
    """All-position logits of each prompt, the prompts run as one batch, ``chunk`` tokens of
    each a step (the recurrent state carried between steps in each sequence's slot)."""
    source = resolve_model(str(folder))
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
                       enforce_eager=True, max_model_len=256, max_num_seqs=4)
    runner = ModelRunner(cfg, ModelConfig.from_hf(source.hf_config), source.weights())
    assert runner.num_state_slots  # the recurrent layers' states have their slots
    return runner_logits(runner, KVCacheManager(runner.num_blocks, 4, enable_prefix_caching=False), prompts, chunk)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", list(SPECS))
def test_logits_match_transformers(hybrids, arch):
    folder, ref = hybrids[arch]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 5, 33)]
    with torch.no_grad():
        want = [ref(torch.tensor([p])).logits[0] for p in prompts]
    for chunk in (None, 24):  # whole; 24 a step (the step over positions 48..71 straddles 64, a chunk edge)
        for got, w in zip(our_logits(folder, prompts, chunk), want):
            torch.testing.assert_close(got, w, atol=ATOL, rtol=0)
    short = [p[:12] for p in prompts]  # one token a step: the decode path (conv and delta-rule steps)
    for got, w in zip(our_logits(folder, short, 1), want):
        torch.testing.assert_close(got, w[:12], atol=ATOL, rtol=0)


def greedy_reference(ref, prompts, max_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", list(SPECS))
def test_greedy_matches_transformers(hybrids, arch):
    """Batched prompts of different lengths, prefilled 16 tokens a step; the last prompt run
    again resumes from the prefix cache (a state checkpoint at its last full block) with the
    same tokens."""
    from kvship.llm import LLM

    folder, ref = hybrids[arch]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (3, 40, 21)]
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=16,
              max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = llm.generate([prompts[-1]], params)[0]
    assert ours == greedy_reference(ref, prompts, 8)
    assert again.num_cached_tokens == 20 and again.outputs[0].token_ids == ours[-1]
    kv = llm.engine.kv  # every state slot given back with its sequence, never more than the runner holds
    assert 0 < kv.num_state_slots <= llm.engine.runner.num_state_slots
    assert sorted(kv.free_state_slots) == list(range(kv.num_state_slots))


@pytest.mark.timeout(300)
def test_preempted_sequences_rebuild_their_state(hybrids):
    """Too few KV blocks for every sequence: the newest are preempted, their state slots given
    back, and recomputed later from their tokens into a fresh state."""
    from kvship.llm import LLM

    folder, ref = hybrids["qwen3_5"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (20, 24, 18)]
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=22, block_size=4, max_num_batched_tokens=64,
              max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert ours == greedy_reference(ref, prompts, 12)
    assert sorted(llm.engine.kv.free_state_slots) == list(range(llm.engine.kv.num_state_slots))


@pytest.mark.timeout(300)
def test_conditional_generation_checkpoint_reads_its_language_model(hybrids, tmp_path):
    """A Qwen3_5ForConditionalGeneration folder: the text config nested, the language model's
    tensors under model.language_model., the vision tower's and the MTP layer's skipped."""
    from safetensors.torch import load_file

    folder, ref = hybrids["qwen3_5"]
    inner = json.loads((folder / "config.json").read_text())
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": True, "text_config": {**inner, "model_type": "qwen3_5_text"},
           "vision_config": {"depth": 1}}
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(folder / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    out = tmp_path / "vl"
    save_checkpoint(out, tensors, cfg)
    write_word_tokenizer(out, 320)
    prompt = list(range(5, 30))
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(our_logits(out, [prompt])[0], want, atol=ATOL, rtol=0)


def _fp8_block(tensors: dict[str, torch.Tensor], block: int = 32):
    """The projections quantized to FP8 in blocks of block x block (the last blocks partial, as
    the DeltaNet's small b and a projections' are): the file's tensors and their values. The
    routed experts stay in 16 bits: transformers holds them stacked, under other names."""
    out, deq = {}, {}
    for name, w in tensors.items():
        if not name.endswith(("proj.weight", "proj_qkvz.weight", "proj_ba.weight")) or ".experts." in name:
            out[name] = deq[name] = w
            continue
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, -k % block, 0, -n % block))
        scales = padded.view(padded.shape[0] // block, block, -1, block).abs().amax((1, 3)).clamp_min(1e-12) / 448.0
        full = scales.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        codes = (w / full).to(torch.float8_e4m3fn)
        out[name], out[name[:-len("weight")] + "weight_scale_inv"] = codes, scales.float()
        deq[name] = codes.float() * full
    return out, deq


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_fp8_block_checkpoint_matches_its_dequantized_weights(tmp_path, arch):
    """An FP8 block-wise checkpoint (as Qwen3.6-27B-FP8's) against transformers running the
    values it stores; Qwen3-Next's grouped projections are regrouped in 16 bits."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / arch
    ref = make_hybrid(folder, arch, seed=4)
    out, deq = _fp8_block(load_file(folder / "model.safetensors"))
    save_file(out, folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (folder / "config.json").write_text(json.dumps(cfg))
    ref.load_state_dict(deq, strict=False)
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    got = our_logits(folder, [prompt])[0]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def loaded_model(folder):
    """The model a CPU runner builds and loads from ``folder``."""
    source = resolve_model(str(folder))
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                       enforce_eager=True, max_model_len=128)
    return ModelRunner(cfg, ModelConfig.from_hf(source.hf_config), source.weights()).model


def _mtp_tensors(model, fused_experts: bool) -> dict[str, torch.Tensor]:
    """One MTP layer as the checkpoints name it (mtp.fc, its two input norms, mtp.layers.0 as a
    full-attention decoder layer of the model, mtp.norm), random; the experts fused as
    transformers saves them or one matrix per expert, as Qwen3-Next's checkpoints hold them."""
    g = torch.Generator().manual_seed(9)
    sd = model.state_dict()
    out = {"mtp.fc.weight": torch.randn(64, 128, generator=g)}
    for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        out[norm] = torch.randn(64, generator=g)
    for name, t in sd.items():  # layer 1 is full attention: its shapes are the MTP layer's
        if not name.startswith("model.layers.1."):
            continue
        rest = name[len("model.layers.1."):]
        t = torch.randn(t.shape, generator=g)
        if rest.startswith("mlp.experts.") and not fused_experts:
            for e in range(t.shape[0]):
                if rest.endswith("gate_up_proj"):
                    gate, up = t[e].chunk(2)
                    out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up
                else:
                    out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[f"mtp.layers.0.{rest}"] = t
    return out


def with_mtp_layer(src: Path, ref, folder: Path, config_key: str = "mtp_num_hidden_layers") -> dict[str, torch.Tensor]:
    """``src``'s checkpoint written to ``folder`` with one random MTP layer (``_mtp_tensors``,
    experts fused for Qwen3.5-MoE), its config naming it under ``config_key``."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    arch = json.loads((src / "config.json").read_text())["model_type"]
    mtp = _mtp_tensors(ref, fused_experts=arch in ("qwen3_5_moe", "qwen3_5_moe_text"))
    save_file({**load_file(src / "model.safetensors"), **mtp}, folder / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, config_key: 1}))
    write_word_tokenizer(folder, 320)
    return mtp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_mtp_layer_is_loaded(hybrids, tmp_path, arch):
    """A checkpoint whose config announces an MTP layer: its tensors land in model.mtp (norms as
    1 + w, q/k/v and gate/up fused, experts stacked), and the model's logits are unchanged."""
    src, ref = hybrids[arch]
    folder = tmp_path / arch
    mtp = with_mtp_layer(src, ref, folder, "mtp_num_hidden_layers" if arch == "qwen3_5_moe" else "num_nextn_predict_layers")
    m = loaded_model(folder).model.mtp
    assert m is not None and len(m.layers) == 1 and not m.layers[0].linear
    assert torch.equal(m.fc.weight, mtp["mtp.fc.weight"])
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert torch.equal(getattr(m, norm).weight, mtp[f"mtp.{norm}.weight"] + 1)
    layer, p = m.layers[0], "mtp.layers.0."
    qkv = torch.cat([mtp[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.self_attn.q_norm.weight, mtp[p + "self_attn.q_norm.weight"] + 1)
    assert torch.equal(layer.input_layernorm.weight, mtp[p + "input_layernorm.weight"] + 1)
    experts = layer.mlp.experts
    if arch == "qwen3_5_moe":
        assert torch.equal(experts.w13, mtp[p + "mlp.experts.gate_up_proj"])
        assert torch.equal(experts.w2, mtp[p + "mlp.experts.down_proj"])
    else:
        assert torch.equal(experts.w13[3], torch.cat([mtp[p + f"mlp.experts.3.{x}_proj.weight"] for x in ("gate", "up")]))
        assert torch.equal(experts.w2[5], mtp[p + "mlp.experts.5.down_proj.weight"])
    assert torch.equal(layer.mlp.shared_expert.down_proj.weight, mtp[p + "mlp.shared_expert.down_proj.weight"])
    assert torch.equal(layer.mlp.gate.weight, mtp[p + "mlp.gate.weight"])
    prompt = list(range(5, 30))
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(our_logits(folder, [prompt])[0], want, atol=ATOL, rtol=0)
    # the layer drafts (tests/models/test_hybrid_speculative.py: greedy tokens unchanged)
    from kvship.llm import LLM

    spec = LLM(str(folder), device="cpu", num_kv_blocks=16,
               speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert spec.engine.speculator.proposer.layer is spec.engine.runner.model.model.mtp


@pytest.mark.timeout(300)
def test_mtp_announced_but_absent_is_not_kept(hybrids, tmp_path):
    """A config that names an MTP layer whose checkpoint lacks it (as transformers saves one):
    the model loads, and keeps no MTP module."""
    import shutil

    src, _ = hybrids["qwen3_5"]
    folder = tmp_path / "no-mtp"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    model = loaded_model(folder)
    assert model.cfg.mtp_layers == 1 and model.model.mtp is None


@pytest.mark.timeout(300)
def test_fp8_checkpoint_mtp_layer_is_loaded(hybrids, tmp_path):
    """An FP8 block-wise checkpoint with its MTP layer (fc and the layer's projections in FP8
    blocks too, as Qwen3.6-27B-FP8 ships it): the layer loads, fc dequantized to the model's dtype."""
    from safetensors.torch import load_file, save_file

    src, _ = hybrids["qwen3_5"]
    folder = tmp_path / "fp8-mtp"
    folder.mkdir()
    mtp = _mtp_tensors(make_hybrid(tmp_path / "dense", "qwen3_5"), fused_experts=True)
    fc, fc_deq = _fp8_block({"mtp.fc.proj.weight": mtp.pop("mtp.fc.weight")})
    out, _ = _fp8_block({**load_file(src / "model.safetensors"), **mtp})
    out.update({k.replace("fc.proj", "fc"): v for k, v in fc.items()})
    save_file(out, folder / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(mtp_num_hidden_layers=1, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                                             "weight_block_size": [32, 32]})
    (folder / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(folder, 320)
    m = loaded_model(folder).model.mtp
    assert torch.equal(m.fc.weight, fc_deq["mtp.fc.proj.weight"])
    assert m.layers[0].self_attn.qkv_proj.weight.shape == (128 + 64, 64)
