"""Verify steps in the padded layout of runner/verify_graphs.py: on the CPU the same forward run
eagerly in that layout (every sequence padded to k + 1 rows, phantom positions past the real
ones, padding sequences) gives the logits and KV cache of the ragged step; on the GPU the
captured graphs give those of the eager step, and speculation with them keeps greedy output
identical on tiny random models (no bundled model: the GPU machine has none)."""
import pytest
import torch

from kvship.llm import LLM
from kvship.runner.verify_graphs import VerifyGraphs, verify_graph_max_batch
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# (prompt length, proposals): none, fewer than k, k; one ends at the context's end (64), so its
# phantom positions run past it; contexts of 4-token blocks that the phantom rows cross
SHAPES = [(9, 0), (30, 2), (17, K), (5, 1), (62, 1), (40, 3)]
TINY = {
    "llama": None,
    # every layer over a 16-token window: given-back blocks in the table, the window's mask
    "mistral-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=16)),
    # multi-head latent attention: the latent cache's prefill path in the padded layout
    "deepseek-v3": ("DeepseekV3Config", dict(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=24, q_lora_rank=24, num_experts_per_tok=3,
        n_group=4, topk_group=2, norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from conftest import make_tiny_model

    root = tmp_path_factory.mktemp("spec-graphs")
    for name, spec in TINY.items():
        make_tiny_model(root / name, "llama-gqa-tied" if spec is None else name, seed=1, spec=spec)
    return {name: str(root / name) for name in TINY}


def verify_batch(llm, shapes=SHAPES, seed=0) -> Batch:
    """Sequences prefilled up to their last token, each with its proposals: a verify step."""
    eng, g = llm.engine, torch.Generator().manual_seed(seed)
    seqs, drafts = [], []
    for i, (n, k) in enumerate(shapes):
        s = Sequence(f"v{seed}-{i}", 0, torch.randint(1, 318, (n,), generator=g).tolist(), SamplingParams())
        assert eng.kv.allocate(s, n + k)
        seqs.append(s)
        drafts.append(torch.randint(1, 318, (k,), generator=g).tolist())
    eng.runner.run(Batch(seqs, [len(s.token_ids) - 1 for s in seqs]))
    for s, d in zip(seqs, drafts):
        s.num_computed_tokens = len(s.token_ids) - 1
        s.draft_token_ids = d
    return Batch(seqs, [1 + len(d) for d in drafts]).decodes_first()


def caches(runner) -> list[torch.Tensor]:
    return [c.clone() for attn in runner.model.attention_layers() for c in (attn.k_cache, attn.v_cache)
            if c is not None]


def padded_equals_ragged(llm, graphs: VerifyGraphs, tol: float) -> None:
    """The verify step with ``graphs`` installed against the same step eager: logits, the rows
    the runner hands out, and the KV cache both leave."""
    runner = llm.engine.runner
    batch = verify_batch(llm)
    runner.verify_graphs = None
    eager = runner.run(batch)
    eager_hidden = runner.take_hidden()
    kv = caches(runner)
    runner.verify_graphs = graphs
    padded = runner.run(batch)
    assert graphs.padded_rows is not None and padded.shape == eager.shape == (sum(batch.num_new_tokens), 320)
    torch.testing.assert_close(padded, eager, atol=tol, rtol=tol)
    if runner.keep_hidden:  # an MTP proposer's input: a row per input token, in the step's order
        torch.testing.assert_close(runner.take_hidden(), eager_hidden, atol=tol, rtol=tol)
    for a, b in zip(caches(runner), kv):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert (padded.argmax(-1) == eager.argmax(-1)).float().mean() > 0.95
    for s in batch.seqs:
        llm.engine.kv.free(s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", TINY)
def test_padded_verify_layout_equals_ragged_on_cpu(folders, arch):
    llm = LLM(folders[arch], device="cpu", block_size=4, num_kv_blocks=120, max_model_len=64)
    runner = llm.engine.runner
    runner.keep_hidden = True  # as for MTP: the hidden states handed out too
    graphs = VerifyGraphs(runner.model, 8, K + 1, runner.max_model_len, runner.block_size, runner.device, True)
    assert graphs.sizes == [1, 2, 4, 8]  # six sequences: two padding ones
    padded_equals_ragged(llm, graphs, 1e-4)


def test_verify_graph_batch_bound():
    assert verify_graph_max_batch(4, 32, 256) == 32
    assert verify_graph_max_batch(4, 32, 8) == 8
    assert verify_graph_max_batch(7, 256, 256) == 64  # 512 rows of k + 1


GPU = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, gpu_memory_utilization=0.3)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def repeating_prompts(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 318, (int(a),), generator=g).tolist() * int(r)
            for a, r in zip(torch.randint(3, 12, (n,), generator=g), torch.randint(1, 6, (n,), generator=g))]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", TINY)
def test_gpu_verify_graph_equals_eager(folders, arch):
    opts = dict(GPU, max_model_len=64, block_size=16, num_kv_blocks=64)
    with LLM(folders[arch], **opts, speculative_config=NGRAM) as llm:
        graphs = llm.engine.runner.verify_graphs
        assert graphs is not None and graphs.graphs and graphs.q == K + 1
        padded_equals_ragged(llm, graphs, 2e-3)  # tf32 matmuls of other shapes


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", TINY)
def test_gpu_ngram_with_verify_graphs_identical(folders, arch):
    prompts = repeating_prompts()
    with LLM(folders[arch], **GPU) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(folders[arch], **GPU, speculative_config=NGRAM) as spec:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
        assert spec.engine.speculator.stats.num_draft_tokens > 0
        assert spec.engine.runner.verify_graphs.padded_rows is not None  # a verify ran in a graph
        kv = spec.engine.kv
        assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_draft_model_drafting_for_itself_tiny(folders):
    """The tiny model as its own draft: every proposal accepted, outputs identical."""
    prompts = repeating_prompts()
    with LLM(folders["llama"], **GPU) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(folders["llama"], **GPU, speculative_config={"model": folders["llama"], "num_speculative_tokens": 3}
             ) as spec:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
        stats = spec.engine.speculator.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        assert spec.engine.runner.verify_graphs.padded_rows is not None
        kv = spec.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
