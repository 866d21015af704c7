"""Draft-model proposals: a small model that shares the target's tokenizer guesses k tokens,
greedily, one forward a token, batched over the sequences. It keeps its own paged KV cache (a
second KVCacheManager, as many blocks as the target's) through a shadow sequence per target
sequence; before proposing, a shadow drops the guesses the target rejected (their KV blocks
with them) and takes the tokens the target kept, which its first forward computes."""
from __future__ import annotations

import dataclasses
import logging

import torch

from kvship.core.kv_cache_manager import KVCacheManager
from kvship.kernels.argmax import argmax
from kvship.runner.model_runner import ModelRunner
from kvship.runner.model_setup import load_model
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence
from kvship.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)

_SHADOW_PARAMS = SamplingParams(temperature=0.0)  # a shadow samples nothing itself: argmax below


class DraftModelDrafts:
    def __init__(self, spec: SpeculativeConfig, engine_config, target_model_config, target_tokenizer,
                 num_blocks: int):
        config = dataclasses.replace(engine_config, model=spec.model, revision=None, served_model_name=None,
                                     load_format="auto", quantization=None, speculative_config=None,
                                     num_kv_blocks=num_blocks, kv_cache_memory=None, task="generate",
                                     enable_lora=False)
        source, model_config = load_model(config)  # refuses a draft whose context is shorter than the target's
        _check_same_vocabulary(source.tokenizer, model_config, target_tokenizer, target_model_config)
        if model_config.linear_attention is not None:
            raise ValueError(f"the draft model ({model_config.architecture}) keeps a recurrent state, which cannot "
                             "be rolled back past rejected tokens")
        try:
            self.runner = ModelRunner(config, model_config, source.weights())
        except torch.OutOfMemoryError:
            raise ValueError(f"the draft model and its KV cache ({num_blocks} blocks, as many as the target's) do not "
                             "fit beside the target: lower --gpu-memory-utilization to leave room") from None
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, False, model_config.kv_window)
        self.budget = config.max_num_batched_tokens
        self.shadows: dict[Sequence, Sequence] = {}
        self.synced: dict[Sequence, int] = {}  # how many of a target's tokens its shadow has taken
        log.info("draft model %s: %d KV blocks", spec.model, self.runner.num_blocks)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        live = set(seqs)
        self.forget([s for s in self.shadows if s not in live])  # preempted, or not decoding now
        batch, want, budget = Batch(), {}, self.budget
        for seq, k in zip(seqs, ks):
            shadow = self._sync(seq)
            n = shadow.num_tokens - shadow.num_computed_tokens
            # a shadow that does not fit this step proposes nothing (the target decodes as usual)
            if n <= budget and self.kv.allocate(shadow, n + k - 1):
                batch.add(shadow, n)
                budget -= n
                want[shadow] = k
        drafts: dict[Sequence, list[int]] = {s: [] for s in want}
        while batch:
            batch = batch.decodes_first()
            tokens = argmax(self.runner.run(batch)).tolist()
            following = Batch()
            for shadow, n, token in zip(batch.seqs, batch.num_new_tokens, tokens):
                shadow.num_computed_tokens += n
                shadow.token_ids.append(token)
                drafts[shadow].append(token)
                if len(drafts[shadow]) < want[shadow]:
                    following.add(shadow, 1)
            batch = following
        return [drafts.get(self.shadows[seq], []) for seq in seqs]

    def forget(self, seqs: list[Sequence]) -> None:
        """Free the shadows of these sequences (finished, aborted, or not proposing now)."""
        for seq in seqs:
            shadow = self.shadows.pop(seq, None)
            if shadow is not None:
                self.kv.free(shadow)
                del self.synced[seq]

    def _sync(self, seq: Sequence) -> Sequence:
        """seq's shadow, holding seq's tokens: its guesses that seq did not keep are dropped."""
        shadow = self.shadows.get(seq)
        if shadow is None:
            shadow = self.shadows[seq] = Sequence(seq.request_id, seq.index, list(seq.token_ids), _SHADOW_PARAMS)
        else:
            mine, theirs = shadow.token_ids, seq.token_ids
            same = self.synced[seq]
            while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
                same += 1
            del mine[same:]
            mine += theirs[same:]
            if shadow.num_computed_tokens > same:
                shadow.num_computed_tokens = same
                self.kv.drop_tail(shadow)
        self.synced[seq] = seq.num_tokens
        return shadow

    def release(self) -> None:
        self.runner.release()


def _check_same_vocabulary(draft_tokenizer, draft_config, target_tokenizer, target_config) -> None:
    if draft_tokenizer.backend.get_vocab() != target_tokenizer.backend.get_vocab():
        raise ValueError(f"the draft model's tokenizer ({draft_tokenizer.vocab_size} tokens) differs from the "
                         f"target's ({target_tokenizer.vocab_size}): a draft model must share the target's tokenizer")
    if draft_config.vocab_size > target_config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_config.vocab_size}) is larger than the target's "
                         f"({target_config.vocab_size})")
