"""Continuous batching under a per-step token budget.

Each step: running sequences first (decodes, and prompts part-way through a chunked prefill),
then waiting sequences in arrival order, their prompts chunked to fit what is left of the budget.
The batch lists its one-token entries first (Batch.decodes_first), for the attention kernels.
When blocks run out, the newest running sequence is preempted (its blocks freed, recomputed
later from its tokens; the prefix cache usually makes that cheap).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Container

from kvship.core.kv_cache_manager import KVCacheManager
from kvship.sequence import Batch, SeqStatus, Sequence


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End seq (Sequence.finish keeps the reason that counts) and, if it is still scheduled,
        take it out of the queues and free its blocks."""
        seq.finish(reason, stop_reason)
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0  # recomputed from its tokens if it runs again

    def commit(self, batch: Batch) -> None:
        """The batch is launched: its tokens count as computed from now on (a decode's input
        that is still in flight included), so the next schedule starts after them."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n

    def schedule(self, in_flight: Container[Sequence] = ()) -> Batch:
        """The next step's batch. ``in_flight``: sequences with one sampled token the host has not
        read yet (the step before is still running); that token is an input of this step."""
        batch = Batch()
        budget = self.max_num_batched_tokens
        preempted = False

        for seq in list(self.running):  # oldest first
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_tokens + (seq in in_flight) - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n

        # Admit waiting sequences only when nothing had to be preempted this step.
        if not preempted:
            for seq in list(self.waiting):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                if seq.gated:
                    continue
                revived = self.kv.find_cached_prefix(seq)
                computed = len(revived) * self.kv.block_size
                n = min(seq.num_tokens - computed, budget)
                seq.num_computed_tokens = computed
                if not self.kv.allocate(seq, n, revived):
                    seq.num_computed_tokens = 0
                    break
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                    seq.num_cached_tokens = computed
                    self.kv.count_prefix_lookup(seq.num_prompt_tokens, computed)
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                batch.add(seq, n)
                budget -= n
        return batch.decodes_first()
