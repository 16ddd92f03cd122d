"""The block pool: LRU free list, lazy eviction, the collision guard, the trace and its
invariants."""

import pytest

from kvlab.cache.block_pool import BlockPool, InvariantError, NoFreeBlocksError
from kvlab.cache.hashing import hash_block


def full(pool, owner, tokens, parent=None, parent_serial=0):
    """Take a block, fill it with ``tokens`` and register it; return it."""
    block = pool.take(owner)
    block.token_ids = list(tokens)
    h = hash_block(parent.block_hash if parent else None, tokens)
    pool.register(block, h, parent.block_hash if parent else None, parent_serial, (), owner)
    return block


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16", None])
def test_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="positive int"):
        BlockPool(4, bad)
    with pytest.raises(ValueError, match="positive int"):
        BlockPool(bad, 4)


def test_fresh_pool_hands_out_blocks_in_id_order_and_runs_out():
    pool = BlockPool(3, 2)
    assert [pool.take("s").block_id for _ in range(3)] == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.take("s")
    pool.check_invariants()


def test_released_blocks_are_reused_least_recently_released_first():
    pool = BlockPool(4, 2, free_order="lru")
    blocks = [pool.take("s") for _ in range(4)]
    for i in (2, 0, 3, 1):
        pool.release(blocks[i], "s")
    assert list(pool.free) == [2, 0, 3, 1]
    assert pool.next_victim() == 2
    assert [pool.take("t").block_id for _ in range(4)] == [2, 0, 3, 1]


def test_vllm_free_order_reuses_unhashed_blocks_before_evicting_cached_ones():
    """vLLM's order (the default): a freed block with no hash goes to the head, a cached one to the
    tail."""
    pool = BlockPool(4, 2)
    blocks = [pool.take("s") for _ in range(4)]
    for i, b in enumerate(blocks[:3]):  # three full, cached blocks; block 3 stays a partial tail
        b.token_ids = [i, i]
        pool.register(b, bytes([i]), None, 0)
    for i in (1, 3, 0):  # release: a cached block, the partial tail, a cached block
        pool.release(blocks[i], "s")
    assert list(pool.free) == [3, 1, 0]  # the tail first, then the cached blocks in release order
    # reused without evicting anything
    assert pool.take("t").block_id == 3 and len(pool.cached) == 3
    lru = BlockPool(4, 2, free_order="lru")
    bl = [lru.take("s") for _ in range(4)]
    for i, b in enumerate(bl[:3]):
        b.token_ids = [i, i]
        lru.register(b, bytes([i]), None, 0)
    for i in (1, 3, 0):
        lru.release(bl[i], "s")
    # evicts block 1
    assert list(lru.free) == [1, 3, 0] and lru.take("t").block_id == 1 and len(lru.cached) == 2
    with pytest.raises(ValueError, match="free_order"):
        BlockPool(4, 2, free_order="fifo")


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    from kvlab.cache import BlockManager

    m = BlockManager(8, 4)
    m.allocate("a", list(range(10)))
    # refused: nothing changed
    assert m.reset_prefix_cache() is False and m.stats()["num_cached_blocks"] == 2
    m.free("a")
    order = list(m.pool.free)
    assert m.reset_prefix_cache() is True
    # hashes gone, free list kept
    assert m.stats()["num_cached_blocks"] == 0 and list(m.pool.free) == order
    assert m.allocate("b", list(range(10))) == 0  # nothing to hit any more
    m.check_invariants()


def test_cached_block_survives_release_until_reused_then_is_evicted():
    pool = BlockPool(2, 2)
    a = full(pool, "s", [7, 8])
    h = a.block_hash
    pool.release(a, "s")
    assert pool.lookup(h, [7, 8], 0) is a  # lazy eviction: still cached while free
    pool.hit(a, "t")
    assert a.ref_count == 1 and a.block_id not in pool.free
    pool.release(a, "t")
    pool.take("u")  # block 1 (never used) goes first
    assert pool.lookup(h, [7, 8], 0) is a and pool.num_evictions == 0
    pool.take("u")  # now block 0 must be reused
    assert pool.lookup(h, [7, 8], 0) is None
    assert pool.num_evictions == 1 and h in pool.evicted_hashes and a.token_ids == []
    pool.check_invariants(hash_block)


def test_lookup_checks_tokens_parent_and_extra_keys_not_just_the_hash():
    pool = BlockPool(4, 2)
    a = full(pool, "s", [1, 2])
    assert pool.lookup(a.block_hash, [1, 3], 0) is None  # same hash, other tokens (a collision)
    assert pool.lookup(a.block_hash, [1, 2], a.serial) is None  # other parent
    assert pool.lookup(a.block_hash, [1, 2], 0, (("salt", "x"),)) is None
    assert pool.lookup(a.block_hash, [1, 2], 0) is a


def test_twins_share_a_serial_so_children_of_either_match():
    pool = BlockPool(4, 2)
    a, b = full(pool, "s", [1, 2]), full(pool, "t", [1, 2])
    assert a.serial == b.serial and len(pool.cached[a.block_hash]) == 2
    c = full(pool, "u", [3, 4])
    assert c.serial not in (a.serial,)


def test_register_refuses_partial_or_cached_blocks():
    pool = BlockPool(2, 2)
    b = pool.take("s")
    b.token_ids = [1]
    with pytest.raises(ValueError, match="full"):
        pool.register(b, b"h", None, 0)
    b.token_ids = [1, 2]
    pool.register(b, b"h", None, 0)
    with pytest.raises(ValueError, match="full"):
        pool.register(b, b"h", None, 0)


def test_release_below_zero_and_share_of_a_free_block_are_refused():
    pool = BlockPool(2, 2)
    b = pool.take("s")
    pool.release(b, "s")
    with pytest.raises(ValueError, match="double free"):
        pool.release(b, "s")
    with pytest.raises(ValueError, match="not in use"):
        pool.share(b, "t")
    pool.check_invariants()


def test_trace_records_each_block_life():
    pool = BlockPool(2, 2, trace=True)
    pool.tick()
    b = full(pool, "s", [1, 2])
    pool.tick()
    pool.hit(b, "t")
    pool.tick()
    pool.release(b, "s")
    events = [(e.t, e.event, e.ref_count, e.owner) for e in pool.history(b.block_id)]
    assert events == [
        (1, "take", 1, "s"),
        (1, "register", 1, "s"),
        (2, "hit", 2, "t"),
        (3, "release", 1, "s"),
    ]
    row = pool.block_report()[b.block_id]
    assert (
        row["ref_count"] == 1
        and row["created_at"] == 1
        and row["last_access"] == 3
        and row["cached"]
    )
    with pytest.raises(RuntimeError, match="trace=True"):
        BlockPool(1, 1).history(0)


def test_check_invariants_catches_corruption():
    pool = BlockPool(3, 2)
    b = full(pool, "s", [1, 2])
    pool.check_invariants(hash_block)
    b.ref_count += 1  # a stray reference
    pool.check_invariants(hash_block)  # still consistent for the pool alone: in use, not free
    b.ref_count = 0  # dropped without returning to the free list
    with pytest.raises(InvariantError, match="free"):
        pool.check_invariants()
    b.ref_count = 1
    b.token_ids[0] = 99  # K/V overwritten after caching
    with pytest.raises(InvariantError, match="do not match its hash"):
        pool.check_invariants(hash_block)


def test_evicted_hashes_keep_only_the_latest_evictions():
    """A long-running pool must not remember every hash it ever evicted (issue 24: ~0.9 KB per
    request)."""
    assert (
        BlockPool(4, 2).max_evicted_hashes == 1024 and BlockPool(1000, 2).max_evicted_hashes == 4000
    )
    pool = BlockPool(1, 1, max_evicted_hashes=3)
    hashes = []
    for t in range(10):  # each new block evicts the one before it
        block = full(pool, "s", [t])
        hashes.append(block.block_hash)
        pool.release(block, "s")
    pool.release(pool.take("s"), "s")  # evicts the last one too
    assert list(pool.evicted_hashes) == hashes[-3:]  # oldest first
    assert hashes[0] not in pool.evicted_hashes  # forgotten: a miss on it now counts as no_prefix
    full(pool, "s", [9])  # cached again: no longer an evicted hash
    assert list(pool.evicted_hashes) == hashes[-3:-1]
    pool.check_invariants(hash_block)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_max_evicted_hashes_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_evicted_hashes"):
        BlockPool(4, 2, max_evicted_hashes=bad)


def test_a_block_of_another_pool_is_refused_by_every_reference_change():
    pool, other = BlockPool(4, 2), BlockPool(4, 2)
    mine, foreign = full(pool, "s", [1, 2]), full(other, "s", [1, 2])
    # a copy of this pool's own block is not its block either
    copy = type(mine)(mine.block_id, mine.ref_count, list(mine.token_ids), mine.block_hash)
    before = (list(pool.free), {h: list(b) for h, b in pool.cached.items()}, mine.ref_count)
    for block in (foreign, copy):
        for change in (pool.hit, pool.release, pool.share, pool.uncache):
            with pytest.raises(ValueError, match="is not a block of this pool"):
                change(block, "s")
        with pytest.raises(ValueError, match="is not a block of this pool"):
            pool.register(block, block.block_hash, None, 0)
    assert (list(pool.free), {h: list(b) for h, b in pool.cached.items()}, mine.ref_count) == before
    pool.check_invariants()
