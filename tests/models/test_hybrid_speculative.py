"""Speculative decoding on the hybrid Gated DeltaNet families (Qwen3.5 dense and MoE, Qwen3-Next):
a verify runs each sequence's proposals through the DeltaNet layers, keeps the recurrent state
after each of them, and the sequence resumes from the one after its last accepted token. On tiny
random checkpoints: greedy tokens identical to plain decoding and to transformers with n-gram
proposals and with proposals accepted part-way (4 prompts batched, chunked prefill,
preemption, prefix hits), every KV block and state
slot free afterwards, abort included, over two tensor-parallel ranks too; the checkpoints' MTP
layer (random weights) drafting, with the same tokens."""
from __future__ import annotations

import pytest
import torch

from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from mtp_checks import drafting_logits, first_drafts
from test_models_qwen3_next import SPECS, make_hybrid, with_mtp_layer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# block size 4 and 16 tokens a step chunk the prompts; 24 blocks cannot hold all four (preemption)
OPTS = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
            max_model_len=128, max_num_seqs=4, num_state_checkpoints=16)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-spec")
    return {arch: (root / arch, make_hybrid(root / arch, arch, seed=1)) for arch in SPECS}


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a pattern (n-gram lookup proposes from them), one without."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 318, (n,), generator=g).tolist() * r for n, r in ((6, 4), (3, 7), (11, 2), (5, 1))]


def assert_all_released(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)
    assert sorted(kv.free_state_slots) == list(range(kv.num_state_slots))


class Oracle:
    """Proposes the plain run's next tokens, the first ``right`` of them right and then a wrong
    one, ``right`` cycling through 0..k: every number of accepted proposals happens, so the
    state after each verified position is the one a sequence resumes from at some step."""

    def __init__(self, prompts, want):
        self.want = {tuple(p): w for p, w in zip(prompts, want)}
        self.calls = 0

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            w, done = self.want[tuple(seq.prompt_token_ids)], seq.num_output_tokens
            right = self.calls % (k + 1)
            self.calls += 1
            draft = w[done:done + right]
            if right < k and done + right < len(w):
                draft.append((w[done + right] + 1) % 318)
            out.append(draft[:k])
        return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", list(SPECS))
def test_greedy_identical_with_speculation(hybrids, arch):
    """n-gram proposals (mostly rejected on a random model), then proposals accepted part-way
    to every position; 4 prompts batched, chunked, preempted, then again as prefix hits."""
    folder, _ = hybrids[arch]
    prompts = repeating_prompts()
    # (transformers' greedy tokens are checked in test_models_qwen3_next.py; its generate cannot
    # go past EOS, which a random model may pick)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), **OPTS).generate(prompts, GREEDY)]
    spec = LLM(str(folder), **OPTS, speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
    stats = spec.engine.speculator.stats
    assert stats.num_drafts > 0 and spec.engine.scheduler.num_preemptions > 0
    assert_all_released(spec)

    spec.engine.speculator.proposer = Oracle(prompts, want)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.engine.kv.prefix_hits > 0
    accepted = stats.accepted_per_pos
    assert all(n > 0 for n in accepted), f"some position was never accepted: {accepted}"
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert_all_released(spec)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", list(SPECS))
def test_mtp_greedy_identical_to_plain_decoding(hybrids, arch, tmp_path):
    """The checkpoint's MTP layer (random: its guesses mostly rejected) drafts k = 3 tokens a
    step, from the target's hidden states; the same greedy tokens, every block and slot free."""
    src, ref = hybrids[arch]
    folder = tmp_path / arch
    with_mtp_layer(src, ref, folder)
    prompts = repeating_prompts(2)
    want = [o.outputs[0].token_ids for o in LLM(str(src), **OPTS).generate(prompts, GREEDY)]
    spec = LLM(str(folder), **OPTS, speculative_config=MTP)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
    stats = spec.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts  # k > 1 drafted
    assert spec.engine.scheduler.num_preemptions > 0
    assert_all_released(spec)
    proposer = spec.engine.speculator.proposer
    assert not proposer.tracks and proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.mark.timeout(300)
def test_mtp_block_matches_its_definition(hybrids, tmp_path):
    """At position t: fc([norm_e(embed(x[t+1])), norm_h(h[t])]) -> the full-attention decoder
    layer -> final norm -> LM head, each norm times (1 + w), h the target's output (transformers'
    last_hidden_state); through the engine, the first draft is the block's guess at the prompt's
    last position."""
    import transformers

    src, ref = hybrids["qwen3_5"]
    mtp = with_mtp_layer(src, ref, tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), **OPTS, speculative_config=MTP)
    tokens = torch.randint(1, 318, (1, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        tokens[0, 12] = ref(tokens[:, :12]).logits[0, -1].argmax()  # what greedy decoding samples there
        h = ref.model(tokens).last_hidden_state[0]
        cfg = ref.config
        layer = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5DecoderLayer(cfg, 1).eval()
        layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})

        def rms(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1 + w)
        e = ref.model.embed_tokens(tokens[:, 1:])
        x = torch.cat([rms(e, mtp["mtp.pre_fc_norm_embedding.weight"]),
                       rms(h[None, :-1], mtp["mtp.pre_fc_norm_hidden.weight"])], -1) @ mtp["mtp.fc.weight"].T
        n = x.shape[1]
        pos = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=ref.model.rotary_emb(x, pos.expand(3, 1, n)), attention_mask=causal,
                    position_ids=pos)
        want = ref.lm_head(rms(out[0] if isinstance(out, tuple) else out, mtp["mtp.norm.weight"]))[0]

    got = drafting_logits(llm, tokens[0].tolist(), h[:-1])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    seen, drafts = first_drafts(llm, tokens[0, :12].tolist())
    assert seen == tokens[0].tolist()
    assert len(drafts) == 3 and drafts[0] == want[11].argmax().item()


@pytest.mark.timeout(300)
def test_draft_model_for_a_hybrid_target(hybrids, tmp_path):
    """A small (non-hybrid) draft sharing the tokenizer: the hybrid target's greedy tokens,
    every block, slot and draft block free afterwards."""
    from conftest import make_tiny_model

    folder, _ = hybrids["qwen3_5_moe"]
    make_tiny_model(tmp_path / "draft", "llama-gqa-tied", seed=3)
    prompts = repeating_prompts(4)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), **OPTS).generate(prompts, GREEDY)]
    spec = LLM(str(folder), **OPTS, speculative_config={"model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    assert_all_released(spec)
    draft = spec.engine.speculator.proposer
    assert draft.kv.num_free_blocks == draft.kv.num_blocks


@pytest.mark.timeout(300)
def test_abort_with_speculation_frees_every_slot(hybrids):
    folder, _ = hybrids["qwen3_5"]
    llm = LLM(str(folder), **OPTS, speculative_config=NGRAM)
    engine = llm.engine
    for i, p in enumerate(repeating_prompts(1)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(8):
        engine.step()
    assert engine.speculator.stats.num_drafts > 0
    for i in range(4):
        engine.abort(f"r{i}")
    assert not engine.has_work()
    assert_all_released(llm)


@pytest.mark.timeout(600)
def test_speculation_with_tensor_parallelism(hybrids):
    """Two ranks, each holding its heads' share of every state row: the verify's rows go to the
    other rank with the step, the rollback copies with the next one; n-gram and part-way
    accepted proposals give one rank's tokens."""
    folder, _ = hybrids["qwen3_5"]
    prompts = repeating_prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # long enough to notice a rank's state
    want = [o.outputs[0].token_ids for o in LLM(str(folder), **OPTS).generate(prompts, params)]
    spec = LLM(str(folder), **OPTS, speculative_config=NGRAM, tensor_parallel_size=2)
    try:
        ngram, spec.engine.speculator.proposer = spec.engine.speculator.proposer, Oracle(prompts, want)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
        spec.engine.speculator.proposer = ngram
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
        assert all(n > 0 for n in spec.engine.speculator.stats.accepted_per_pos)
        assert_all_released(spec)
    finally:
        spec.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_gpu_speculation_keeps_greedy_tokens(hybrids, arch):
    """On the GPU the verify's per-position states come from the Triton kernels, plain decode
    steps from CUDA graphs: n-gram and part-way accepted proposals give plain decoding's tokens
    (tf32 dots may flip a near-tie in a random model: all prompts but one must agree)."""
    folder, _ = hybrids[arch]
    prompts = repeating_prompts(3)
    kw = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), **kw).generate(prompts, GREEDY)]
    spec = LLM(str(folder), **kw, speculative_config=NGRAM)
    for proposer in (None, Oracle(prompts, want)):
        if proposer is not None:
            spec.engine.speculator.proposer = proposer
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)]
        assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1
        assert_all_released(spec)
    assert all(n > 0 for n in spec.engine.speculator.stats.accepted_per_pos)
