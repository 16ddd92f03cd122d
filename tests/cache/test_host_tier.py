"""The host tier: a bytes-bounded LRU of evicted blocks, restored instead of recomputed, never across salts."""

import random

import pytest

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.hashing import hash_block, prompt_block_hashes
from kvlab.cache.host_tier import HostTier, TierEntry, TierLink
from kvlab.cache.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, EventBatch
from kvlab.cluster.router import KVIndex

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
    assert sum(isinstance(ev, BlockStored) for ev in events) == 7 and sum(isinstance(ev, BlockRemoved) for ev in events) == 4


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
    assert tier.get(e.block_hash, (9, 9, 9, 9), (), None) is None  # same hash, other tokens (a collision)
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
    """The tier holds 2 blocks; taking the first restored block's slot evicts a pool block into the tier,
    which pushes out the second entry before it is read: one block restored, the rest computed."""
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


def test_the_router_index_keeps_the_host_tier_apart():
    bm = _manager(4, 100)
    bm.allocate("a", list(range(2 * BS + 1)))
    bm.free("a")
    _evict_all(bm)
    idx = KVIndex()
    idx.apply(0, EventBatch(0.0, tuple(bm.take_events()), 0))
    assert idx.hashes(0) == set(bm.pool.cached)
    assert set(idx.host[0]) == set(bm.second_tier.tier.entries)


# --- on the bundled model: restored K/V gives the same tokens as recompute -------------------------------

def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def test_restored_blocks_give_the_tokens_of_a_recompute(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(4, 100)
    ref = Engine(model, tok, num_blocks=64, enable_prefix_caching=False).generate(prompts, sp)
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=10 ** 7, debug=True)
    outs = [eng.generate([p], sp)[0] for p in prompts]  # each evicts the one before
    again = eng.generate(prompts[:2], sp)
    assert [o.output_ids for o in outs + again] == [r.output_ids for r in ref + ref[:2]]
    assert again[0].num_restored_tokens == 96 and again[0].num_cached_tokens == 96
    st = eng.stats()
    assert st["tier_loaded_blocks"] > 0 and st["bytes_from_host"] == st["tier_loaded_blocks"] * eng.store.bytes_per_block
    assert st["tier_bytes"] <= st["tier_capacity_bytes"]


def test_an_unreadable_tier_entry_falls_back_to_recompute_on_the_engine(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts(3, 100, seed=5)
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=10 ** 7, debug=True)
    first = [eng.generate([p], sp)[0] for p in prompts][0]
    assert len(eng.host_tier.tier) > 0
    for e in eng.host_tier.tier.entries.values():  # every payload damaged: one layer missing
        e.payload = (e.payload[0][:1], e.payload[1])
    again = eng.generate([prompts[0]], sp)[0]
    assert again.num_restored_tokens == 0 and again.output_ids == first.output_ids
    assert eng.stats()["tier_load_failures"] == 1


def test_engine_tier_stays_within_its_bytes(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=1)  # smaller than one block
    cap = 3 * eng.store.bytes_per_block
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=cap + 7)
    eng.generate(_prompts(6, 70, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))
    tier = eng.host_tier.tier
    tier.check_invariants()
    assert tier.nbytes <= cap + 7 and len(tier) == 3 and tier.num_evictions > 0


def test_a_salted_block_in_the_tier_is_never_served_to_another_tenant(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = _prompts(1, 80, seed=2)[0]
    ref = Engine(model, tok, num_blocks=64, enable_prefix_caching=False).generate([prompt], sp)[0].output_ids
    eng = Engine(model, tok, num_blocks=12, host_tier_bytes=10 ** 7, isolation="tenant", secret="s" * 16)
    eng.generate([prompt], sp, tenants=["alice"])
    eng.generate(_prompts(1, 180, seed=3), sp, tenants=["carol"])  # evicts alice's blocks into the tier
    assert eng.stats()["tier_saved_blocks"] >= 4
    bob = eng.generate([prompt], sp, tenants=["bob"])[0]
    alice = eng.generate([prompt], sp, tenants=["alice"])[0]
    assert bob.num_restored_tokens == 0 and bob.num_cached_tokens == 0
    assert alice.num_restored_tokens > 0
    assert bob.output_ids == alice.output_ids == ref
    assert eng.block_manager.metrics.cross_tenant_hits == 0


def test_reset_prefix_cache_clears_the_tier(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    eng = Engine(model, tok, num_blocks=12, host_tier_bytes=10 ** 7)
    eng.generate(_prompts(3, 90, seed=4), SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(eng.host_tier.tier) > 0
    assert eng.reset_prefix_cache() and len(eng.host_tier.tier) == 0


def test_the_radix_cache_refuses_a_host_tier(lm):
    from kvlab.engine import Engine

    model, tok = lm
    with pytest.raises(ValueError, match="cache='blocks'"):
        Engine(model, tok, num_blocks=12, cache="radix", host_tier_bytes=10 ** 6)
