"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and the prefix cache.

A full block is identified by a hash chained over its tokens and all tokens before it, so two
sequences with the same prefix map to the same blocks. Blocks nobody references stay in the
free queue (in LRU order) with their contents intact; a later request can revive them until
they are popped for reuse, at which point their hash is dropped.

When every attention layer slides over the same window (Mistral v0.1, Phi-3-mini), a block
whose tokens all lie before the window of a sequence's next position is never read again: the
sequence gives it back as soon as it schedules past it (its hash, if any, keeps it in the
prefix cache), so a long generation holds about window / block_size + 1 blocks. The sequence
keeps only the blocks it holds; ``num_released_blocks`` counts the ones given back before them.

With ``events`` a list, every block entering the cache (BlockStored) and every cached block
evicted (BlockRemoved) is recorded there, in vLLM's event format (kvship.core.kv_events), until
the engine takes them after its step.

A hybrid model's prefix hit also needs the recurrent state at its last block: with
``checkpoints`` (core/state_checkpoints.py) a hit ends at the last block that has one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvship.core import kv_events
from kvship.core.state_checkpoints import StateCheckpoints, aligned_chunk
from kvship.sequence import Sequence


def lora_root(lora_id: int | None) -> int | None:
    """Where a sequence's hash chain starts: its LoRA adapter's own root (ids after a -1 are no
    block's tokens), so that no block is shared with the base model or another adapter."""
    return None if lora_id is None else kv_events.block_hash(None, (-1, lora_id))

@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


class BlockTable:
    """Block objects made on first use: a small model on a large GPU has millions of blocks,
    and building them all up front cost seconds and hundreds of MB at every start."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, block_id: int) -> Block:
        block = self.made.get(block_id)
        if block is None:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block {block_id} out of {self.num_blocks}")
            block = self.made[block_id] = Block(block_id)
        return block

    def __iter__(self):
        return (self[i] for i in range(self.num_blocks))


class FreeBlocks:
    """The free queue, in the order blocks are reused: blocks freed with nothing cached (latest
    first), then blocks never used (a counter, not a list), then cached blocks, least recently
    freed first, so that the prefix cache keeps what was used last."""

    def __init__(self, num_blocks: int):
        self.uncached: OrderedDict[int, None] = OrderedDict()
        self.next_fresh, self.num_blocks = 0, num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.uncached) + self.num_blocks - self.next_fresh + len(self.cached)

    def pop(self) -> int:
        if self.uncached:
            return self.uncached.popitem(last=True)[0]
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.cached.popitem(last=False)[0]

    def push(self, block_id: int, cached: bool) -> None:
        (self.cached if cached else self.uncached)[block_id] = None

    def remove(self, block_id: int) -> None:
        """A free block revived by a prefix hit."""
        if self.cached.pop(block_id, 0) is not None:
            del self.uncached[block_id]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, checkpoints: StateCheckpoints | None = None):
        self.block_size = block_size
        self.window = window  # ModelConfig.kv_window: None keeps every block while its sequence runs
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = BlockTable(num_blocks)
        self.free_queue = FreeBlocks(num_blocks)
        self.cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found
        # recurrent-state slots (a hybrid model's per-sequence state, held by the runner): one for
        # each sequence holding blocks, so never more than the scheduler runs at once
        self.free_state_slots: list[int] = []
        self.num_state_slots = 0
        self.events: list[list] | None = None  # a list: record KV-cache events (take_events)
        self.checkpoints = checkpoints if enable_prefix_caching else None

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

    def most_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of num_tokens tokens holds at once when each step computes
        at most `chunk` of them: with a window, those a step reads (see first_needed_block)."""
        if self.window is None:
            return self.blocks_needed(num_tokens)
        return min(self.blocks_needed(num_tokens), self.blocks_needed(self.window - 1 + chunk) + 1)

    def first_needed_block(self, position: int) -> int:
        """The first block that a step computing from ``position`` on reads: its first query sees
        the last ``window`` positions up to its own, the later ones less far back. Positions only
        move forward (the overlap's in-flight token counts as computed from its launch on, and a
        preempted sequence starts again from nothing), so the blocks before are never read again."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    # -- prefix cache -----------------------------------------------------------------------
    def full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chain hashes of seq's first num_blocks blocks, computed once per block and kept on seq
        (tokens of a full block never change, so neither does its hash). The chain starts from the
        sequence's LoRA adapter: the same tokens under another adapter have other keys and values."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else lora_root(seq.lora_id)
            hashes.append(kv_events.block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int | None]:
        """Blocks holding the longest cached prefix of seq's tokens. The last token is always
        left to compute, so that the model produces logits for it. With a window, only the
        prefix's blocks from the window of its first uncomputed position on must be cached (those
        before are never read): entries before them are None, whether cached or evicted."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        found: list[int | None] = []
        run_start = length = 0  # where the current run of cached blocks starts; the best prefix's length
        hashes = self.full_block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        for i, h in enumerate(hashes):
            found.append(self.cached.get(h))
            if found[i] is None:
                run_start = i + 1
            elif run_start <= self.first_needed_block((i + 1) * self.block_size) and (
                    self.checkpoints is None or h in self.checkpoints):
                length = i + 1
        skip = self.first_needed_block(length * self.block_size)
        return [None] * skip + found[skip:length]

    # -- recurrent-state checkpoints (hybrid models) --------------------------------------------
    def prefill_chunk(self, seq: Sequence, n: int) -> int:
        """The tokens of a prefill step of at most n to compute: cut at a block boundary that
        keeps a state checkpoint, with checkpoints (core/state_checkpoints.py), else all n."""
        if self.checkpoints is None or n <= 1:
            return n
        return aligned_chunk(seq.num_computed_tokens, n, seq.num_tokens, self.block_size)

    def state_restore(self, seq: Sequence) -> tuple[int, int] | None:
        """(checkpoint slot, seq's slot) to copy before the step that resumes seq after a prefix
        hit of seq.num_computed_tokens tokens (find_cached_prefix ends hits at checkpoints)."""
        if self.checkpoints is None or not seq.num_computed_tokens:
            return None
        h = self.full_block_hashes(seq, seq.num_computed_tokens // self.block_size)[-1]
        return self.checkpoints.take(h), seq.state_slot

    def state_checkpoint(self, seq: Sequence, n: int) -> tuple[int, int] | None:
        """(seq's slot, checkpoint slot) to copy after a prefill step of n tokens that ends on a
        block boundary, None when it does not or the checkpoint is kept already."""
        end = seq.num_computed_tokens + n
        if self.checkpoints is None or n <= 1 or end % self.block_size or end > seq.num_tokens:
            return None
        slot = self.checkpoints.keep(self.full_block_hashes(seq, end // self.block_size)[-1])
        return None if slot is None else (seq.state_slot, slot)

    def count_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks of seq that became full with computed tokens whose values the host
        knows (a decode's input may still be in flight: its block waits for the next call)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        released = seq.num_released_blocks  # offered when they were given back (if they were full then)
        first_new = max(seq.num_cached_upto, released)
        if num_full <= first_new:
            return
        hashes = self.full_block_hashes(seq, num_full)
        for i in range(first_new, num_full):
            block = self.blocks[seq.block_table[i - released]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
                if self.events is not None:
                    self._record_stored(hashes, i, seq.token_ids[i * self.block_size : (i + 1) * self.block_size],
                                        seq.lora_id)
        seq.num_cached_upto = num_full

    # -- events ------------------------------------------------------------------------------
    def _record_stored(self, hashes: list[int], i: int, tokens: list[int], lora_id: int | None) -> None:
        """Block i of a chain entered the cache: one BlockStored event per run of consecutive blocks
        (a chain's first block has no parent; an adapter's chain starts at lora_root, as vLLM's
        events say with lora_id)."""
        parent = hashes[i - 1] if i else None
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "BlockStored" and last[1][-1] == parent:
            last[1].append(hashes[i])
            last[3].extend(tokens)
        else:
            self.events.append(kv_events.stored([hashes[i]], parent, list(tokens), self.block_size, lora_id))

    def _record_removed(self, h: int) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(h)
        else:
            self.events.append(kv_events.removed([h]))

    def take_events(self) -> list[list]:
        """The events recorded since the last call, oldest first."""
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, revived: list[int | None] = ()) -> bool:
        """Give seq blocks for num_new_tokens more tokens (after taking the prefix-cache blocks
        `revived`, find_cached_prefix's answer). All or nothing: returns False and changes
        nothing if blocks run short, except that blocks out of the window are given back first
        (never read again, they count as free for this very allocation)."""
        if self.window is None and not revived and seq.state_slot is not None and (
                seq.num_computed_tokens + num_new_tokens
                <= (seq.num_released_blocks + len(seq.block_table)) * self.block_size):
            return True  # the blocks it holds have room (most decode steps): nothing to do
        first = self.first_needed_block(seq.num_computed_tokens)
        self._release_before(seq, first)
        skip = len(revived[:first])  # a new sequence's cached blocks before its window stay in the cache
        revived = revived[skip:]
        need = (self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
                - seq.num_released_blocks - skip - len(seq.block_table) - len(revived))
        # revived blocks sitting in the free queue stop being free once taken
        if need > self.num_free_blocks - sum(1 for b in revived if self.blocks[b].ref_count == 0):
            return False
        seq.num_released_blocks += skip
        taken = list(revived)
        for block_id in revived:
            self._take(block_id)
        for _ in range(need):
            block_id = self.free_queue.pop()
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the cached contents
                del self.cached[block.hash]
                if self.events is not None:
                    self._record_removed(block.hash)
                block.hash = None
            block.ref_count = 1
            taken.append(block_id)
        if taken:
            seq.block_table = seq.block_table + taken
        self._take_state_slot(seq)
        return True

    def _take_state_slot(self, seq: Sequence) -> None:
        """A slot for seq's recurrent state from its first blocks on (reused slots first)."""
        if seq.state_slot is None:
            if self.free_state_slots:
                seq.state_slot = self.free_state_slots.pop()
            else:
                seq.state_slot, self.num_state_slots = self.num_state_slots, self.num_state_slots + 1

    def _release_before(self, seq: Sequence, first: int) -> None:
        """Give back seq's blocks before block number `first` (out of every layer's window)."""
        n = min(first - seq.num_released_blocks, len(seq.block_table))
        if n <= 0:
            return
        self.cache_full_blocks(seq)
        for block_id in seq.block_table[:n]:
            self._give_back(block_id)
        seq.block_table = seq.block_table[n:]
        seq.num_released_blocks += n

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_queue.remove(block_id)
        block.ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, however it ends (finished, aborted, preempted). Its full blocks
        enter the prefix cache first, so that the next request with the same prefix reuses
        them even when this one ended in the step that computed them."""
        self.cache_full_blocks(seq)
        # Tail blocks first, so that a prefix's first blocks are the last to be evicted.
        for block_id in reversed(seq.block_table):
            self._give_back(block_id)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_cached_upto = 0
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def drop_tail(self, seq: Sequence) -> None:
        """Give back seq's blocks past its computed tokens: those that held speculative positions
        the verify rejected. None was offered to the prefix cache (cache_full_blocks stops at
        tokens whose values the host knows, and a proposal is not one of them)."""
        keep = max(0, self.blocks_needed(seq.num_computed_tokens) - seq.num_released_blocks)
        if keep < len(seq.block_table):
            for block_id in reversed(seq.block_table[keep:]):
                self._give_back(block_id)
            seq.block_table = seq.block_table[:keep]

    def _give_back(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue.push(block_id, cached=block.hash is not None)
