"""The engine on real weights (SmolLM2-135M, bundled): greedy output identical to transformers,
also with prefix-cache hits, small prefill chunks and forced preemption. The float32 path
(``cpu_weight_format="float32"``): the int8 one has its own test (test_cpu_int8_weights.py)."""
import pytest
import torch

from kvship.config import OFFLINE_SCHEDULE_POLICY
from kvship.core.output_processor import Accepted, OutputProcessor
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

MAX_TOKENS = 20
QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Translate 'good morning' into Spanish, French and German, one per line.",
    "Explain in two sentences what a hash table is and when you would use one instead of a list.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


@pytest.fixture(scope="module")
def prompts(smollm2_hf):
    _, tok = smollm2_hf
    out = []
    for i, q in enumerate(QUESTIONS):
        if i % 2:  # half chat-formatted (they share the system prompt: prefix-cache material)
            q = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tok(q, add_special_tokens=True)["input_ids"])
    assert len({len(p) for p in out}) == len(out), "prompts should differ in length"
    return out


EOS = 2  # <|im_end|>: the GGUF's end-of-sequence token, where a chat turn ends


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompts):
    model, _ = smollm2_hf
    refs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=EOS)
        refs.append(ids[0, len(p):].tolist())
    return refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def greedy_tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def assert_all_blocks_released(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)


def test_greedy_matches_transformers_and_prefix_cache(prompts, reference):
    llm = LLM(device="cpu", cpu_weight_format="float32")
    assert llm.engine.config.schedule_policy == OFFLINE_SCHEDULE_POLICY  # offline: the longest outputs first
    assert greedy_tokens(llm, prompts) == reference
    assert_all_blocks_released(llm)
    hits_before = llm.engine.kv.prefix_hits
    # Same prompts again: every full block of each prompt is now served from the cache.
    assert greedy_tokens(llm, prompts) == reference
    assert llm.engine.kv.prefix_hits - hits_before >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert_all_blocks_released(llm)


def test_greedy_matches_with_small_prefill_chunks(prompts, reference):
    llm = LLM(device="cpu", cpu_weight_format="float32", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert greedy_tokens(llm, prompts) == reference
    assert_all_blocks_released(llm)


def test_greedy_matches_under_preemption(prompts, reference):
    # 12 blocks of 16 tokens cannot hold 8 sequences of up to ~70 tokens at once (and with the
    # prefix cache off, a preempted sequence really is recomputed from its tokens).
    llm = LLM(device="cpu", cpu_weight_format="float32", num_kv_blocks=12, enable_prefix_caching=False)
    assert greedy_tokens(llm, prompts) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_released(llm)


def test_greedy_matches_longest_output_first_with_prompts_finishing_one_a_step(prompts, reference):
    """Admitted by the most max_tokens (three at a time), a step's prompts joining only up to 8
    tokens past one that ends: each sequence still gives transformers' tokens, cut at its own
    max_tokens."""
    llm = LLM(device="cpu", cpu_weight_format="float32", max_num_seqs=3, schedule_policy="longest-output",
              prefill_join_tokens=8)
    lengths = [MAX_TOKENS - 3 * (i % 4) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ours == [ref[:n] for ref, n in zip(reference, lengths)]
    assert_all_blocks_released(llm)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", cpu_weight_format="float32")


def test_seeded_sampling_independent_of_batch(llm, prompts):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate([prompts[3]], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    mixed = llm.generate([prompts[0], prompts[3], prompts[5]], [others, p, others])[1].outputs[0].token_ids
    assert alone == mixed
    assert llm.generate([prompts[3]], SamplingParams(temperature=1.0, seed=99, max_tokens=12))[0].outputs[0].token_ids != alone


def test_stop_string_across_tokens(llm, prompts):
    full = llm.generate([prompts[1]], GREEDY)[0].outputs[0].text  # "The capital of France is Paris."
    stop = "of Fra"  # spans token boundaries
    assert stop in full
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_n_copies_share_prompt_blocks(llm, prompts):
    hits = llm.engine.kv.prefix_hits
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    out = llm.generate([prompts[7]], p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    full_blocks = (len(prompts[7]) - 1) // 16
    assert llm.engine.kv.prefix_hits - hits >= 2 * full_blocks * 16  # the two copies reused the prompt
    assert_all_blocks_released(llm)


def test_logprobs_equal_reference_log_softmax(llm, prompts, smollm2_hf):
    model, _ = smollm2_hf
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=5, logprobs=5))[0].outputs[0]
    ids = prompts[2] + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for i, (chosen, top) in enumerate(out.logprobs):
        row = ref[len(prompts[2]) - 1 + i]
        assert chosen.token_id == out.token_ids[i]
        assert chosen.logprob == pytest.approx(row[chosen.token_id].item(), abs=1e-3)
        want = torch.topk(row, 5)
        assert [t.token_id for t in top] == want.indices.tolist()
        assert [t.logprob for t in top] == pytest.approx(want.values.tolist(), abs=1e-3)


def test_final_only_requests_give_one_output_equal_to_the_streamed_final_one(llm, prompts):
    """LLM.generate's requests (final_only) build no output before they finish; the one they give
    holds what a streamed request's last output holds, with the whole text as its delta."""
    eng = llm.engine
    kinds = [(prompts[2], SamplingParams(temperature=0, max_tokens=9, logprobs=2)),
             (prompts[7], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6)),
             (prompts[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["of Fra"]))]
    outputs: dict[str, list] = {}
    for final_only in (False, True):
        for i, (prompt, p) in enumerate(kinds):
            eng.add_request(f"final-{final_only}-{i}", prompt, p, final_only=final_only)
        while eng.has_work():
            for out in eng.step():
                outputs.setdefault(out.request_id, []).append(out)
    for i in range(len(kinds)):
        streamed, final = outputs[f"final-False-{i}"], outputs[f"final-True-{i}"]
        assert len(final) == 1 and final[0].finished and len(streamed) > 1
        for s, f in zip(streamed[-1].outputs, final[0].outputs, strict=True):
            assert (f.text, f.token_ids, f.finish_reason, f.stop_reason) == (
                s.text, s.token_ids, s.finish_reason, s.stop_reason)
            # the second pass hits the prefix cache: the same tokens, logprobs to rounding
            assert (f.logprobs is None) == (s.logprobs is None)
            for (fc, ftop), (sc, stop) in zip(f.logprobs or [], s.logprobs or [], strict=True):
                assert [t.token_id for t in (fc, *ftop)] == [t.token_id for t in (sc, *stop)]
                assert [t.logprob for t in (fc, *ftop)] == pytest.approx([t.logprob for t in (sc, *stop)], abs=1e-4)
            assert f.text_delta == f.text and f.token_ids_delta == f.token_ids
    assert outputs["final-True-2"][0].outputs[0].finish_reason == "stop"
    assert_all_blocks_released(llm)


def test_final_only_output_waits_for_every_choice_even_one_ended_without_a_token(llm, prompts):
    """A final-only request of two choices, one ended because it outgrew the cache: no output
    until the other finishes, then one output with both, the whole text as each one's delta."""
    processor = OutputProcessor(llm.engine.tokenizer)
    params = SamplingParams(n=2, max_tokens=2)
    seqs = [Sequence("two", i, list(prompts[0]), params) for i in range(2)]
    processor.add("two", prompts[0], params, seqs, 0.0, final_only=True)
    hello, world = llm.engine.tokenizer.encode(" Hello world", add_special_tokens=False)[:2]
    assert processor.process([Accepted(seqs[0], hello, None, 1, False), Accepted(seqs[1], hello, None, 1, False)]
                             ) == ([], [])
    assert processor.end_without_token(seqs[0], "length") is None
    seqs[1].finish("length")
    (out,), _ = processor.process([Accepted(seqs[1], world, None, 2, True)])
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert [c.token_ids for c in out.outputs] == [[hello], [hello, world]]
    assert all(c.text_delta == c.text and c.text for c in out.outputs)
    assert "two" not in processor.requests


def test_abort_releases_blocks(llm, prompts):
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    for i in range(len(prompts)):
        eng.abort(f"abort-{i}")
    assert not eng.has_work()
    assert_all_blocks_released(llm)


def test_prompt_longer_than_context_is_refused(prompts):
    from kvship.sampling_params import InvalidParamsError

    small = LLM(device="cpu", cpu_weight_format="float32", max_model_len=32, num_kv_blocks=8)
    with pytest.raises(InvalidParamsError, match="maximum context length is 32"):
        small.generate([list(range(40))], GREEDY)
    out = small.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=100))[0].outputs[0]
    assert out.finish_reason == "length" and len(prompts[0]) + len(out.token_ids) == 32


def test_prompt_logprobs_equal_reference(llm, prompts, smollm2_hf):
    model, _ = smollm2_hf
    p = prompts[5]  # long enough to span several blocks; computed in small chunks too
    small_chunks = LLM(device="cpu", cpu_weight_format="float32", max_num_batched_tokens=16)
    for engine in (llm, small_chunks):
        out = engine.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
        assert len(out.prompt_logprobs) == len(p) - 1
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
        for i, (chosen, top) in enumerate(out.prompt_logprobs):
            assert chosen.token_id == p[i + 1]
            assert chosen.logprob == pytest.approx(ref[i, p[i + 1]].item(), abs=1e-3)
            assert [t.token_id for t in top] == torch.topk(ref[i], 3).indices.tolist()


def test_stop_token_ends_its_sequence_only(llm, prompts, reference):
    """A stop token is read a step after the next token was launched: that token is dropped,
    and the other sequences of the batch go on untouched."""
    stops = [ref[min(4, len(ref) - 1)] for ref in reference]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[t]) for t in stops]
    outs = llm.generate(prompts, params)
    for out, ref, stop in zip(outs, reference, stops):
        o = out.outputs[0]
        cut = ref.index(stop) + 1
        assert o.token_ids == ref[:cut]
        assert (o.finish_reason, o.stop_reason) == ("stop", stop)
    assert_all_blocks_released(llm)


def test_min_tokens_defers_the_stop_token(llm, prompts, reference):
    ref = reference[6]  # the story prompt: no eos within MAX_TOKENS
    stop, min_tokens = ref[2], 8
    out = llm.generate([prompts[6]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                                                    min_tokens=min_tokens))[0].outputs[0]
    later = [i for i, t in enumerate(ref) if t == stop and i + 1 >= min_tokens]
    want = ref[:later[0] + 1] if later else ref
    assert out.token_ids == want
    assert out.finish_reason == ("stop" if later else "length")


def test_repetition_penalty_matches_transformers(llm, prompts, smollm2_hf):
    """Penalties need the previous token's value before sampling: the engine reads it first."""
    model, _ = smollm2_hf
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3)
    outs = llm.generate(prompts[:4], [params] * 4)
    for p, out in zip(prompts[:4], outs):
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.3,
                                 eos_token_id=EOS, pad_token_id=EOS)
        assert out.outputs[0].token_ids == ids[0, len(p):].tolist()


def test_decode_inputs_come_from_the_device_and_are_aligned(llm, prompts):
    """After a prefill step the sampled tokens are not known on the host (the sequences hold
    only their prompts); the next step's inputs are filled from the device-side sample (by
    the in-flight inputs prepare names), and
    every packed input view starts on a 16-byte boundary (Triton specializes kernels on pointer
    alignment)."""
    eng = llm.engine
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"inputs-{i}", p, SamplingParams(temperature=0.0, max_tokens=4))
    eng.step()  # the three prompts, prefilled; their first tokens are still on the device
    step = eng.in_flight
    batch = eng.scheduler.schedule(step.rows)
    expected = [prompts[int(s.request_id[-1])] for s in batch.seqs]  # (admitted shortest first)
    assert len(batch) == 3 and [s.token_ids for s in batch.seqs] == expected  # the sampled tokens are in flight
    ids, pos, meta, in_flight = eng.runner.prepare(batch, step)
    assert ids.tolist() == [0, 0, 0]  # left for the device: a decode graph's staging or fill() writes them
    ids = in_flight.fill(ids)
    sampled = step.result().token_ids
    assert ids.tolist() == [sampled[step.rows[s]] for s in batch.seqs]
    assert pos.tolist() == [len(p) for p in expected]
    views = [ids, pos, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.logits_indices]
    assert all(t.data_ptr() % 16 == 0 for t in views)
    for i in range(3):
        eng.abort(f"inputs-{i}")
    assert_all_blocks_released(llm)


def test_mixed_step_lists_its_decodes_first(llm, prompts):
    """A step that admits prompts beside running decodes lists every one-token entry first (a
    one-token prompt too), each part in its order, and tells attention how many lead
    (meta.num_decodes): the GPU runs those through the decode kernel."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4)
    eng.add_request("mixed-0", prompts[0], params)
    eng.step()  # mixed-0 prefilled: a decode from now on
    eng.add_request("mixed-1", prompts[1], params)
    eng.add_request("mixed-2", prompts[2][:1], params)
    step = eng.in_flight
    batch = eng.scheduler.schedule(step.rows)
    assert [s.request_id for s in batch.seqs] == ["mixed-0", "mixed-2", "mixed-1"]
    assert batch.num_new_tokens[:2] == [1, 1] and batch.num_new_tokens[2] > 1 and batch.num_decodes == 2  # (less than
    # the prompt where an earlier test's blocks are cached)
    _, _, meta, _ = eng.runner.prepare(batch, step)
    assert meta.num_decodes == 2 and meta.cu_seqlens_q.tolist()[:3] == [0, 1, 2]
    for i in range(3):
        eng.abort(f"mixed-{i}")


def test_batch_decodes_first_is_stable():
    """One-token entries first, each part in its own order; a batch already in that order comes
    back as it is (no copy: most steps)."""
    seqs = [Sequence(f"s{i}", 0, [1, 2, 3], SamplingParams()) for i in range(6)]
    mixed = Batch(list(seqs), [5, 1, 7, 1, 1, 2])
    ordered = mixed.decodes_first()
    assert [s.request_id for s in ordered.seqs] == ["s1", "s3", "s4", "s0", "s2", "s5"]
    assert ordered.num_new_tokens == [1, 1, 1, 5, 7, 2] and ordered.num_decodes == 3
    assert mixed.num_decodes == 0 and ordered.num_tokens == mixed.num_tokens
    for already in (Batch(seqs[:3], [1, 1, 1]), Batch(seqs[:3], [1, 4, 2]), Batch(seqs[:2], [3, 2]), Batch()):
        assert already.decodes_first() is already


def test_start_up_prefills_of_each_query_tile_leave_the_engine_as_it_was(prompts, reference):
    """On a GPU, start-up prefills a prompt of each of PREFILL_TILE_LENGTHS into the cache's first
    blocks, so that each query tile the prefill kernel takes compiles before any request (a short
    chunk compiled one mid-serving, about a second). Run here on the CPU engine: no block is
    taken from the block manager, and greedy output afterwards still matches transformers."""
    from kvship.kernels import paged_attention as pa

    for cfg in pa.PREFILL_CONFIG.values():  # every tile a step can take is one start-up compiles
        tiles = {pa.prefill_block_m(cfg, n) for n in pa.PREFILL_TILE_LENGTHS}
        assert {pa.prefill_block_m(cfg, q) for q in range(1, 4097)} <= tiles
    llm = LLM(device="cpu", cpu_weight_format="float32")  # as start-up runs them: no block cached yet
    llm.engine.runner._compile_prefill_tiles()
    assert_all_blocks_released(llm)
    assert greedy_tokens(llm, prompts) == reference
