"""MTP speculative decoding on a tiny random DeepSeek-V3 checkpoint with one multi-token-prediction
layer (its tensors written past num_hidden_layers, as DeepSeek-V3 stores them): greedy output
identical with and without it; the layer's forward against a plain-torch reference of its
published definition (transformers' decoder layer between enorm/hnorm/eh_proj and the shared
head); a checkpoint without MTP layers refused."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvship.config import SCHEDULE_POLICIES
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from mtp_checks import drafting_logits, first_drafts

SPEC = ("DeepseekV3Config", dict(
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
    n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=24, q_lora_rank=24, num_experts_per_tok=3,
    n_group=4, topk_group=2, norm_topk_prob=True, num_nextn_predict_layers=1))
MTP = {"method": "mtp", "num_speculative_tokens": 3}
OPTS = dict(device="cpu", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_model_len=256)


def _with_mtp_layer(folder, seed=2):
    """Add layer 2 (= num_hidden_layers): a copy of layer 1's block, perturbed, with the MTP parts
    and the embedding and head copies a DeepSeek-V3 checkpoint stores beside them."""
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    mtp = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.1."):
            noise = torch.randn(t.shape, generator=g) * (0.1 if "norm" in name else t.std().nan_to_num(0.02))
            mtp["model.layers.2." + name[len("model.layers.1."):]] = t + noise
    mtp["model.layers.2.enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    mtp["model.layers.2.hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    mtp["model.layers.2.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    mtp["model.layers.2.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    mtp["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import make_tiny_model

    folder = tmp_path_factory.mktemp("dsv3-mtp")
    model = make_tiny_model(folder, "deepseek-v3-mtp", seed=1, spec=SPEC)
    return folder, model, _with_mtp_layer(folder)


@pytest.mark.timeout(120)
def test_mtp_greedy_identical_to_plain_decoding(checkpoint):
    """Repeating prompts, chunked prefill and block size 4; k = 3 drafts from one layer."""
    folder = str(checkpoint[0])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 318, (n,), generator=g).tolist() * r for n, r in ((6, 4), (3, 7), (11, 2), (5, 1))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(folder, **OPTS)
    assert len(plain.engine.runner.model.model.mtp) == 0  # held only to draft with it
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(folder, **OPTS, speculative_config=MTP)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts  # k > 1 drafted
    kv = spec.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    proposer = spec.engine.speculator.proposer
    assert not proposer.tracks and proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.mark.timeout(120)
def test_a_layer_that_guesses_right_is_accepted(tmp_path):
    """The model's final norm and the layer's head norm zeroed: both score every token 0, so
    greedy decoding repeats token 0 and every draft is kept (the kept positions' hidden states
    reach the layer, which keeps drafting k tokens a step)."""
    from conftest import make_tiny_model

    make_tiny_model(tmp_path, "deepseek-v3-mtp", seed=1, spec=SPEC)
    _with_mtp_layer(tmp_path)
    path = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(path)
    for name in ("model.norm.weight", "model.layers.2.shared_head.norm.weight"):
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    spec = LLM(str(tmp_path), **OPTS, speculative_config=MTP)
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    out = spec.generate([[5, 6, 7], list(range(1, 20))], params)
    assert [o.outputs[0].token_ids for o in out] == [[0] * 21] * 2
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens == 2 * 15  # 5 steps of 3 + 1, then 1 left
    assert stats.accepted_per_pos == [10, 10, 10]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", SCHEDULE_POLICIES)
def test_mtp_with_preemption_and_seeded_sampling(checkpoint, policy):
    """15 blocks of 4 tokens cannot hold the four sequences (preempted, recomputed: the layer
    starts over); seeded sampling gives the same tokens as without speculation. In either
    admission order: in the longest outputs' one, a sequence whose drafts must first catch up
    finds the step's budget taken by the one before it (it drafts nothing, and must not spin)."""
    folder = str(checkpoint[0])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 318, (n,), generator=g).tolist() * r for n, r in ((6, 4), (3, 7), (11, 2), (5, 1))]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=30, ignore_eos=True)] * 2
    opts = OPTS | dict(num_kv_blocks=15, schedule_policy=policy)
    want = [o.outputs[0].token_ids for o in LLM(folder, **opts).generate(prompts, params)]
    spec = LLM(folder, **opts, speculative_config=MTP)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.speculator.stats.num_drafts > 0
    proposer = spec.engine.speculator.proposer
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks
    assert not proposer.tracks and proposer.kv.num_free_blocks == proposer.kv.num_blocks


@pytest.mark.timeout(60)
def test_abort_frees_the_layers_blocks(checkpoint):
    """A prompt longer than the step's budget: the layer catches up over it in chunks, drafts,
    and the abort gives its blocks back."""
    spec = LLM(str(checkpoint[0]), **OPTS, speculative_config=MTP)
    engine = spec.engine
    engine.add_request("a", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.speculator.proposer.tracks and engine.speculator.stats.num_drafts > 0
    engine.abort("a")
    proposer = engine.speculator.proposer
    assert not proposer.tracks and proposer.kv.num_free_blocks == proposer.kv.num_blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.timeout(120)
def test_mtp_layer_matches_its_definition(checkpoint):
    """At position t: eh_proj([enorm(embed(x[t+1])), hnorm(h[t])]) -> decoder layer ->
    shared_head.norm -> lm_head, h the target's output (transformers' last_hidden_state)."""
    import transformers

    folder, hf, mtp = checkpoint
    llm = LLM(str(folder), **OPTS, speculative_config=MTP)
    tokens = torch.randint(1, 318, (1, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        tokens[0, 12] = hf(tokens[:, :12]).logits[0, -1].argmax()  # what greedy decoding samples there
        h = hf.model(tokens).last_hidden_state[0]
        cfg = hf.config
        layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(cfg, 2).eval()
        prefix = "model.layers.2."
        block = {k[len(prefix):]: v for k, v in mtp.items()
                 if not k[len(prefix):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
        experts = range(cfg.n_routed_experts)  # stored one by one; transformers holds them stacked
        block["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [block.pop(f"mlp.experts.{e}.gate_proj.weight"), block.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in experts])
        block["mlp.experts.down_proj"] = torch.stack([block.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
        layer.load_state_dict(block)

        def rms(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w
        e = hf.model.embed_tokens(tokens[:, 1:])
        x = torch.cat([rms(e, mtp[prefix + "enorm.weight"]), rms(h[None, :-1], mtp[prefix + "hnorm.weight"])], -1)
        x = x @ mtp[prefix + "eh_proj.weight"].T
        pos = torch.arange(x.shape[1])[None]
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        want = hf.lm_head(rms(out, mtp[prefix + "shared_head.norm.weight"]))[0]

    got = drafting_logits(llm, tokens[0].tolist(), h[:-1])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    # through the engine: the prompt's step hands the layer its hidden states; the first draft
    # is the layer's guess at the prompt's last position
    seen, drafts = first_drafts(llm, tokens[0, :12].tolist())
    assert seen == tokens[0].tolist()
    assert len(drafts) == 3 and drafts[0] == want[11].argmax().item()


@pytest.mark.timeout(60)
def test_checkpoint_without_mtp_layers_is_refused(tmp_path):
    from conftest import make_tiny_model

    make_tiny_model(tmp_path, "deepseek-v3-mtp", seed=1, spec=SPEC)  # the config names one; none stored
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        LLM(str(tmp_path), **OPTS, speculative_config=MTP)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_mtp_greedy_identical(checkpoint):
    """On the GPU: the latent attention's kernels for the layer's own cache; plain decoding runs
    the decode graphs, MTP speculation the verify graphs (the runner keeps hidden states), float32."""
    folder = str(checkpoint[0])
    opts = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 318, (n,), generator=g).tolist() * r for n, r in ((6, 4), (3, 7), (11, 2), (5, 1))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(folder, **opts) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with LLM(folder, **opts, speculative_config=MTP) as spec:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
        assert spec.engine.speculator.stats.num_draft_tokens > 0
        assert spec.engine.runner.verify_graphs.padded_rows is not None  # verify steps replayed, hidden states kept
        proposer = spec.engine.speculator.proposer
        assert not proposer.tracks and proposer.kv.num_free_blocks == proposer.kv.num_blocks
