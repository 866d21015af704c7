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
