"""Continuous batching under a per-step token budget.

Each step: running decodes first, one token each; then prefills (prompts part-way through a
chunked prefill, and waiting sequences) take what is left of the budget, the fewest remaining
tokens first, so that a short request starts at once beside a long prompt, which goes on with
the rest. With ``prefill_join_tokens`` set, once a prompt's prefill ends in the step, later
prompts join it only while the step holds at most that many tokens, so that prompts finish one
a step, shortest remaining first (without it they share the whole budget, offline's default;
`kvship serve` sets a limit, for time to first token under a burst). Beside decodes, a long prompt (more than
LONG_PREFILL_STEPS steps' budgets left) takes at most ``prefill_beside_decodes`` tokens (a
CPU's step time grows with every token, and each decode waits for it). With
``schedule_policy`` "longest-output" waiting sequences are admitted by the most tokens they may
generate instead (an offline batch ends with its last sequence: the long ones started first
leave a short tail).

The batch lists its one-token entries first (Batch.decodes_first), for the attention kernels.
A sequence with a LoRA adapter waits while the running ones already use as many distinct
adapters as the device has slots (``max_loras``). When blocks run out, the newest running
sequence not yet in the batch is preempted (its blocks freed, recomputed later from its tokens;
the prefix cache usually makes that cheap). A hybrid model's prefill steps end on block
boundaries where they can, and the batch lists the recurrent-state copies of its prefix hits
and checkpoints (core/state_checkpoints.py).
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Container

from kvship.core.kv_cache_manager import KVCacheManager
from kvship.sequence import Batch, SeqStatus, Sequence

# A prompt with more tokens left than this many steps' budgets is long: beside decodes it takes at
# most prefill_beside_decodes a step. Shorter ones (an offline batch's prompts) keep the budget.
LONG_PREFILL_STEPS = 4


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None, prefill_join_tokens: int | None = None,
                 schedule_policy: str = "shortest-prefill", prefill_beside_decodes: int | None = None):
        self.kv = kv
        self.schedule_policy = schedule_policy
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: prompts share the whole budget, however many end in the step
        self.prefill_join_tokens = max_num_batched_tokens if prefill_join_tokens is None else prefill_join_tokens
        # None: prefills take what the decodes leave of the budget
        self.prefill_beside_decodes = max_num_batched_tokens if prefill_beside_decodes is None else prefill_beside_decodes
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
        prefills: list[Sequence] = []  # running sequences part-way through their prompt

        for seq in list(self.running):  # decodes, oldest first
            if seq.status is not SeqStatus.RUNNING:
                continue
            n = seq.num_tokens + (seq in in_flight) - seq.num_computed_tokens
            if n > 1:
                prefills.append(seq)
            elif budget:
                if seq.draft_token_ids:
                    n += self._verified_drafts(seq, budget - n)
                fits, preempted = self._fit(seq, n, batch, preempted)
                if fits:
                    batch.add(seq, n)
                    budget -= n

        # Prefills take what is left, fewest remaining tokens first (running ones first among
        # equals, then arrival order): a short prompt is not queued behind a long prompt's chunks.
        # Waiting sequences are admitted only while nothing had to be preempted this step.
        admitting = not preempted
        loras = {seq.lora_id for seq in self.running if seq.lora is not None}
        room_to_admit = admitting and len(self.running) < self.max_num_seqs
        waiting = [seq for seq in self.waiting if not seq.gated] if room_to_admit else []
        # what long prompts may still take: less beside decodes, which wait for the step
        long_left = min(budget, self.prefill_beside_decodes) if batch.seqs else budget
        room, ended = budget, False  # what the next prefill may take; whether a prompt's prefill ends in this step
        for seq in self._prefill_order(prefills, waiting):
            if room <= 0:
                break
            long = seq.num_tokens - seq.num_computed_tokens > LONG_PREFILL_STEPS * self.max_num_batched_tokens
            take = min(room, long_left) if long else room
            if take <= 0:
                continue
            if seq.status is SeqStatus.RUNNING:
                n = self.kv.prefill_chunk(seq, min(seq.num_tokens - seq.num_computed_tokens, take))
                fits, preempted = self._fit(seq, n, batch, preempted)
                admitting = admitting and not preempted
            elif seq in prefills or not admitting or len(self.running) >= self.max_num_seqs:
                continue  # preempted meanwhile, or no admissions this step
            elif seq.lora is not None and seq.lora_id not in loras and len(loras) >= (self.max_loras or len(loras) + 1):
                continue  # every adapter slot is taken by running sequences
            else:
                n = self._admit(seq, take, batch)
                fits = n > 0
                admitting = fits  # one that does not fit keeps the later ones waiting behind it
            if fits:
                ended = ended or seq.num_computed_tokens + n >= seq.num_tokens
                batch.add(seq, n)
                budget -= n
                long_left -= n if long else 0
                room = min(budget, self.prefill_join_tokens - (self.max_num_batched_tokens - budget)) if ended else budget
                if seq.lora is not None:
                    loras.add(seq.lora_id)
                if copy := self.kv.state_checkpoint(seq, n):
                    batch.state_checkpoints.append(copy)
        return batch.decodes_first()

    def _prefill_order(self, prefills: list[Sequence], waiting: list[Sequence]) -> list[Sequence]:
        def remaining(seq: Sequence) -> int:
            return seq.num_tokens - seq.num_computed_tokens

        if self.schedule_policy == "longest-output":  # prompts part-way through go on first
            return sorted(prefills, key=remaining) + sorted(
                waiting, key=lambda seq: -(seq.params.max_tokens or math.inf))
        return sorted(prefills + waiting, key=remaining)

    def _verified_drafts(self, seq: Sequence, room: int) -> int:
        """How many of a decode's proposed tokens this step verifies: what the budget leaves
        room for and free blocks hold (a guess never preempts anything); the rest are dropped."""
        k = min(len(seq.draft_token_ids), room)
        if k and not self.kv.allocate(seq, 1 + k):
            k = 0
        del seq.draft_token_ids[k:]
        return k

    def _fit(self, seq: Sequence, n: int, batch: Batch, preempted: bool) -> tuple[bool, bool]:
        """Blocks for n more tokens of a running sequence, preempting the newest running ones
        not in this batch (seq itself last) until they fit. Returns whether seq fits, and
        whether anything was preempted this step."""
        while not self.kv.allocate(seq, n):
            scheduled = set(batch.seqs)
            victim = next(s for s in reversed(self.running) if s not in scheduled)
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, preempted
        return True, preempted

    def _admit(self, seq: Sequence, budget: int, batch: Batch) -> int:
        """Move a waiting sequence to running, its cached prefix counted as computed (its
        recurrent state restored in ``batch``, for a hybrid model); the number of its tokens
        this step computes, or 0 when its blocks do not fit."""
        revived = self.kv.find_cached_prefix(seq)
        computed = len(revived) * self.kv.block_size
        seq.num_computed_tokens = computed
        n = self.kv.prefill_chunk(seq, min(seq.num_tokens - computed, budget))
        if not self.kv.allocate(seq, n, revived):
            seq.num_computed_tokens = 0
            return 0
        if copy := self.kv.state_restore(seq):
            batch.state_restores.append(copy)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = computed
            self.kv.count_prefix_lookup(seq.num_prompt_tokens, computed)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return n
