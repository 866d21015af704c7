"""Speculative decoding: before a step, each running decode gets up to k proposed tokens (from
n-gram lookup or a draft model); the step computes them as one k + 1 token query each, beside
the other sequences (runner/rejection.py keeps what the target model would have sampled), and
the KV of the rejected positions is given back. The engine runs such steps synchronously: a
proposal needs the tokens the step before produced.

A sequence under a grammar keeps only the proposals its grammar accepts, and each of its verify
rows is masked with what the grammar allows after the proposals before it. A step with more
running sequences than ``disable_by_batch_size`` decodes without proposals.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvship.core.kv_cache_manager import KVCacheManager
from kvship.core.ngram import NgramProposer
from kvship.runner.rejection import Verified
from kvship.sequence import Sequence
from kvship.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: verify passes with proposals, proposed tokens, accepted
    tokens, and accepted tokens by position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer  # .propose(seqs, ks) -> proposals, each at most its k long
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def active(self, num_running: int) -> bool:
        return 0 < num_running <= self.config.disable_by_batch_size

    def room(self, seq: Sequence) -> int:
        """How many tokens seq may propose: k, fewer near max_tokens or the context's end (the
        verify yields up to one token more than it proposes, and never overshoots), none when
        it is not decoding."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or (seq.grammar is not None and seq.grammar.is_terminated()):
            return 0
        room = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, room)

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Set draft_token_ids on the running decodes; returns those that got some."""
        seqs, ks = [], []
        for seq in running:
            k = self.room(seq)
            if k:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return []
        for seq, draft in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.draft_token_ids = list(draft) if seq.grammar is None else _grammatical(seq.grammar, draft)
        return [s for s in seqs if s.draft_token_ids]

    def observe(self, layout: list[tuple[Sequence, int, int]]) -> None:
        """After a step's tokens are kept (``step_layout`` of its batch): an MTP proposer takes
        the target's hidden states of the kept positions."""
        if hasattr(self.proposer, "observe"):
            self.proposer.observe(layout)

    def forget(self, seqs: list[Sequence]) -> None:
        """Sequences that ended: a draft model frees what it kept for them."""
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(seqs)

    def release(self) -> None:
        """Give back a draft model's device memory (LLMEngine.shutdown)."""
        if hasattr(self.proposer, "release"):
            self.proposer.release()

    def record(self, verified: list[tuple[int, Verified]]) -> None:
        """Count each sequence's (number proposed, outcome) of one verify."""
        s = self.stats
        for proposed, v in verified:
            if proposed:
                s.num_drafts += 1
                s.num_draft_tokens += proposed
                s.num_accepted_tokens += v.num_accepted
                for j in range(v.num_accepted):
                    s.accepted_per_pos[j] += 1


class NgramDrafts:
    def __init__(self, config: SpeculativeConfig):
        self.lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.lookup.propose(s.token_ids, k) for s, k in zip(seqs, ks)]


def _grammatical(matcher, draft: list[int]) -> list[int]:
    """The proposals up to the first one the grammar refuses (the matcher is left as it was)."""
    n = 0
    while n < len(draft) and not matcher.is_terminated() and matcher.accept_token(draft[n]):
        n += 1
    if n:
        matcher.rollback(n)
    return list(draft[:n])


def grammar_bitmask(grammars, seqs: list[Sequence]) -> torch.Tensor:
    """The verify's token bitmask, a row per logits row: a constrained sequence's row j allows
    what its grammar allows after its first j proposals (its matcher walks them, then steps
    back: the engine accepts the kept tokens into it); other rows allow everything."""
    parts: list[torch.Tensor | int] = []  # masks, or a count of unconstrained rows
    for seq in seqs:
        drafts, m = seq.draft_token_ids, seq.grammar
        if m is None:
            parts.append(len(drafts) + 1)
            continue
        for j in range(len(drafts) + 1):
            parts.append(grammars.bitmask([m]))
            if j < len(drafts):
                m.accept_token(drafts[j])  # accepted when proposed (_grammatical)
        if drafts:
            m.rollback(len(drafts))
    words = next(p.shape[1] for p in parts if isinstance(p, torch.Tensor))
    return torch.cat([p if isinstance(p, torch.Tensor) else torch.full((p, words), -1, dtype=torch.int32)
                      for p in parts])


def step_layout(batch) -> list[tuple[Sequence, int, int]]:
    """Each sequence of a batch about to run with its first position and its rows (a decode's
    count its proposals), for Speculator.observe."""
    return [(s, s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def roll_back(kv: KVCacheManager, seq: Sequence, num_accepted: int) -> None:
    """After a verify, before its tokens join seq: the KV computed is the step's input and the
    accepted proposals' (the token sampled after them is the next step's input); the blocks
    past them held rejected positions."""
    seq.num_computed_tokens = seq.num_tokens + num_accepted
    kv.drop_tail(seq)


def build_speculator(config: SpeculativeConfig, engine_config, model_config, target_tokenizer,
                     runner) -> Speculator:
    """The speculator the config asks for, or a ValueError saying why it cannot be served."""
    if engine_config.tensor_parallel_size > 1 and config.method != "ngram":
        raise ValueError("draft-model and MTP proposals run with --tensor-parallel-size 1 only")
    if config.method == "ngram":
        proposer = NgramDrafts(config)
    elif config.method == "draft_model":
        from kvship.core.draft_model import DraftModelDrafts  # loads a second model: only when asked

        proposer = DraftModelDrafts(config, engine_config, model_config, target_tokenizer, runner.num_blocks)
    else:
        from kvship.core.mtp import MTPDrafts

        proposer = MTPDrafts(runner, engine_config.block_size)
    log.info("speculative decoding: %s, %d tokens a step, off above %d running sequences", config.method,
             config.num_speculative_tokens, config.disable_by_batch_size)
    return Speculator(config, proposer, engine_config.max_model_len)
