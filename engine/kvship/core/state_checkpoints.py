"""Recurrent-state checkpoints: the prefix cache of a hybrid model (models/qwen3_next.py).

A prefix hit skips the attention layers' work through the cached KV blocks, but the DeltaNet
layers need their recurrent state as it stood after the hit's last token, which no block holds.
So the state is copied, at a few block boundaries, into checkpoint slots (rows of the same
state tensors as the sequences' slots, numbered after them), keyed by that block's chained hash.
A hit may only end at a block whose checkpoint exists (KVCacheManager.find_cached_prefix).

Policy (its cost bounded): a hybrid prefill step ends on a block boundary where it can
(``aligned_chunk``), and a checkpoint is kept at the end of each such step: one every token
budget of a long prompt, and one at the prompt's last full block (a later turn of the same
conversation resumes there); that last cut costs the prompt one extra step for its tail.
Decode steps keep none. The pool is bounded; the least recently used checkpoint goes first.
"""
from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, first_slot: int, num_slots: int):
        self.slots = range(first_slot, first_slot + num_slots)
        self.free = list(reversed(self.slots))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.by_hash

    def __len__(self) -> int:
        return len(self.by_hash)

    def take(self, block_hash: int) -> int:
        """The slot holding the state after the block ``block_hash``, marked as just used."""
        self.by_hash.move_to_end(block_hash)
        return self.by_hash[block_hash]

    def keep(self, block_hash: int) -> int | None:
        """A slot to copy the state after block ``block_hash`` into, evicting the least recently
        used checkpoint when none is free; None when it is kept already (or there is no slot).
        The copy runs after the step's forward and restores before it, so a slot evicted here
        may still be read by a restore of this very step."""
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash)
            return None
        if self.free:
            slot = self.free.pop()
        elif self.by_hash:
            _, slot = self.by_hash.popitem(last=False)
        else:
            return None
        self.by_hash[block_hash] = slot
        return slot


def aligned_chunk(start: int, n: int, num_tokens: int, block_size: int) -> int:
    """How many of a prefill step's ``n`` tokens from ``start`` to compute, so that the step ends
    on a block boundary where it can: the last full block a later prompt may hit, (num_tokens - 1)
    // block_size blocks (the last token is always computed), is a boundary too. Unchanged when
    no boundary lies inside the step."""
    end = start + n
    last = (num_tokens - 1) // block_size * block_size
    cut = end // block_size * block_size if end <= last else last
    return cut - start if cut > start else n
