"""KV events (vLLM's schema) from the block manager (the engine's batches:
tests/engine/test_engine.py; the same stream as real vLLM's: tests/vllm/test_vllm_bridge.py)."""

import random

from kvlab.cache import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored
from kvlab.cache.hashing import prompt_block_hashes


def test_off_by_default():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(9)))
    assert bm.take_events() == []


def test_allocate_stores_the_new_full_blocks_in_one_event():
    bm = BlockManager(8, 4, enable_kv_events=True)
    bm.allocate("a", list(range(10)))  # 2 full blocks, a partial tail
    (ev,) = bm.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == tuple(prompt_block_hashes(list(range(8)), 4))
    assert ev.parent_block_hash is None and ev.token_ids == tuple(range(8)) and ev.block_size == 4
    assert bm.take_events() == []  # taken: the queue is empty
    # a second prompt hits block 0 and stores only its new blocks: the parent is the last hit block
    bm.allocate("b", list(range(4)) + [50, 51, 52, 53, 54])
    (ev,) = bm.take_events()
    assert ev.parent_block_hash == prompt_block_hashes(list(range(4)), 4)[0]
    assert ev.token_ids == (50, 51, 52, 53) and len(ev.block_hashes) == 1


def test_decode_stores_each_block_it_fills():
    bm = BlockManager(8, 4, enable_kv_events=True)
    bm.allocate("a", [1, 2, 3, 4, 5, 6])
    bm.take_events()
    bm.append("a", 7)
    assert bm.take_events() == []  # block not full yet
    bm.append("a", 8)
    (ev,) = bm.take_events()
    assert (
        ev.token_ids == (5, 6, 7, 8)
        and ev.parent_block_hash == prompt_block_hashes([1, 2, 3, 4], 4)[0]
    )
    assert ev.block_hashes == (prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1],)


def test_eviction_removes_and_reset_clears():
    bm = BlockManager(3, 4, enable_kv_events=True)
    bm.allocate("a", list(range(8)) + [9])  # 3 blocks, 2 cached
    bm.free("a")
    stored = bm.take_events()[0].block_hashes
    # needs all 3: evicts both cached blocks, tail first
    bm.allocate("b", [100 + i for i in range(12)])
    events = bm.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == [stored[1], stored[0]]
    # removals first: the slots are taken before the new blocks cache
    assert isinstance(events[-1], BlockStored)
    assert not bm.reset_prefix_cache()  # "b" still holds blocks: refused, no event
    assert bm.take_events() == []
    bm.free("b")
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]


def test_failed_step_uncache_emits_removed():
    bm = BlockManager(4, 4, enable_kv_events=True)
    bm.allocate("a", list(range(9)))
    (stored,) = bm.take_events()
    bm.free("a", uncache_from=4)  # block 1's K/V was never written
    assert bm.take_events() == [BlockRemoved((stored.block_hashes[1],))]


def test_the_pool_event_hook_is_public_and_no_module_calls_a_private_one():
    """``BlockPool.emit_event`` queues in order with the pool's own events and drops when events are
    off; no cache module calls another object's private ``_emit``."""
    import re
    from pathlib import Path

    import kvlab.cache
    from kvlab.cache import BlockPool

    extra = BlockStored((b"h",), None, (1, 2, 3, 4), 4)
    pool = BlockPool(4, 4, enable_kv_events=True)
    pool.emit_event(extra)
    assert pool.reset()
    assert pool.take_events() == [extra, AllBlocksCleared()] and pool.take_events() == []
    off = BlockPool(4, 4)
    off.emit_event(extra)
    assert off.take_events() == []
    bm = BlockManager(4, 4, enable_kv_events=True)
    bm.emit_event(extra)  # a tier's events go through the block manager to the pool's hook
    assert bm.take_events() == [extra]
    folder = Path(kvlab.cache.__file__).parent
    assert [
        f.name for f in folder.glob("*.py") if re.search(r"(?<!\bself)\._emit\(", f.read_text())
    ] == []


def test_replaying_the_events_gives_the_cached_hashes():
    """Stores minus removals per hash (a multiset: twins exist) == what the pool caches, after
    random ops."""
    rng = random.Random(0)
    bm = BlockManager(12, 4, enable_kv_events=True)
    counts: dict[bytes, int] = {}
    live: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 14))]
            if bm.can_allocate(prompt):
                bm.allocate(f"s{step}", prompt)
                live.append(f"s{step}")
        elif op < 0.8 and live:
            sid = rng.choice(live)
            if bm.can_append(sid):
                bm.append(sid, rng.randrange(3))
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.1:
            bm.reset_prefix_cache()
        for ev in bm.take_events():
            if isinstance(ev, AllBlocksCleared):
                counts.clear()
            for h in ev.block_hashes if not isinstance(ev, AllBlocksCleared) else ():
                counts[h] = counts.get(h, 0) + (1 if isinstance(ev, BlockStored) else -1)
        assert {h: c for h, c in counts.items() if c} == {
            h: len(b) for h, b in bm.pool.cached.items()
        }
