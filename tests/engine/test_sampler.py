import math

import pytest
import torch

from kvship.runner.sampler import Sampler, SamplerRow, apply_penalties, apply_top_k_top_p_min_p
from kvship.sampling_params import SamplingParams

V = 64


def row(prompt=(), output=(), gen=None, **kw) -> SamplerRow:
    params = SamplingParams(**kw)
    if params.seed is not None and gen is None:
        gen = torch.Generator().manual_seed(params.seed)
    return SamplerRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output), generator=gen)


def logits_for(seed: int, b: int = 1, v: int = V) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_greedy_is_argmax_for_any_float_dtype():
    logits = logits_for(0, b=5)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    out16 = Sampler()(logits.to(torch.bfloat16), [row(temperature=0.0) for _ in range(5)])
    assert out16.token_ids == logits.to(torch.bfloat16).float().argmax(-1).tolist()


def test_sampler_does_not_modify_logits():
    logits = logits_for(1, b=2)
    before = logits.clone()
    Sampler()(logits, [row(repetition_penalty=1.5, output=[1, 2], temperature=0.7, top_p=0.5),
                       row(temperature=0.0, frequency_penalty=1.0, output=[3])])
    assert torch.equal(logits, before)


def test_logprobs_match_log_softmax_of_raw_logits():
    logits = logits_for(2, b=3)
    rows = [
        row(temperature=0.0, logprobs=5, repetition_penalty=2.0, prompt=[0, 1, 2]),
        row(temperature=1.0, logprobs=0, seed=7),
        row(temperature=0.8, logprobs=20, top_k=3, seed=8),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, r in enumerate(rows):
        chosen, alts = out.logprobs[i]
        assert chosen.token_id == out.token_ids[i]
        assert math.isclose(chosen.logprob, ref[i, chosen.token_id].item(), rel_tol=1e-6, abs_tol=1e-6)
        assert len(alts) == r.params.logprobs
        vals = [a.logprob for a in alts]
        assert vals == sorted(vals, reverse=True)
        top = torch.topk(ref[i], r.params.logprobs)
        assert [a.token_id for a in alts] == top.indices.tolist()
        for a in alts:
            assert math.isclose(a.logprob, ref[i, a.token_id].item(), rel_tol=1e-6, abs_tol=1e-6)
    # the greedy row without penalties would have taken the top token; with logprobs it is
    # reported consistently even though the penalty changed the choice
    assert out.logprobs[0][1][0].token_id == ref[0].argmax().item()


def test_logprobs_only_for_rows_that_ask():
    logits = logits_for(3, b=3)
    out = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0, logprobs=2), row(temperature=0.0)])
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.logprobs[1] is not None


def test_top_k_1_equals_greedy():
    logits = logits_for(4, b=4)
    out = Sampler()(logits, [row(top_k=1, temperature=1.5) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_takes_argmax():
    logits = logits_for(5, b=4)
    for step in range(20):
        out = Sampler()(logits, [row(top_p=1e-6, temperature=2.0) for _ in range(4)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = logits_for(6, b=2)
    allowed = [set(torch.topk(logits[i], 3).indices.tolist()) for i in range(2)]
    torch.manual_seed(0)
    seen = [set(), set()]
    for _ in range(300):
        out = Sampler()(logits, [row(top_k=3, temperature=5.0), row(top_k=3, temperature=5.0)])
        for i in range(2):
            seen[i].add(out.token_ids[i])
    assert seen == allowed  # all three reachable at high temperature, nothing else


def test_top_p_keeps_smallest_covering_prefix():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    rows = [row(top_p=0.75), row(top_p=1.0)]
    masked = apply_top_k_top_p_min_p(logits.clone(), rows)
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    assert torch.equal(masked[1], logits[1])  # disabled row untouched


def test_min_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    logits = torch.log(probs)
    rows = [row(min_p=0.5), row(min_p=0.2), row(min_p=0.0)]
    masked = apply_top_k_top_p_min_p(logits.clone(), rows)
    # thresholds: 0.25 and 0.1 of the top probability (0.5)
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(masked[1]).tolist() == [True, True, True, False]
    assert torch.equal(masked[2], logits[2])
    torch.manual_seed(0)
    for _ in range(100):
        out = Sampler()(logits, rows)
        assert out.token_ids[0] in (0, 1) and out.token_ids[1] in (0, 1, 2)


def test_top_k_per_row_values():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 3)
    masked = apply_top_k_top_p_min_p(logits.clone(), [row(top_k=2), row(top_k=-1), row(top_k=3)])
    assert torch.isfinite(masked).tolist() == [[True, True, False, False], [True] * 4, [True, True, True, False]]


def _ref_repetition(logits, tokens, p):
    out = logits.clone()
    for t in set(tokens):
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    return out


def test_repetition_penalty_matches_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    rows = [row(prompt=[0, 1], output=[1, 3], repetition_penalty=2.0), row(prompt=[0, 1], output=[3])]
    got = apply_penalties(logits.clone(), rows)
    assert torch.allclose(got[0], _ref_repetition(logits[0], [0, 1, 1, 3], 2.0))
    assert torch.equal(got[1], logits[1])  # penalty 1.0: untouched
    # and a penalty < 1 encourages repeats
    got = apply_penalties(logits.clone(), [row(prompt=[2], output=[3], repetition_penalty=0.5)] * 2)
    assert torch.allclose(got[0], _ref_repetition(logits[0], [2, 3], 0.5))


def test_prompt_mask_cache_gives_same_result_and_follows_prompt_changes():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    sampler = Sampler()
    for prompt in ([1, 2, 3], [1, 2, 3], [4, 5], [4, 5, 9]):
        keyed = [SamplerRow(SamplingParams(repetition_penalty=1.7), prompt, [7], cache_key=("r", i)) for i in range(2)]
        plain = [row(prompt=prompt, output=[7], repetition_penalty=1.7) for _ in range(2)]
        got = apply_penalties(logits.clone(), keyed, sampler.prompt_cache)
        assert torch.equal(got, apply_penalties(logits.clone(), plain))
        assert torch.allclose(got[0], _ref_repetition(logits[0], prompt + [7], 1.7))
    assert len(sampler.prompt_cache._entries) == 2


def test_frequency_and_presence_penalties_match_reference():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    output = [1, 1, 1, 4, 6, 6]
    rows = [
        row(prompt=[2, 3], output=output, frequency_penalty=0.5),
        row(prompt=[2, 3], output=output, presence_penalty=-1.0),
        row(prompt=[2, 3], output=output, frequency_penalty=-0.3, presence_penalty=1.5, repetition_penalty=1.3),
    ]
    got = apply_penalties(logits.clone(), rows)

    def ref(lg, rep, freq, pres):
        lg = _ref_repetition(lg, [2, 3] + output, rep) if rep != 1.0 else lg.clone()
        for t in range(8):
            c = output.count(t)
            lg[t] -= freq * c + pres * (1.0 if c > 0 else 0.0)
        return lg

    assert torch.allclose(got[0], ref(logits[0], 1.0, 0.5, 0.0))
    assert torch.allclose(got[1], ref(logits[1], 1.0, 0.0, -1.0))
    assert torch.allclose(got[2], ref(logits[2], 1.3, -0.3, 1.5))


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    out = Sampler()(logits, [row(temperature=0.0, output=[0], frequency_penalty=1.0)])
    assert out.token_ids == [1]
    out = Sampler()(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=1.2)])
    assert out.token_ids == [1]


def _seeded_run(seed: int, batch: int, pos: int, steps: int, neighbour_seed: int) -> list[int]:
    """Runs `steps` steps of a seeded row at position `pos` in a batch of `batch` rows whose
    other rows are random (different per call through `neighbour_seed`). The seeded row's
    logits at step t are fixed by t alone; its penalties use its own growing output."""
    sampler = Sampler()
    gen = torch.Generator().manual_seed(seed)
    nb_gen = torch.Generator().manual_seed(neighbour_seed)
    own_out: list[int] = []
    tokens = []
    for t in range(steps):
        logits = torch.randn(batch, V, generator=nb_gen) * 3.0
        logits[pos] = logits_for(1000 + t)[0]
        rows = []
        for i in range(batch):
            if i == pos:
                rows.append(SamplerRow(SamplingParams(seed=seed, temperature=0.9, top_p=0.95, top_k=40,
                                                      presence_penalty=0.3),
                                       [1, 2, 3], list(own_out), gen))
            elif i % 3 == 0:
                rows.append(row(temperature=0.0))
            elif i % 3 == 1:
                rows.append(row(temperature=1.3, top_k=5))
            else:
                rows.append(row(seed=neighbour_seed + i, temperature=0.7))
        out = sampler(logits, rows)
        own_out.append(out.token_ids[pos])
        tokens.append(out.token_ids[pos])
    return tokens


def test_seeded_rows_independent_of_batch_composition():
    steps = 40
    ref = _seeded_run(seed=1234, batch=1, pos=0, steps=steps, neighbour_seed=0)
    torch.manual_seed(99)  # the default RNG's state must not matter either
    assert _seeded_run(seed=1234, batch=3, pos=1, steps=steps, neighbour_seed=1) == ref
    torch.manual_seed(5)
    assert _seeded_run(seed=1234, batch=7, pos=6, steps=steps, neighbour_seed=2) == ref
    assert _seeded_run(seed=1234, batch=7, pos=0, steps=steps, neighbour_seed=3) == ref
    other = _seeded_run(seed=4321, batch=3, pos=2, steps=steps, neighbour_seed=4)
    assert other != ref
    assert len(set(ref)) > 3  # actually sampling, not collapsing to one token


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.25]])
    temp = 0.7
    expected = torch.softmax(logits[0] / temp, dim=-1)
    n = 4000
    batch = 100
    sampler = Sampler()
    torch.manual_seed(0)  # unseeded rows: one batched draw from the default RNG
    counts = torch.zeros(8)
    for _ in range(n // batch):
        out = sampler(logits.expand(batch, -1), [row(temperature=temp) for _ in range(batch)])
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=8).float()
    exp_counts = expected * n
    chi2 = (((counts - exp_counts) ** 2) / exp_counts).sum().item()
    # 7 degrees of freedom: the 99.9% quantile is about 24.3
    assert chi2 < 24.3, (chi2, counts, exp_counts)

    # the same through seeded rows' own generators
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(8)
    for _ in range(n):
        out = sampler(logits, [SamplerRow(SamplingParams(temperature=temp, seed=11), [], [], gen)])
        counts[out.token_ids[0]] += 1
    chi2 = (((counts - exp_counts) ** 2) / exp_counts).sum().item()
    assert chi2 < 24.3, (chi2, counts, exp_counts)


def test_mixed_greedy_and_sampling_rows():
    logits = logits_for(7, b=4)
    rows = [row(temperature=0.0), row(temperature=1.0, seed=3), row(top_k=1), row(temperature=1.0)]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()


def test_empty_batch_and_shape_check():
    assert Sampler()(torch.zeros(0, V), []).token_ids == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), [row()])


@pytest.mark.gpu
def test_cuda_matches_cpu_for_greedy_and_seeded_rows_are_batch_invariant():
    logits = logits_for(8, b=4)
    rows = [row(temperature=0.0, logprobs=3, repetition_penalty=1.3, prompt=[1, 2])] * 4
    cpu = Sampler()(logits, rows)
    gpu = Sampler()(logits.cuda(), rows)
    assert cpu.token_ids == gpu.token_ids
    for (c, ca), (g, ga) in zip(cpu.logprobs, gpu.logprobs):
        assert c.token_id == g.token_id and abs(c.logprob - g.logprob) < 1e-4
        assert [a.token_id for a in ca] == [a.token_id for a in ga]

    def run(batch: int, pos: int, vocab: int = 32000) -> list[int]:
        gen = torch.Generator(device="cuda").manual_seed(77)
        nb = torch.Generator(device="cuda").manual_seed(batch)
        out_tokens: list[int] = []
        for t in range(30):
            lg = torch.randn(batch, vocab, device="cuda", generator=nb)
            lg[pos] = torch.randn(vocab, generator=torch.Generator().manual_seed(t)).cuda() * 3
            rs = [row(temperature=1.2) if i % 2 else row(temperature=0.0) for i in range(batch)]
            rs[pos] = SamplerRow(SamplingParams(seed=77, top_p=0.9, top_k=50, min_p=0.01, frequency_penalty=0.2),
                                 [5, 6], list(out_tokens), gen)
            out_tokens.append(Sampler()(lg.to(torch.bfloat16), rs).token_ids[pos])
        return out_tokens

    ref = run(1, 0)
    assert run(3, 1) == ref
    assert run(7, 6) == ref
    assert len(set(ref)) > 3


def test_logit_bias_matches_adding_it_to_the_logits():
    from kvship.runner.sampler import apply_logit_bias

    logits = logits_for(11, b=3)
    rows = [row(logit_bias={5: 3.5, 7: -100.0}), row(), row(logit_bias={0: 100.0, V + 3: 50.0})]  # V+3: dropped
    want = logits.clone()
    want[0, 5] += 3.5
    want[0, 7] -= 100.0
    want[2, 0] += 100.0
    assert torch.equal(apply_logit_bias(logits, rows), want)
    assert apply_logit_bias(logits, [row(), row(), row()]) is logits


def test_logit_bias_bans_and_forces_tokens_greedy_and_sampled():
    logits = logits_for(12, b=4)
    top = logits.argmax(-1).tolist()
    rows = [row(temperature=0.0, logit_bias={top[0]: -100.0}),
            row(temperature=0.0, logit_bias={9: 100.0}),
            row(temperature=0.9, seed=1, logit_bias={top[2]: -100.0}),
            row(temperature=0.9, seed=2, logit_bias={9: 100.0})]
    out = Sampler()(logits, rows)
    masked = logits.clone()
    masked[0, top[0]] = float("-inf")
    assert out.token_ids[0] == masked[0].argmax().item() and out.token_ids[1] == 9
    assert out.token_ids[2] != top[2] and out.token_ids[3] == 9
    assert torch.equal(logits, logits_for(12, b=4))  # the caller's logits are left alone


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101.0}, {1: float("nan")}, {-1: 1.0}])
def test_logit_bias_out_of_range_is_refused(bias):
    from kvship.sampling_params import InvalidParamsError

    with pytest.raises(InvalidParamsError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"
