"""The block pool, the prefix cache and per-request block tables, by hand-checked cases."""

import pytest

from llm_jax.serving.blocks import (NULL_BLOCK, ROOT_HASH, BlockPool, KVBlockManager, extend_block_hashes,
                                    hash_block)

BS = 4  # block size in these tests


def full_blocks(pool: BlockPool, token_ids: list[int]) -> list[int]:
    """Allocates and caches blocks for ``token_ids`` (whole blocks), as a finished request leaves them."""
    hashes = extend_block_hashes([], token_ids, len(token_ids) // pool.block_size, pool.block_size)
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes):
        assert pool.cache(block, block_hash)
    return blocks


# Hashes.

def test_hash_is_stable_and_chained():
    tokens = [1, 2, 3, 4]
    assert hash_block(ROOT_HASH, tokens) == hash_block(ROOT_HASH, list(tokens))
    # A value fixed once: Python's salted hash() would change it per process.
    assert hash_block(ROOT_HASH, tokens).hex() == "7077f7c78cbaa9547bb8ede0e304f4f3"
    assert len(hash_block(ROOT_HASH, tokens)) == 16
    other_parent = hash_block(ROOT_HASH, [9, 9, 9, 9])
    assert hash_block(other_parent, tokens) != hash_block(ROOT_HASH, tokens)
    assert hash_block(ROOT_HASH, [1, 2, 3, 5]) != hash_block(ROOT_HASH, tokens)
    assert hash_block(ROOT_HASH, [1, 2, 3]) != hash_block(ROOT_HASH, [1, 2, 3, 0])


def test_block_hashes_extend_incrementally_and_ignore_partial_blocks():
    tokens = list(range(10))
    hashes = extend_block_hashes([], tokens, 2, BS)
    assert hashes == [hash_block(ROOT_HASH, tokens[:4]), hash_block(hashes[0], tokens[4:8])]
    assert extend_block_hashes(hashes[:1], tokens, 2, BS) == hashes
    with pytest.raises(ValueError, match="num_blocks=3"):
        extend_block_hashes([], tokens, 3, BS)  # the third block holds 2 tokens: never hashed


# The pool.

def test_pool_reserves_the_null_block_and_counts():
    pool = BlockPool(5, BS)
    assert pool.capacity == 4 and pool.num_free == 4 and pool.num_used == 0 and pool.usage == 0
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    assert pool.num_free == 0 and pool.num_used == 4 and pool.usage == 1
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: 0 of 4 are free"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, BS)


def test_refcounts():
    pool = BlockPool(5, BS)
    [a] = full_blocks(pool, [1, 2, 3, 4])
    pool.acquire([a])
    assert pool.ref_count(a) == 2
    pool.release([a])
    assert pool.ref_count(a) == 1 and pool.num_free == 3
    pool.release([a])
    assert pool.ref_count(a) == 0 and pool.num_free == 4 and a in pool.eviction_order()
    with pytest.raises(ValueError, match=f"block {a} is not held"):
        pool.release([a])
    pool.acquire([a])  # a cached block with no references comes back off the free list
    assert pool.ref_count(a) == 1 and a not in pool.eviction_order() and pool.num_free == 3


def test_eviction_order_is_uncached_first_then_least_recently_released():
    pool = BlockPool(7, BS)
    a, b, c = full_blocks(pool, list(range(12)))
    plain = pool.allocate(1)[0]  # holds nothing findable
    pool.release([b])
    pool.release([c, a])
    pool.release([plain])
    # plain first (nothing to lose), then cached b, c, a in the order released, after the never-used ones.
    assert pool.eviction_order()[0] == plain
    assert pool.eviction_order()[-3:] == (b, c, a)
    pool.acquire([c])
    pool.release([c])  # used again: now the most recent
    assert pool.eviction_order()[-3:] == (b, a, c)
    # Handing out blocks evicts in that order and forgets the evicted blocks' hashes.
    handed = pool.allocate(pool.num_free - 2)
    assert pool.block_hash(b) is None and b in handed
    assert pool.find_cached_prefix(list(range(12)) + [0]) == [a]  # the chain is cut where b was
    assert pool.num_cached == 2 and pool.block_hash(a) is not None


def test_cache_refuses_duplicates_unheld_blocks_and_when_disabled():
    pool = BlockPool(5, BS)
    [a] = full_blocks(pool, [1, 2, 3, 4])
    [dup] = pool.allocate(1)
    assert not pool.cache(dup, pool.block_hash(a))  # same tokens: the first block stays the cached one
    assert pool.block_hash(dup) is None and pool.num_cached == 1
    pool.release([dup])
    with pytest.raises(ValueError, match="not held"):
        pool.cache(dup, hash_block(ROOT_HASH, [7, 7, 7, 7]))
    off = BlockPool(5, BS, enable_prefix_caching=False)
    [block] = off.allocate(1)
    assert not off.cache(block, hash_block(ROOT_HASH, [1, 2, 3, 4]))
    assert off.find_cached_prefix([1, 2, 3, 4, 5]) == [] and off.num_cached == 0


# The prefix cache.

def test_find_cached_prefix_is_the_longest_prefix_of_whole_blocks():
    pool = BlockPool(9, BS)
    a, b, c = full_blocks(pool, list(range(12)))
    assert pool.find_cached_prefix(list(range(12)) + [99]) == [a, b, c]
    assert pool.find_cached_prefix(list(range(10))) == [a, b]  # the partial third block is never a hit
    assert pool.find_cached_prefix([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12]) == [a]  # diverges in block 2
    assert pool.find_cached_prefix([99] + list(range(1, 13))) == []
    # Same tokens in block 2 after a different block 1: a different chain, no hit past block 1.
    [x] = full_blocks(pool, [50, 51, 52, 53])
    assert pool.find_cached_prefix([50, 51, 52, 53, 4, 5, 6, 7, 0]) == [x]


def test_find_cached_prefix_never_returns_the_whole_sequence():
    pool = BlockPool(9, BS)
    a, b, c = full_blocks(pool, list(range(12)))
    # All 12 tokens cached in full blocks: the last block is recomputed so the last token has logits.
    assert pool.find_cached_prefix(list(range(12))) == [a, b]
    assert pool.find_cached_prefix(list(range(5))) == [a]
    assert pool.find_cached_prefix(list(range(4))) == []
    assert pool.find_cached_prefix([0]) == [] and pool.find_cached_prefix([]) == []


def test_prefix_counters():
    pool = BlockPool(9, BS)
    pool.record_prefix_query(13, 8)
    pool.record_prefix_query(7, 0)
    assert (pool.queried_tokens, pool.hit_tokens) == (20, 8)


# Per-request block tables.

def test_allocate_grows_the_table_block_by_block():
    kv = KVBlockManager(BlockPool(5, BS))
    assert kv.allocate("r", 1)
    assert len(kv.block_table("r")) == 1
    assert kv.allocate("r", 4) and len(kv.block_table("r")) == 1  # still fits in the first block
    assert kv.allocate("r", 5) and len(kv.block_table("r")) == 2
    assert kv.can_allocate("r", 16) and not kv.can_allocate("r", 17)
    assert not kv.allocate("r", 17)  # a refused allocation changes nothing
    assert len(kv.block_table("r")) == 2 and kv.pool.num_free == 2
    kv.free("r")
    assert kv.block_table("r") == () and kv.pool.num_free == 4


def test_full_blocks_are_cached_after_they_are_computed_and_found_by_others():
    kv = KVBlockManager(BlockPool(9, BS))
    tokens = list(range(10))
    assert kv.allocate("a", 10)
    kv.cache_full_blocks("a", tokens, 3)
    assert kv.pool.num_cached == 0  # no block is full of computed K/V yet
    kv.cache_full_blocks("a", tokens, 9)
    table = kv.block_table("a")
    assert kv.pool.num_cached == 2 and kv.pool.block_hash(table[2]) is None  # the partial block never
    tokens.append(10)  # a decode step appends tokens...
    tokens.append(11)
    assert kv.allocate("a", 12)
    kv.cache_full_blocks("a", tokens, 12)  # ...and completes the third block
    assert kv.pool.num_cached == 3
    # Another request with the same start shares the cached blocks; its own last token is computed.
    other = tokens[:12] + [7]
    prefix = kv.cached_prefix("b", other)
    assert prefix == list(table)
    assert kv.num_blocks_to_take("b", 13, prefix) == 1
    assert kv.allocate("b", 13, prefix)
    assert kv.block_table("b")[:3] == table and all(kv.pool.ref_count(b) == 2 for b in table)
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate("b", 20, prefix)


def test_free_keeps_cached_blocks_findable_and_counts_unreferenced_prefix_blocks_as_taken():
    kv = KVBlockManager(BlockPool(5, BS))
    tokens = list(range(8))
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", tokens, 8)
    table = kv.block_table("a")
    kv.free("a")
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 2 and kv.pool.num_free == 4
    assert kv.pool.eviction_order()[-2:] == (table[1], table[0])  # the chain's tail goes first
    prefix = kv.cached_prefix("b", tokens + [8])
    assert prefix == list(table)
    # The prefix's blocks are on the free list: sharing them takes them off it.
    assert kv.num_blocks_to_take("b", 9, prefix) == 3
    assert kv.num_blocks_to_take("b", 13, prefix) == 4 and not kv.can_allocate("b", 17, prefix)
    assert kv.allocate("b", 9, prefix)
    assert kv.pool.num_free == 1 and kv.pool.num_used == 3


def test_free_of_an_unknown_request_is_harmless():
    kv = KVBlockManager(BlockPool(3, BS))
    kv.free("nobody")
    kv.cached_prefix("waiting", list(range(9)))  # hashes computed for a request holding no blocks
    kv.free("waiting")
    assert kv.pool.num_free == 2
