"""The engine with a quantized KV cache on the bundled SmolLM2-135M (CPU reference path, float32
weights, as the figures below were measured):
perplexity against the unquantized cache (float32 on CPU), greedy agreement, and prefix-cache
hits and preemption that leave outputs unchanged.

The perplexity texts are license files shipped in pinned wheels, the same bytes on every
machine: the Apache License 2.0 of transformers (5.17.0, the test extra) and numpy's LICENSE.txt
(2.3.5, a runtime pin: its own BSD license, then the licenses of the libraries it bundles), in
windows of PPL_TOKENS tokens. One window is not enough: a prompt's attention reads its own keys
and values back from the quantized cache, so one int4 code that rounds the other way (the CPU's
vector width changes the last bits of fp32 sums) changes every later layer's inputs, and the
first window alone measured int4 at +1.0% on one machine and +5.0% on another. Over the six
windows the same machines agree within 0.6%.
"""
import importlib.metadata
import math

import pytest
import torch

from kvship.kernels import kv_quant as kvq
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from test_engine import MAX_TOKENS, assert_all_blocks_released, greedy_tokens, prompts  # noqa: F401 (fixture)

KV_DTYPES = ["auto", "fp8", "int4"]
PPL_TOKENS = 1024
PPL_TEXTS = [("transformers", "licenses/LICENSE", 2), ("numpy", "LICENSE.txt", 4)]  # wheel, file, windows
# Enough blocks for the perplexity text and the eight prompts, far below the CPU default (1 GiB).
NUM_BLOCKS = 160
# Logprob gap between a greedy step's top two tokens that rounding may swap. With an FP8 cache a
# code that rounds the other way moves every later layer's inputs, so the swaps are not all at
# ties: under preemption, gaps of 0.115 to 0.243 on three CPU vector widths (2026-12-02); a bug
# (wrong positions or blocks on recompute) moves logits by whole nats.
NEAR_TIE = 0.5
# The same against the unquantized cache's greedy tokens (test_fp8_greedy_agrees_with_unquantized).
FLIP_GAP = 1.0


@pytest.fixture(scope="module")
def engines():
    # Whole prompts in one step, as the expectations below were measured (the CPU's small default
    # budget, or a join size below the prompts, cuts them into chunks whose later ones read earlier
    # keys back quantized: the chunked case has its own test).
    return {kv: LLM(device="cpu", cpu_weight_format="float32", kv_cache_dtype=kv, num_kv_blocks=NUM_BLOCKS,
                    max_num_batched_tokens=8192, prefill_join_tokens=8192) for kv in KV_DTYPES}


@pytest.fixture(scope="module")
def text_windows(engines) -> dict[str, list[int]]:
    """PPL_TEXTS as windows of PPL_TOKENS tokens, named by wheel and window."""
    windows = {}
    for dist, path, count in PPL_TEXTS:
        text = importlib.metadata.distribution(dist).read_text(path)
        assert text and "license" in text.lower()
        ids = engines["auto"].engine.tokenizer.encode(text)
        assert len(ids) >= count * PPL_TOKENS
        windows.update({f"{dist}[{i}]": ids[i * PPL_TOKENS:(i + 1) * PPL_TOKENS] for i in range(count)})
    return windows


@pytest.fixture(scope="module")
def greedy(engines, prompts):  # noqa: F811
    return {kv: greedy_tokens(llm, prompts) for kv, llm in engines.items()}


def mean_nll(llm, ids) -> float:
    """The prompt's mean negative log-likelihood per token (its log perplexity)."""
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [chosen.logprob for chosen, _ in out.prompt_logprobs]
    assert len(logprobs) == len(ids) - 1
    return -sum(logprobs) / len(logprobs)


@pytest.mark.timeout(900)
def test_perplexity_close_to_unquantized(engines, text_windows, record_property):
    """Perplexity over every window (the mean of their log perplexities), each window's beside it.
    The issue asks fp8 within 1% of auto and int4 within 5%. fp8, with the scales the engine
    measures per layer at start-up: +0.25% (2026-12-03; with scales 1.0 it measured +1.09 to
    +1.37% on three CPU vector widths), asserted at the issue's 1%. int4, keys per channel over
    each block (KIVI's layout): PPL_INT4 (docs/kv-cache.md; in groups of 32 channels of a token
    they cost +10.5 to +11.1%, +5.45% smoothed at start-up), asserted at the issue's 5%."""
    nll = {kv: {w: mean_nll(llm, ids) for w, ids in text_windows.items()} for kv, llm in engines.items()}
    ppl = {kv: math.exp(sum(per.values()) / len(per)) for kv, per in nll.items()}
    windows = "; ".join(f"{w} " + " ".join(f"{kv} {100 * (math.exp(nll[kv][w] - nll['auto'][w]) - 1):+.1f}%"
                                            for kv in ("fp8", "int4")) for w in text_windows)
    report = ", ".join(f"{kv} {p:.4f} ({100 * (p / ppl['auto'] - 1):+.2f}%)" for kv, p in ppl.items())
    record_property(f"SmolLM2-135M perplexity over {len(text_windows)} windows of {PPL_TOKENS} tokens",
                    f"{report}; by window: {windows}")
    # a quantized cache costs a little: between the float cache's and these bounds
    assert ppl["auto"] * 0.995 <= ppl["fp8"] <= ppl["auto"] * 1.01
    assert ppl["auto"] * 0.999 <= ppl["int4"] <= ppl["auto"] * 1.05
    for llm in engines.values():
        assert_all_blocks_released(llm)


def fp8_scales(llm) -> list[tuple[float, float]]:
    return [(float(a.fp8_k_scale), float(a.fp8_v_scale)) for a in llm.engine.runner.model.attention_layers()]


@pytest.mark.timeout(300)
def test_fp8_scales_measured_per_layer_at_start_up(engines, text_windows, record_property):
    """Without a checkpoint's scales, each layer's FP8 scales are measured at start-up on random
    tokens, with FP8_HEADROOM. Against --calculate-kv-scales on a text window (the text's own
    largest magnitudes), no layer's keys or values saturate, and none sit more than the headroom
    again below the start-up range (where small values would fall into the subnormals). The
    values' scales spread over layers: one scale for all of them costs perplexity (kv_quant)."""
    fmax = kvq.fp8_max(torch.float8_e4m3fn)
    start = fp8_scales(engines["fp8"])
    calc = LLM(device="cpu", cpu_weight_format="float32", kv_cache_dtype="fp8", num_kv_blocks=NUM_BLOCKS, calculate_kv_scales=True)
    assert fp8_scales(calc) == [(1.0, 1.0)] * len(start)  # not measured before the first prefill
    mean_nll(calc, text_windows["numpy[0]"])
    text = fp8_scales(calc)
    ratios = []
    for (ks, vs), (kt, vt) in zip(start, text):
        for s, measured in ((ks, kt), (vs, vt)):
            amax = measured * fmax / kvq.FP8_HEADROOM  # the text's largest magnitude in this layer
            ratios.append(amax / (s * fmax / kvq.FP8_HEADROOM))
            assert amax <= s * fmax  # fits: no saturation
            assert amax * kvq.FP8_HEADROOM >= s * fmax / kvq.FP8_HEADROOM
    record_property("text amax / start-up amax per layer and k/v", f"{min(ratios):.2f} to {max(ratios):.2f}")
    v = [vs for _, vs in start]
    assert max(v) > 4 * min(v), v


@pytest.mark.timeout(300)
def test_checkpoint_fp8_scales_come_first(tiny_models, tmp_path, caplog):
    """A checkpoint's k_scale / v_scale (vLLM's names) are used as they are; only the layers
    without them are measured at start-up, with a warning that names how many."""
    from safetensors.torch import load_file, save_file

    folder, _ = tiny_models["llama-gqa-tied"]
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="kvship.runner.model_runner"):
        llm = LLM(model=str(tmp_path), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16)
    assert [r.levelname for r in caplog.records if "no k/v scales in the checkpoint for 1 layers" in r.message] \
        == ["WARNING"], caplog.text
    (k0, v0), (k1, v1) = fp8_scales(llm)
    assert (k0, v0) == (0.5, 0.25)
    assert 0 < k1 != 1.0 and 0 < v1 != 1.0 and (k1, v1) != (0.5, 0.25)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_chunked_prefill_over_a_quantized_cache(tiny_models, kv):
    """Prompts prefilled in chunks (blocks of 4 tokens) against the same prompts whole, over the
    same quantized cache. FP8 stores each token alone: the same logits. int4 keys share a range
    per block and channel: chunks on block boundaries give the whole prompt's logits; a block
    filled over two chunks has its held codes re-quantized to the widened range, which moves the
    logits by less than half of what the int4 cache itself moves them from the 16-bit one
    (measured 0.0074 against 0.039)."""
    from test_models import our_logits

    folder = tiny_models["qwen3-qknorm"][0]
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 319, (n,), generator=g).tolist() for n in (9, 30)]
    whole = our_logits(folder, ids, kv_cache_dtype=kv)
    gap = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))  # noqa: E731
    aligned, straddling = (our_logits(folder, ids, chunk=c, kv_cache_dtype=kv) for c in (8, 5))
    assert gap(aligned, whole) < 1e-3 if kv == "int4" else gap(aligned, whole) < 1e-5
    if kv == "fp8":
        assert gap(straddling, whole) < 1e-5
    else:
        assert 0 < gap(straddling, whole) < 0.5 * gap(whole, our_logits(folder, ids))


def test_kv_measurements_do_not_follow_the_sampling_seed(tiny_models):
    """The start-up measurement (FP8 scales) comes from tokens of a fixed seed: engines started
    with different --seed values quantize their caches alike."""
    folder, _ = tiny_models["llama-gqa-tied"]
    by_seed = []
    for seed in (0, 7):
        llm = LLM(model=str(folder), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16, seed=seed)
        by_seed.append([a.fp8_k_scale.clone() for a in llm.engine.runner.model.attention_layers()])
    assert not torch.equal(by_seed[0][0], torch.ones(1)), "nothing was measured"
    assert all(torch.equal(a, b) for a, b in zip(*by_seed))


def first_difference_gaps(reference, outputs: list[list[int]]) -> list[float]:
    """Where each output first leaves the reference's greedy tokens: the reference's logprob
    gap there between its own token and the output's (inf when the output's is not in its top
    alternatives). reference: CompletionOutputs with logprobs."""
    gaps = []
    for ref, got in zip(reference, outputs):
        i = next((i for i, (x, y) in enumerate(zip(got, ref.token_ids)) if x != y), None)
        if i is not None:
            chosen, alts = ref.logprobs[i]
            gaps.append(chosen.logprob - next((a.logprob for a in alts if a.token_id == got[i]), float("-inf")))
    return gaps


@pytest.mark.timeout(900)
def test_fp8_greedy_agrees_with_unquantized(engines, greedy, prompts, record_property):  # noqa: F811
    """Greedy outputs of 20 tokens against the unquantized cache's, and where they first differ.
    How many are identical measures how often SmolLM2's continuations hold a near-tie more than
    it measures the cache: on 48 prompts of license text (24 tokens) 15 were identical with the
    engine's FP8 scales and 19 with scales 1.0, whose perplexity costs 13x more (docs/kv-cache.md),
    and of these eight prompts 3 and 6. So the count is reported, and what is asserted is that
    every FP8 difference starts where the unquantized model's top two tokens were close: its
    largest gap was 0.57 here and 0.49 on the 48 prompts (1.10 with scales 1.0); a wrong scale or
    block moves logits by whole nats."""
    auto = greedy["auto"]
    same = {kv: sum(a == b for a, b in zip(greedy[kv], auto)) for kv in ("fp8", "int4")}
    agreed = {kv: sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(greedy[kv], auto)) for kv in same}
    reference = [o.outputs[0] for o in engines["auto"].generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=20))]
    assert [r.token_ids for r in reference] == auto
    gaps = {kv: first_difference_gaps(reference, greedy[kv]) for kv in same}
    report = ", ".join(f"{kv} {same[kv]}/{len(auto)} ({agreed[kv]} of {sum(map(len, auto))} tokens before the "
                       f"first difference; logprob gaps there {sorted(round(g, 3) for g in gaps[kv])})" for kv in same)
    record_property("greedy outputs (20 tokens) identical to the unquantized cache's", report)
    assert all(g <= FLIP_GAP for g in gaps["fp8"]), gaps["fp8"]
    # int4 is reported, not asserted: its rounding moves near-ties more often


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_prefix_hits_and_preemption_change_nothing(kv, engines, greedy, prompts, record_property):  # noqa: F811
    """Prompts served again (every full block from the prefix cache) give the quantized
    engine's own first outputs. Under forced preemption a sequence's generated tokens are
    recomputed in a prefill instead of one by one: the fp32 sums round differently, which a
    float cache absorbs (tests/engine/test_engine.py) but a quantized one may not, when a value sits on
    a rounding boundary; so an FP8 output must equal its first one or leave it only where the
    two candidates were a near-tie (within NEAR_TIE in logprob), and most must equal it."""
    llm = engines[kv]
    hits_before = llm.engine.kv.prefix_hits
    again = greedy_tokens(llm, prompts)
    if kv == "fp8":
        assert again == greedy[kv]
    else:  # int4: a prefix hit recomputes only the prompt's tail, whose fp32 sums then round
        # differently, and a 4-bit code on a rounding boundary flips (CI, 2026-12-04: 7/8 identical)
        same = sum(a == b for a, b in zip(again, greedy[kv]))
        record_property("identical when served again from the prefix cache", f"{same}/{len(prompts)}")
        assert same >= len(prompts) - 2
    assert llm.engine.kv.prefix_hits - hits_before >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert_all_blocks_released(llm)
    # every prompt admitted in one step (the CPU's small default budget would admit them a few at a
    # time), so that their decodes outgrow the 12 blocks and force preemption
    tight = LLM(device="cpu", cpu_weight_format="float32", kv_cache_dtype=kv, num_kv_blocks=12,
                enable_prefix_caching=False, max_num_batched_tokens=8192, prefill_join_tokens=8192)
    # 20 alternatives: the first run's token may fall to third or lower at a close call (with 2,
    # one AVX2 run found it in neither and could not tell its gap)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=20)
    outs = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert_all_blocks_released(tight)
    gaps = first_difference_gaps(outs, greedy[kv])  # this run's logprobs: how far the first run's token fell
    record_property("identical under preemption", f"{len(outs) - len(gaps)}/{len(outs)}; logprob gaps at the first "
                    f"difference: {[round(g, 3) for g in gaps]}")
    if kv == "fp8":
        assert all(g <= NEAR_TIE for g in gaps) and len(gaps) * 2 < len(outs)
    else:  # int4: a code is 1/15 of its group's range, and a group's minimum and maximum move with
        # every element, so the same rounding noise moves more (measured: 4/8 and 5/8 identical, one
        # first difference outside the top two, gaps up to 0.22); a wrong recompute moves whole nats
        assert all(g <= FLIP_GAP for g in gaps) and len(gaps) <= len(outs) - 2, gaps


# ----------------------------------------------------------------------------- GPU (skipped on CPU)

def measured_kv_scales(llm, kv: str) -> list[torch.Tensor]:
    """Each layer's measured FP8 scales (k, v), on the CPU (none for int4: its scales are each
    block's own)."""
    if kv == "int4":
        return []
    return [torch.cat([a.fp8_k_scale, a.fp8_v_scale]).cpu() for a in llm.engine.runner.model.attention_layers()]


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kv,calculate", [("fp8", False), ("fp8", True), ("fp8_e5m2", False), ("int4", False)])
def test_gpu_kernels_and_graphs_agree_with_reference(kv, calculate, tiny_models, record_property):
    """A tiny Llama (head size 16) on the GPU in float32: Triton kernels and CUDA graphs
    against the torch reference path over the same quantized cache (greedy tokens; a random
    model's near-ties may flip one or two), with the same FP8 scales measured (at start-up, or
    by --calculate-kv-scales on the first prefill, before any graph replays)."""
    from test_gpu_engine import prompts as random_prompts

    folder, _ = tiny_models["llama-gqa-tied"]
    common = dict(model=str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64,
                  kv_cache_dtype=kv, calculate_kv_scales=calculate)
    ps = random_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fast = LLM(**common)
    assert fast.engine.runner.graphs is not None
    got = [o.outputs[0].token_ids for o in fast.generate(ps, params)]
    scales = measured_kv_scales(fast, kv)
    assert not fast.engine.runner.measuring_kv_scales
    del fast
    ref = LLM(**common, attention_backend="torch", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in ref.generate(ps, params)]
    same = sum(a == b for a, b in zip(got, want))
    record_property("greedy outputs identical, Triton vs torch", f"{same}/{len(want)}")
    assert same >= len(want) - 2
    # measured on the same tokens (random ones at start-up, or the first prefill): the same but for
    # the paths' rounding, which reaches later layers' keys through the quantized cache
    assert not any(torch.equal(s, torch.ones_like(s)) for s in scales)
    for a, b in zip(scales, measured_kv_scales(ref, kv)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()))
