"""The host tier: a bytes-bounded LRU of evicted blocks, restored instead of recomputed (pure
Python).

On the engine: ``tests/engine/test_offload.py``; in the router's index:
``tests/cluster/test_router.py``."""

import pytest

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.hashing import hash_block, prompt_block_hashes
from kvlab.cache.host_tier import HostTier, TierEntry, TierLink
from kvlab.cache.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

BS = 4


def entry(i: int, nbytes: int = 10, parent=None) -> TierEntry:
    toks = tuple(range(i * BS, (i + 1) * BS))
    return TierEntry(hash_block(parent, toks), parent, toks, (), payload=i, nbytes=nbytes)


def test_tier_respects_its_byte_bound_in_lru_order():
    events = []
    tier = HostTier(35, BS, emit=events.append)
    for i in range(6):
        assert tier.put(entry(i))
        tier.check_invariants()
        assert tier.nbytes <= 35
    assert [e.payload for e in tier.entries.values()] == [3, 4, 5]  # the oldest went first
    e3 = entry(3)
    assert tier.get(e3.block_hash, e3.token_ids, (), None) is not None  # 3 is now the most recent
    tier.put(entry(6))
    assert [e.payload for e in tier.entries.values()] == [5, 3, 6]
    assert not tier.put(entry(7, nbytes=36))  # larger than the whole tier: refused, nothing evicted
    assert len(tier) == 3 and tier.num_refused == 1
    assert all(ev.medium == MEDIUM_CPU for ev in events)
    assert (
        sum(isinstance(ev, BlockStored) for ev in events) == 7
        and sum(isinstance(ev, BlockRemoved) for ev in events) == 4
    )


def test_a_pinned_entry_is_not_evicted():
    tier = HostTier(20, BS)
    tier.put(entry(0))
    tier.put(entry(1))
    tier.pin(entry(0).block_hash)
    assert tier.put(entry(2))  # evicts 1, the only unpinned one
    assert entry(0).block_hash in tier and entry(1).block_hash not in tier
    tier.pin(entry(2).block_hash)
    assert not tier.put(entry(3))  # everything pinned: no room
    tier.check_invariants()


def test_the_tier_serves_only_the_exact_block():
    tier = HostTier(100, BS)
    e = entry(0)
    tier.put(e)
    assert tier.get(e.block_hash, e.token_ids, (), None) is e
    # same hash, other tokens (a collision)
    assert tier.get(e.block_hash, (9, 9, 9, 9), (), None) is None
    assert tier.get(e.block_hash, e.token_ids, (("salt", "b"),), None) is None  # another salt
    assert tier.get(e.block_hash, e.token_ids, (), b"x" * 32) is None  # another parent


def test_bad_entries_are_refused_with_a_clear_error():
    tier = HostTier(100, BS)
    with pytest.raises(ValueError):
        HostTier(0, BS)
    with pytest.raises(TypeError):
        tier.put("not an entry")
    with pytest.raises(ValueError):
        tier.put(TierEntry(b"h", None, (1, 2), (), None, 10))  # not a full block
    assert len(tier) == 0


def _manager(num_blocks: int, tier_blocks: int, fail_loads: bool = False) -> BlockManager:
    bm = BlockManager(num_blocks, BS, model_fingerprint="m", enable_kv_events=True)

    def load(payload, block_id):
        if fail_loads:
            raise ValueError("unreadable payload")

    link = TierLink(HostTier(tier_blocks, BS, emit=bm.emit_event), 1, load_payload=load)
    bm.attach_second_tier(link, link.on_evict)
    return bm


def _evict_all(bm: BlockManager, seq: str = "flood") -> None:
    bm.allocate(seq, list(range(1000, 1000 + bm.num_blocks * BS)))
    bm.free(seq)


def test_evicted_blocks_come_back_from_the_tier_as_a_second_kind_of_hit():
    bm = _manager(8, 100)
    prompt = list(range(3 * BS + 1))  # 3 full blocks, all eligible
    bm.allocate("a", prompt)
    bm.free("a")
    _evict_all(bm)
    assert bm.pool.num_evictions >= 3
    served = bm.allocate("b", prompt)
    seq = bm.seqs["b"]
    assert served == 3 * BS and seq.num_cached_tokens == 0 and seq.num_restored_tokens == 3 * BS
    assert bm.stats()["restored_tokens"] == 3 * BS and bm.stats()["hit_tokens"] == 0
    bm.check_invariants()


def test_an_entry_evicted_while_fetched_ends_the_restore_and_the_rest_is_recomputed():
    """The tier holds 2 blocks; taking the first restored block's slot evicts a pool block into the
    tier, which pushes out the second entry before it is read: one block restored, the rest
    computed."""
    bm = _manager(4, 2)
    prompt = list(range(2 * BS + 1))
    bm.allocate("a", prompt)
    bm.free("a")  # a's 2 full blocks cached, at the free list's tail
    bm.allocate("x", list(range(500, 500 + 4 * BS)))
    bm.free("x")  # x took all 4 blocks: a's two went to the tier; x's 4 are cached now
    assert len(bm.second_tier.tier) == 2
    served = bm.allocate("b", prompt)
    assert served == BS and bm.seqs["b"].num_restored_tokens == BS
    bm.check_invariants()
    bm.second_tier.tier.check_invariants()


def test_an_unreadable_entry_is_a_miss():
    bm = _manager(8, 100, fail_loads=True)
    prompt = list(range(3 * BS + 1))
    bm.allocate("a", prompt)
    bm.free("a")
    _evict_all(bm)
    tier, first = bm.second_tier.tier, prompt_block_hashes(prompt, BS, "m")[0]
    assert first in tier
    assert bm.allocate("b", prompt) == 0
    assert bm.second_tier.load_failures == 1 and first not in tier  # the unreadable entry is gone
    bm.check_invariants()
