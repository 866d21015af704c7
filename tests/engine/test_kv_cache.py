"""Block accounting of the paged KV cache and its prefix cache."""
import pytest

from kvship.core.kv_cache_manager import KVCacheManager
from kvship.sampling_params import SamplingParams
from kvship.sequence import Sequence


def seq(tokens):
    return Sequence("r", 0, list(tokens), SamplingParams())


def prefill(kv, s):
    revived = kv.find_cached_prefix(s)
    s.num_computed_tokens = len(revived) * kv.block_size
    assert kv.allocate(s, s.num_tokens - s.num_computed_tokens, revived)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s)
    return revived


def test_allocate_free_refcounts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = seq(range(10))  # 3 blocks
    prefill(kv, a)
    assert len(a.block_table) == 3 and kv.num_free_blocks == 5
    b = seq(range(10))  # same prompt: shares the 2 full blocks
    revived = prefill(kv, b)
    assert revived == a.block_table[:2]
    assert [kv.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert all(blk.ref_count == 0 for blk in kv.blocks)
    stale = seq(range(4))
    stale.block_table = [0]
    with pytest.raises(AssertionError, match="freed more often"):
        kv.free(stale)  # a double free is caught before any count goes negative
    assert kv.blocks[0].ref_count == 0


def test_all_or_nothing_allocation():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not kv.allocate(s, 12)
    assert s.block_table == [] and kv.num_free_blocks == 2


def test_last_token_always_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prefill(kv, seq(range(8)))
    again = seq(range(8))
    assert len(kv.find_cached_prefix(again)) == 1  # not 2: the 8th token must produce logits


def test_cached_blocks_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old, new = seq([1, 2, 9]), seq([3, 4, 9])
    prefill(kv, old)
    kv.free(old)
    prefill(kv, new)
    kv.free(new)
    # Need 3 fresh blocks: the two unhashed tail blocks go first, then the oldest cached block.
    filler = seq([7, 7, 7, 7, 7])
    assert kv.allocate(filler, 5)
    assert kv.find_cached_prefix(seq([1, 2, 9])) == []  # old prefix evicted
    assert len(kv.find_cached_prefix(seq([3, 4, 9]))) == 1  # newer prefix survives


def test_prefix_caching_off_shares_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(kv, seq(range(10)))
    assert kv.find_cached_prefix(seq(range(10))) == []


def window_run(kv, s, chunk):
    """Compute s's tokens `chunk` at a time as the scheduler does; the blocks held after each step."""
    held = []
    while s.num_computed_tokens < s.num_tokens:
        n = min(chunk, s.num_tokens - s.num_computed_tokens)
        assert kv.allocate(s, n)
        s.num_computed_tokens += n
        kv.cache_full_blocks(s)
        held.append(len(s.block_table))
    return held


def test_window_gives_back_blocks_no_query_reads():
    """Window 8, blocks of 4: a step from position p reads positions from p - 7 on; every block
    before that one is given back (hashed blocks stay cached), the rest are held."""
    kv = KVCacheManager(num_blocks=16, block_size=4, window=8)
    s = seq(range(40))
    held = window_run(kv, s, 1)
    assert max(held) == 3  # the 8 positions a query sees plus its own block's start: at most 3 blocks
    # The last step computed position 39 and read 32..39: blocks 8 and 9 held, 0..7 given back.
    assert s.num_released_blocks == 8 and len(s.block_table) == 2
    assert kv.num_used_blocks == 2
    assert len(kv.cached) == 10  # every full block entered the prefix cache before leaving
    kv.free(s)
    assert kv.num_free_blocks == 16 and s.num_released_blocks == 0
    assert all(b.ref_count == 0 for b in kv.blocks)


def test_window_chunked_prefill_holds_window_and_chunk():
    kv = KVCacheManager(num_blocks=16, block_size=4, window=8)
    s = seq(range(60))
    held = window_run(kv, s, 12)  # a step from p reads p - 7 .. p + 11: 19 positions, 5 blocks here
    assert held == [3, 5, 5, 5, 5] and s.num_released_blocks == 10
    kv.free(s)
    assert kv.num_free_blocks == 16


def test_window_prefix_hit_needs_only_the_window():
    """A repeated prompt revives only the blocks its first computed position reads; the ones
    before are None (not taken), even when they have been evicted meanwhile."""
    kv = KVCacheManager(num_blocks=16, block_size=4, window=8)
    first = seq(range(30))
    window_run(kv, first, 4)  # gives back blocks 0..4 as it goes: the oldest in the free queue
    kv.free(first)
    again = seq(range(30))
    revived = kv.find_cached_prefix(again)
    # 7 full blocks (28 tokens; the 30th token is always computed); position 28 reads 21..28.
    assert len(revived) == 7 and revived[:5] == [None] * 5 and None not in revived[5:]
    filler = seq(range(100, 150))  # takes the 9 blocks never hashed, then evicts the prompt's first two
    assert kv.allocate(filler, 4 * 11)
    assert len(kv.cached) == 5 and kv.find_cached_prefix(seq(range(30))) == revived
    kv.free(filler)
    again.num_computed_tokens = 28
    assert kv.allocate(again, 2, revived)
    assert again.num_released_blocks == 5 and again.block_table[:2] == revived[5:]
    assert [kv.blocks[b].ref_count for b in again.block_table] == [1, 1, 1]
    kv.free(again)
    assert kv.num_free_blocks == 16
    # A hole inside the window ends the prefix there: position 24 then reads blocks 4 and 5.
    kv.cached.pop(kv.blocks[revived[6]].hash)
    kv.blocks[revived[6]].hash = None
    assert kv.find_cached_prefix(seq(range(30))) == [None] * 4 + [kv.cached[again.block_hashes[4]], revived[5]]
