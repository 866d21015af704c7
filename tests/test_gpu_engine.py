"""The engine on a GPU: Triton kernels + CUDA graphs agree with eager execution and with
transformers. Skipped without CUDA (run through the device tool:
`python -m pytest tests/test_gpu_engine.py tests/test_models.py tests/test_kernels.py`).
Real-size bf16 paths are exercised by bench/latency.py and bench/throughput.py."""
import pytest
import torch

from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from test_models import assert_graph_step_equals_eager, gpu_greedy_agreement

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n=8):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 319, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


def test_gpu_greedy_matches_transformers(tiny_models):
    folder, ref = tiny_models["llama-gqa-tied"]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16)
    assert llm.engine.runner.graphs is not None
    ps = prompts()
    agree = gpu_greedy_agreement(llm, ref, ps, 12)
    # tf32 dots may flip a near-tie in a random model; nearly all must be identical.
    assert agree >= len(ps) - 1
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_cuda_graph_replay_equals_eager(tiny_models):
    folder, _ = tiny_models["qwen3-qknorm"]
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16)
    assert_graph_step_equals_eager(llm, prompts(11))  # 11 pads to the 16-wide graph


def test_gpu_seeded_sampling_reproducible(tiny_models):
    folder, _ = tiny_models["llama-mha-untied"]
    llm = LLM(str(folder), device="cuda", max_model_len=256, max_num_seqs=16)
    ps = prompts(4)
    p = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=16)
    alone = llm.generate([ps[2]], p)[0].outputs[0].token_ids
    mixed = llm.generate(ps, [SamplingParams(temperature=1.0, max_tokens=16)] * 2 + [p, GREEDY])
    assert mixed[2].outputs[0].token_ids == alone


@pytest.mark.parametrize("arch", ["llama-gqa-tied", "qwen3-qknorm"])
def test_batch1_graphs_with_the_norms_in_the_gemv(tiny_models, arch, monkeypatch):
    """Every projection of the tiny model listed for the one-row GEMV, as the 8B shape's are: a
    batch-1 graph then runs no norm kernel inside its layers (q/k/v and gate/up normalize in
    their prologues, o and down add into the residual). fp32 greedy tokens against transformers,
    prompts one at a time; then the bf16 graph step against the eager one."""
    from kvship.kernels import gemv
    from test_models import _EveryShape

    monkeypatch.setattr(gemv, "GEMV_SHAPES", _EveryShape())
    folder, ref = tiny_models[arch]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=1)
    ps = prompts(4)
    agree = sum(gpu_greedy_agreement(llm, ref, [p], 12) for p in ps)
    assert agree >= len(ps) - 1
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=1)
    assert_graph_step_equals_eager(llm, prompts(1))


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_batch1_quantized_with_the_norms_in_the_gemv(tiny_models, quantization, monkeypatch):
    """In-situ FP8 and int4 at batch 1: the pairs GEMV takes the norms and residuals (its one-row
    path runs in and out of graphs alike). Greedy tokens with the fusions against the same
    engine with its norms as kernels of their own (KVSHIP_NORM_GEMV=0's switch)."""
    from kvship.models import llama

    folder, _ = tiny_models["qwen3-qknorm"]
    ps = prompts(4)

    def greedy(fused: bool) -> list[list[int]]:
        monkeypatch.setattr(llama, "ONE_ROW_NORMS", fused)
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=1,
                  quantization=quantization)
        return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in ps]

    fused, plain = greedy(True), greedy(False)
    assert sum(a == b for a, b in zip(fused, plain)) >= len(ps) - 1
