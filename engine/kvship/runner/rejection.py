"""Verifying proposed tokens against the target model's logits, exactly.

Each proposal d_j of a sequence gets its own logits row (the verify forward computed the
sequence's k + 1 positions at once), and every row is sampled as plain decoding samples it:
the same penalties (counting the proposals before it as output), bias, temperature and
truncation, and the exponential race argmax(p / E) with fresh noise E. Proposals are accepted
while the sampled token equals them; the first row that differs gives the sequence's next
token, and when all match the row after the last one gives a bonus token.

This is rejection sampling for a deterministic proposal (q one-hot at d): the race picks d
with probability p(d) (accept), and, given that it did not, token i with p(i) / (1 - p(d)),
the normalised residual max(p - q, 0). Greedy rows reduce to argmax matching. A seeded
sequence's generator is wound back to where plain decoding would leave it (one draw a token
kept), so that a seed gives the same tokens with speculation as without.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvship.runner.sampler import Sampler, SamplerRow
from kvship.sequence import Sequence


@dataclass
class Verified:
    """One sequence's outcome: the tokens it keeps (its accepted proposals, then the token
    sampled after them) with their logprobs, and how many proposals were accepted."""

    token_ids: list[int]
    logprobs: list
    num_accepted: int


def verification_rows(seqs: list[Sequence]) -> list[SamplerRow]:
    """One sampling row per logits row: a sequence's len(draft_token_ids) + 1 rows in order."""
    rows = []
    for s in seqs:
        for j in range(len(s.draft_token_ids) + 1):
            if s.params.uses_penalties:
                rows.append(SamplerRow(s.params, s.prompt_token_ids, s.output_token_ids + s.draft_token_ids[:j],
                                       s.generator, (s.request_id, s.index)))
            else:
                rows.append(SamplerRow(s.params, (), (), s.generator))
    return rows


def sample_and_verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence],
                      allowed: torch.Tensor | None = None) -> list[Verified]:
    """``logits``: the verify forward's rows (verification_rows' order); ``allowed``: a grammar
    bitmask a row (sequences under a grammar propose nothing)."""
    winds = [(s.generator, s.generator.get_state()) if _draws_noise(s) and s.draft_token_ids else None
             for s in seqs]
    result = sampler.launch(logits, verification_rows(seqs), allowed).result()
    out, i = [], 0
    for seq, wind in zip(seqs, winds):
        drafts = seq.draft_token_ids
        tokens = result.token_ids[i:i + len(drafts) + 1]
        a = 0
        while a < len(drafts) and tokens[a] == drafts[a]:
            a += 1
        if wind is not None and a < len(drafts):
            _rewind(*wind, draws=a + 1, vocab=logits.shape[1], device=logits.device)
        out.append(Verified(tokens[:a + 1], result.logprobs[i:i + a + 1], a))
        i += len(drafts) + 1
    return out


def _draws_noise(seq: Sequence) -> bool:
    return seq.generator is not None and not seq.params.greedy


def _rewind(generator: torch.Generator, state: torch.Tensor, draws: int, vocab: int, device: torch.device) -> None:
    """Leave ``generator`` as ``draws`` of the sampler's per-row noise draws leave it."""
    generator.set_state(state)
    scratch = torch.empty(vocab, dtype=torch.float32, device=device)
    for _ in range(draws):
        scratch.exponential_(generator=generator)
