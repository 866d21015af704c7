"""Speculative decoding: before a step, each running decode gets up to k proposed tokens (from
n-gram lookup or a draft model); the step computes them as one k + 1 token query each, beside
the other sequences (runner/rejection.py keeps what the target model would have sampled), and
the KV of the rejected positions is given back. The engine runs such steps synchronously: a
proposal needs the tokens the step before produced.

Sequences under a grammar, and any step with more running sequences than
``disable_by_batch_size``, decode without proposals.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

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
        a grammar constrains it or it is not decoding."""
        if seq.grammar is not None or seq.num_tokens - seq.num_computed_tokens != 1:
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
            seq.draft_token_ids = list(draft)
        return [s for s in seqs if s.draft_token_ids]

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


def roll_back(kv: KVCacheManager, seq: Sequence, num_accepted: int) -> None:
    """After a verify, before its tokens join seq: the KV computed is the step's input and the
    accepted proposals' (the token sampled after them is the next step's input); the blocks
    past them held rejected positions."""
    seq.num_computed_tokens = seq.num_tokens + num_accepted
    kv.drop_tail(seq)


def build_speculator(config: SpeculativeConfig, engine_config, model_config, target_tokenizer,
                     num_blocks: int) -> Speculator:
    """The speculator the config asks for, or a ValueError saying why it cannot be served."""
    if model_config.linear_attention is not None:
        raise ValueError(f"speculative decoding is not available for {model_config.architecture}: its recurrent "
                         "state cannot be rolled back past rejected tokens")
    if engine_config.tensor_parallel_size > 1 and config.method != "ngram":
        raise ValueError("a draft model runs with --tensor-parallel-size 1 only")
    if config.method == "ngram":
        proposer = NgramDrafts(config)
    elif config.method == "draft_model":
        from kvship.core.draft_model import DraftModelDrafts  # loads a second model: only when asked

        proposer = DraftModelDrafts(config, engine_config, model_config, target_tokenizer, num_blocks)
    else:  # SpeculativeConfig.parse refuses mtp
        raise ValueError(f"speculative_config method {config.method!r} is not served")
    log.info("speculative decoding: %s, %d tokens a step, off above %d running sequences", config.method,
             config.num_speculative_tokens, config.disable_by_batch_size)
    return Speculator(config, proposer, engine_config.max_model_len)
