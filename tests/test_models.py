"""Our models' logits against transformers on the same weights (tiny random models of each
architecture feature: GQA, tied/untied embeddings, qkv bias, q/k norm, llama3 rope scaling)."""
import pytest
import torch

from conftest import TINY_ARCHS
from kvship.config import EngineConfig
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.loader import resolve_model
from kvship.models.config import ModelConfig, UnsupportedModelError
from kvship.runner.model_runner import ModelRunner
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

# fp32 on both sides; differences come only from summation order (on the GPU, also from the
# Triton kernels' tf32 tensor-core dots).
ATOL = 2e-4
ATOL_GPU = 5e-3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def our_logits(folder, prompts: list[list[int]], block_size: int = 4, chunk: int | None = None,
               device: str = "cpu") -> list[torch.Tensor]:
    """All-position logits for each prompt, run as one batch (or in chunks of `chunk` tokens)."""
    source = resolve_model(str(folder))
    cfg = EngineConfig(model=str(folder), device=device, dtype="float32", block_size=block_size, num_kv_blocks=256,
                       enforce_eager=True, max_model_len=256)
    mc = ModelConfig.from_hf(source.hf_config)
    runner = ModelRunner(cfg, mc, source.weights())
    kv = KVCacheManager(runner.num_blocks, block_size)
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
        ids, pos, meta = runner.prepare(batch)
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(ids, pos, meta))
        starts = meta.cu_seqlens_q.tolist()
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            results[seqs.index(s)].append(logits[starts[i]:starts[i + 1]].cpu())
            s.num_computed_tokens += n
    return [torch.cat(r) for r in results]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_logits_match_transformers(tiny_models, arch, device):
    folder, ref = tiny_models[arch]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 17, 40)]
    ours = our_logits(folder, prompts, device=device)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, want, atol=ATOL if device == "cpu" else ATOL_GPU, rtol=0)


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
