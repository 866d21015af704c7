"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and the prefix cache.

A full block is identified by a hash chained over its tokens and all tokens before it, so two
sequences with the same prefix map to the same blocks. Blocks nobody references stay in the
free queue (in LRU order) with their contents intact; a later request can revive them until
they are popped for reuse, at which point their hash is dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvship.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chain hashes of seq's first num_blocks blocks, computed once per block and kept on seq
        (tokens of a full block never change, so neither does its hash)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash((hashes[-1] if hashes else None, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq's tokens. The last token is always
        left to compute, so that the model produces logits for it."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        found = []
        for h in self.full_block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def count_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks of seq that became full with computed tokens whose values the host
        knows (a decode's input may still be in flight: its block waits for the next call)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        first_new = seq.num_cached_upto
        if num_full <= first_new:
            return
        hashes = self.full_block_hashes(seq, num_full)
        for i in range(first_new, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
        seq.num_cached_upto = num_full

    # -- allocation --------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, revived: list[int] = ()) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) - len(revived)
        # revived blocks sitting in the free queue stop being free once taken
        free_after_revive = self.num_free_blocks - sum(1 for b in revived if self.blocks[b].ref_count == 0)
        return need <= free_after_revive

    def allocate(self, seq: Sequence, num_new_tokens: int, revived: list[int] = ()) -> bool:
        """Give seq blocks for num_new_tokens more tokens (after taking the prefix-cache blocks
        `revived`). All or nothing: returns False and changes nothing if blocks run short."""
        if not self.can_allocate(seq, num_new_tokens, revived):
            return False
        for block_id in revived:
            self._take(block_id)
            seq.block_table.append(block_id)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the cached contents
                del self.cached[block.hash]
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, however it ends (finished, aborted, preempted). Its full blocks
        enter the prefix cache first, so that the next request with the same prefix reuses
        them even when this one ended in the step that computed them."""
        self.cache_full_blocks(seq)
        # Tail blocks first, so that a prefix's first blocks are the last to be evicted.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_upto = 0
