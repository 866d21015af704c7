"""Our models' logits against transformers on the same weights (tiny random models of each
architecture feature: GQA, tied/untied embeddings, qkv bias, q/k norm, llama3 rope scaling)."""
import pytest
import torch

from conftest import TINY_ARCHS
from kvship.config import EngineConfig
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.layers.rotary import RotaryEmbedding
from kvship.loader import resolve_model
from kvship.models.config import ModelConfig, UnsupportedModelError
from kvship.quant import QuantScheme
from kvship.runner.model_runner import ModelRunner
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

# fp32 on both sides; differences come only from summation order (on the GPU, also from the
# Triton kernels' tf32 tensor-core dots).
ATOL = 2e-4
ATOL_GPU = 5e-3
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def our_logits(folder, prompts: list[list[int]], block_size: int = 4, chunk: int | None = None,
               device: str = "cpu", quantization: str | None = None, kv_cache_dtype: str = "auto"
               ) -> list[torch.Tensor]:
    """All-position logits for each prompt, run as one batch (or in chunks of `chunk` tokens);
    ``quantization``: --quantization's in-situ method."""
    source = resolve_model(str(folder))
    cfg = EngineConfig(model=str(folder), device=device, dtype="float32", block_size=block_size, num_kv_blocks=256,
                       enforce_eager=True, max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    mc = ModelConfig.from_hf(source.hf_config)
    if quantization is not None:
        mc.quantization = QuantScheme(insitu=quantization)
    runner = ModelRunner(cfg, mc, source.weights())
    return runner_logits(runner, KVCacheManager(runner.num_blocks, block_size), prompts, chunk)


def runner_logits(runner: ModelRunner, kv: KVCacheManager, prompts: list[list[int]], chunk: int | None = None
                  ) -> list[torch.Tensor]:
    """All-position logits for each prompt from ``runner``'s model, the prompts run as one batch,
    ``chunk`` tokens of each a step (None: whole), their KV in ``kv``'s blocks."""
    seqs = [Sequence(f"r{i}", 0, list(p), SamplingParams()) for i, p in enumerate(prompts)]
    results = [[] for _ in seqs]
    step = chunk or max(len(p) for p in prompts)
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        batch = Batch()
        for s in seqs:
            n = min(step, s.num_tokens - s.num_computed_tokens)
            if n:
                assert kv.allocate(s, n)
                batch.add(s, n)
        batch = batch.decodes_first()
        ids, pos, meta, _ = runner.prepare(batch)
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(ids, pos, meta))
        starts = meta.cu_seqlens_q.tolist()
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            results[seqs.index(s)].append(logits[starts[i]:starts[i + 1]].cpu())
            s.num_computed_tokens += n
    return [torch.cat(r) for r in results]


def save_checkpoint(folder, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """A safetensors checkpoint folder: ``tensors`` and ``config`` as config.json (no tokenizer)."""
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))


def assert_logits_match(folder, ref, prompts: list[list[int]], device: str = "cpu", chunks=(None,)) -> None:
    """Our logits, the prompts run as one batch (whole, or in chunks of each size in ``chunks``
    over the cached prefix), against transformers' on each prompt alone."""
    with torch.no_grad():
        want = [ref(torch.tensor([p])).logits[0] for p in prompts]
    for chunk in chunks:
        for got, w in zip(our_logits(folder, prompts, chunk=chunk, device=device), want):
            torch.testing.assert_close(got, w, atol=ATOL if device == "cpu" else ATOL_GPU, rtol=0)


def assert_greedy_matches(folder, ref, prompts: list[list[int]], max_tokens: int) -> None:
    """Greedy tokens of the engine (the prompts batched together, prefilled in chunks of 16
    tokens) equal transformers' generate on the same weights; the last prompt, run again,
    hits the prefix cache and gives the same tokens."""
    from kvship.llm import LLM

    llm = LLM(str(folder), device="cpu", dtype="float32", cpu_weight_format="float32", num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = llm.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == ours[-1]
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
        assert got == out[0, len(p):].tolist(), p


def gpu_greedy_agreement(llm, ref, prompts: list[list[int]], max_tokens: int) -> int:
    """How many of the prompts, generated greedily together by ``llm`` on the GPU, give
    transformers' own greedy tokens (``ref`` moved to the GPU for it and back)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ref = ref.cuda()
    agree = 0
    for p, ours in zip(prompts, got):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        agree += ours == want
    ref.cpu()
    return agree


def assert_graph_step_equals_eager(llm, prompts: list[list[int]]) -> None:
    """Once every prompt is prefilled, the decode step's logits replayed from a CUDA graph equal
    the same step run eagerly (bf16 tolerance)."""
    eng, runner = llm.engine, llm.engine.runner
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()  # past the scheduler's join size the prompts take more steps: then the next is pure decode
    prev = eng.in_flight  # the first tokens, still on the GPU: this step's inputs
    batch = eng.scheduler.schedule(prev.rows)
    assert set(batch.num_new_tokens) == {1} and len(batch) == len(prompts)
    graphs = runner.graphs
    with_graph = runner.run(batch, prev)
    runner.graphs = None
    eager = runner.run(Batch(batch.seqs, batch.num_new_tokens), prev)
    runner.graphs = graphs
    torch.testing.assert_close(with_graph, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_logits_match_transformers(tiny_models, arch, device):
    folder, ref = tiny_models[arch]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 17, 40)]
    assert_logits_match(folder, ref, prompts, device)


def test_chunked_prefill_matches_whole(tiny_models):
    folder, ref = tiny_models["llama-gqa-tied"]
    prompts = [list(range(3, 40)), list(range(100, 123))]
    whole = our_logits(folder, prompts)
    chunked = our_logits(folder, prompts, chunk=5)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_config_accepts_rope_parameters():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=10)
    a = ModelConfig.from_hf(base | {"rope_theta": 5e5})
    b = ModelConfig.from_hf(base | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert a.rope_theta == b.rope_theta == 5e5 and b.rope_scaling is None
    c = ModelConfig.from_hf(base | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                          "original_max_position_embeddings": 64}})
    assert c.rope_scaling["rope_type"] == "llama3"


def test_moe_experts_match_the_definition():
    """MoEExperts (experts sorted, one matmul pair each) against moe_reference (token by token)."""
    from kvship.layers.moe import MoEExperts, moe_reference, route
    from kvship.parallel import SINGLE

    g = torch.Generator().manual_seed(0)
    E, H, inter, T = 8, 16, 12, 9
    experts = MoEExperts(E, H, inter, SINGLE)
    experts.w13.copy_(torch.randn(E, 2 * inter, H, generator=g))
    experts.w2.copy_(torch.randn(E, H, inter, generator=g))
    router = torch.randn(E, H, generator=g)
    x = torch.randn(T, H, generator=g)
    for top_k, renorm in ((2, True), (8, False), (1, False)):
        weights, ids = route(x @ router.T, top_k, renorm)
        got = experts(x, weights, ids)
        want = moe_reference(x, router, experts.w13, experts.w2, top_k, renorm)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_greedy_matches_transformers_batched_chunked_and_cached(tiny_models, arch):
    """Greedy tokens of the engine (batched with other requests, chunked prefill, a prefix hit)
    equal transformers' generate on the same weights."""
    folder, ref = tiny_models[arch]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 319, (n,), generator=g).tolist() for n in (6, 21, 33)]
    prompts.append(prompts[2][:24] + [5, 6, 7])  # shares 24 tokens with the third: prefix-cache blocks
    assert_greedy_matches(folder, ref, prompts, 12)


def test_longrope_table_takes_the_long_factors_past_the_original_context(tiny_models):
    """Positions within Phi-3's original context rotate by the short factors, those past it by the
    long ones (vLLM's rule): each row equals transformers' own longrope frequencies for a
    sequence of that length, scaled by its attention factor. (The model tests' prompts stay within
    the original context, where transformers agrees for every position.)"""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvship.runner.model_setup import load_model  # (the model's config as the engine parses it)

    folder, ref = tiny_models["phi3-longrope"]
    _, cfg = load_model(EngineConfig(model=str(folder), device="cpu"))
    max_pos, original = ref.config.max_position_embeddings, ref.config.original_max_position_embeddings
    table = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling).cos_sin_cache
    positions = torch.arange(max_pos, dtype=torch.float64)
    for rows, seq_len in ((slice(0, original), original), (slice(original, max_pos), max_pos)):
        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](ref.config, seq_len=seq_len)
        freqs = torch.outer(positions[rows], inv_freq.double())
        want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention
        torch.testing.assert_close(table[rows], want.float(), rtol=1e-5, atol=1e-5)


def test_decoder_sparse_step_picks_the_routed_layers():
    """Qwen3-MoE and Qwen2-MoE route layer i when (i + 1) % decoder_sparse_step == 0 and i is
    not in mlp_only_layers, as transformers builds them."""
    import transformers

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, vocab_size=320,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                mlp_only_layers=[3])
    for arch, cls in (("Qwen3MoeForCausalLM", "Qwen3MoeConfig"), ("Qwen2MoeForCausalLM", "Qwen2MoeConfig")):
        ours = ModelConfig.from_hf({"architectures": [arch], **base})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**base))
        want = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
        assert want == [False, True, False, False, False, True]
        assert [ours.is_sparse(i) for i in range(6)] == want, arch


def test_phi4_mini_partial_rotary_is_refused():
    base = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=10, partial_rotary_factor=0.75)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf(base)


def test_sliding_window_keeps_the_whole_context(tmp_path, tiny_models):
    """A single window (Mistral v0.1, Phi-3-mini) is applied by the attention layers
    (test_models_gemma.py checks Mistral past the window against transformers), so the context
    stays the model's full length; Qwen2's unused window is ignored."""
    import json
    import shutil

    from kvship.runner.model_setup import load_model

    folder = tmp_path / "windowed"
    shutil.copytree(tiny_models["phi3"][0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 100}))
    config = EngineConfig(model=str(folder), device="cpu")
    _, model_config = load_model(config)
    assert config.max_model_len == cfg["max_position_embeddings"] > 100
    assert set(model_config.layer_windows) == {100}
    qwen = ModelConfig.from_hf(json.loads((tiny_models["qwen2-bias"][0] / "config.json").read_text()))
    assert not qwen.layer_windows
