"""The block manager: vLLM's prefix-caching semantics on hand-made traces, bad input, and a
hypothesis property test of random allocate / append / fork / free interleavings under pool
pressure."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.cache.block_manager import (
    BlockManager,
    DuplicateSequenceError,
    NoFreeBlocksError,
    TenantScope,
    UnknownSequenceError,
)
from kvlab.cache.block_pool import InvariantError
from kvlab.cache.hashing import hash_block

SYS = list(range(100, 112))  # a 12-token "system prompt"


def snapshot(m: BlockManager):
    """Everything observable about a manager, to prove a failed call changed nothing."""
    pool = m.pool
    return (
        [(b.block_id, b.ref_count, tuple(b.token_ids), b.block_hash, b.serial, b.parent_serial,
          b.created_at, b.last_access) for b in pool.blocks],
        list(pool.free),
        {h: [b.block_id for b in v] for h, v in pool.cached.items()},
        {k: (tuple(s.token_ids), tuple(s.block_table), tuple(s.block_hashes), s.num_cached_tokens)
         for k, s in m.seqs.items()},
        m.metrics.as_dict(), repr(m.metrics.by_tenant), set(pool.evicted_hashes), pool.clock,
        pool.num_evictions, len(pool.trace or ()),
    )


def collide(parent, tokens, extra=()):
    """A stub hash function under which every block collides with every other."""
    return b"same"


# --- cached-token counts (vLLM: full blocks only, last prompt token always recomputed) ------------
@pytest.mark.parametrize(
    "n, expected",
    [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (14, 12)],
)
def test_cached_tokens_are_full_blocks_capped_below_the_prompt_length(n, expected):
    m = BlockManager(16, 4)
    assert m.allocate("first", SYS + [1, 2]) == 0
    assert m.allocate("second", (SYS + [1, 2])[:n]) == expected
    assert m.num_cached_tokens("second") == expected
    m.check_invariants()


def test_sharing_stops_at_the_first_differing_block():
    m = BlockManager(16, 4)
    m.allocate("a", list(range(16)))
    assert m.allocate("b", list(range(9)) + [99] + list(range(10, 16))) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert not set(m.block_table("b")[2:]) & set(m.block_table("a"))
    m.check_invariants()


def test_partial_blocks_are_never_shared():
    m = BlockManager(8, 4)
    m.allocate("a", [1, 2, 3, 4, 5, 6])
    assert m.allocate("b", [1, 2, 3, 4, 5, 6, 7]) == 4  # [5, 6] sat in a partial block of "a"
    assert m.block_table("a")[1] != m.block_table("b")[1]


def test_decode_fills_and_registers_blocks_that_later_prompts_hit():
    m = BlockManager(8, 4)
    m.allocate("a", [1, 2, 3, 4, 5])
    results = [m.append("a", t) for t in (6, 7, 8, 9)]
    assert [r.new_block is not None for r in results] == [False, False, False, True]
    m.check_invariants()
    m.free("a")
    assert m.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 10]) == 8
    m.check_invariants()


def test_multi_turn_reuses_the_whole_history_after_free():
    m = BlockManager(32, 4)
    turn1 = SYS + [1, 2, 3]
    m.allocate("t1", turn1)
    for t in (4, 5, 6, 7, 8):
        m.append("t1", t)
    m.free("t1")
    turn2 = turn1 + [4, 5, 6, 7, 8] + [9, 10, 11]
    assert m.allocate("t2", turn2) == 20  # 23 tokens: 5 full blocks, the 6th holds the last token


def test_slot_mapping_follows_the_block_table():
    m = BlockManager(8, 4)
    m.allocate("x", [0, 1, 2])  # takes block 0
    m.allocate("a", list(range(6)))  # blocks 1, 2
    assert m.block_table("a") == [1, 2]
    assert m.slot_mapping("a") == [4, 5, 6, 7, 8, 9]
    assert m.slot_mapping("a", 4, 6) == [8, 9]


# --- LRU eviction and tail-first freeing ----------------------------------------------------------
def test_free_is_tail_first_and_lru_evicts_tails_before_heads():
    m = BlockManager(6, 4, trace=True)
    m.allocate("a", list(range(12)))  # blocks 0, 1, 2
    m.free("a")
    assert list(m.pool.free)[-3:] == [2, 1, 0]  # tail released first, so it is evicted first
    # needs 4 blocks: 3,4,5 then 2
    m.allocate("b", [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62])
    evicted = [e.block_id for e in m.pool.trace if e.event == "evict"]
    assert evicted == [2]
    m.free("b")
    assert m.allocate("c", list(range(9))) == 8  # heads 0 and 1 still hit
    m.check_invariants()


def test_lru_never_evicts_a_referenced_block():
    m = BlockManager(5, 4, trace=True)
    m.allocate("keep", SYS)  # 3 blocks, held for the whole test
    kept = m.block_table("keep")
    for i in range(30):  # churn through the remaining 2 blocks
        m.allocate(i, [1000 + i] * 8)
        m.free(i)
    assert m.pool.num_evictions > 0
    assert not {e.block_id for e in m.pool.trace if e.event == "evict"} & set(kept)
    assert m.read_tokens("keep") == SYS
    with pytest.raises(NoFreeBlocksError):
        m.allocate("big", list(range(900, 913)))
    m.check_invariants()


def test_miss_reasons_short_no_prefix_evicted():
    m = BlockManager(4, 4)
    m.allocate("tiny", [1, 2, 3])
    assert m.metrics.total.misses == {"short": 3, "no_prefix": 0, "evicted": 0}
    m.free("tiny")
    m.allocate("a", SYS + [1])  # 13 tokens: 3 full blocks never seen, 1 short
    assert m.metrics.total.misses == {"short": 4, "no_prefix": 12, "evicted": 0}
    m.free("a")
    m.allocate("flush", list(range(500, 516)))  # 4 blocks: evicts all of "a"
    m.free("flush")
    m.allocate("again", SYS + [2])
    assert m.metrics.total.misses["evicted"] == 12
    m.check_invariants()


# --- isolation: salts, model fingerprints, hash collisions ----------------------------------------
def test_salts_isolate_tenants_and_are_counted_per_tenant():
    m = BlockManager(32, 4)
    assert m.allocate("a1", SYS + [1], TenantScope(cache_salt="tenant-a")) == 0
    assert m.allocate("b1", SYS + [1], TenantScope(cache_salt="tenant-b")) == 0
    assert m.allocate("n1", SYS + [1]) == 0
    assert m.allocate("a2", SYS + [2], TenantScope(cache_salt="tenant-a")) == 12
    assert not set(m.block_table("a1")) & set(m.block_table("b1"))
    counts = m.metrics.by_tenant
    assert (counts["tenant-a"].requests, counts["tenant-a"].hits) == (2, 12)
    assert counts["tenant-b"].hits == 0 and counts[None].hits == 0
    m.check_invariants()


def test_model_fingerprints_isolate_even_in_one_pool():
    a = BlockManager(32, 4, model_fingerprint="model-a")
    b = BlockManager(32, 4, model_fingerprint="model-b")
    a2 = BlockManager(32, 4, model_fingerprint="model-a")
    b.pool = a2.pool = a.pool  # one physical cache seen by three managers
    a.allocate("x", SYS + [1])
    assert b.allocate("y", SYS + [1]) == 0
    assert a2.allocate("z", SYS + [1]) == 12


def test_forced_hash_collisions_never_share_blocks():
    m = BlockManager(32, 4, hash_fn=collide)
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.allocate("c", [9, 9, 9, 9, 5, 6, 7, 8, 9])  # second block equal, first differs
    assert m.num_cached_tokens("c") == 0
    assert m.allocate("b", [1, 2, 3, 4, 0, 0, 0, 0, 9]) == 4  # first block truly equal: shared
    assert m.allocate("d", [9, 9, 9, 9, 5, 6, 7, 8, 1]) == 8  # chain of "c" found, not of "a"
    assert m.block_table("d")[:2] == m.block_table("c")[:2]
    for s in m.seqs:
        assert m.read_tokens(s) == m.seqs[s].token_ids
    m.check_invariants()


def test_a_stale_child_never_matches_a_new_parent_in_the_same_block():
    m = BlockManager(3, 2, hash_fn=collide)
    m.allocate("a", [1, 2, 3, 4, 0])  # blocks 0 [1,2], 1 [3,4], 2 [0]
    m.free("a")  # free list: 2, 1, 0
    m.allocate("x", [7, 7, 7])  # takes 2 and 1: [3,4] evicted, [1,2] stays
    m.free("x")
    m.allocate("y", [5, 5, 3, 4, 9])  # needs 3 blocks: reuses block 0 for [5,5]
    assert m.num_cached_tokens("y") == 0
    m.check_invariants()


# --- copy-on-write --------------------------------------------------------------------------------
def test_fork_shares_all_blocks_and_cow_splits_the_partial_one():
    m = BlockManager(8, 4)
    m.allocate("p", [1, 2, 3, 4, 5, 6])
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p")
    assert all(m.pool.blocks[b].ref_count == 2 for b in m.block_table("p"))
    shared_tail = m.block_table("p")[1]
    r = m.append("p", 70)
    assert r.cow == (shared_tail, m.block_table("p")[1]) and r.new_block is None
    assert m.append("c", 80).cow is None  # "c" now owns the old block alone
    assert m.read_tokens("p") == [1, 2, 3, 4, 5, 6, 70]
    assert m.read_tokens("c") == [1, 2, 3, 4, 5, 6, 80]
    assert m.metrics.cow_copies == 1
    m.check_invariants()


def test_without_cow_a_fork_corrupts_the_other_sequence():
    m = BlockManager(8, 4, cow=False)
    m.allocate("p", [1, 2, 3, 4, 5, 6])
    m.fork("p", "c")
    m.append("p", 70)
    m.append("c", 80)  # writes into the slot "p" just wrote
    assert m.read_tokens("p") == [1, 2, 3, 4, 5, 6, 80]
    with pytest.raises(InvariantError, match="reads other tokens"):
        m.check_invariants()


def test_fork_with_a_full_last_block_needs_no_copy():
    m = BlockManager(8, 4)
    m.allocate("p", [1, 2, 3, 4])
    m.fork("p", "c")
    assert m.append("p", 5).cow is None and m.append("c", 6).cow is None
    m.free("p")
    m.free("c")
    assert m.num_free_blocks == 8
    m.check_invariants()


# --- bad input: clear exception, unchanged state --------------------------------------------------
@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "16", None])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockManager(8, bad)


def _busy_manager():
    m = BlockManager(6, 4, trace=True)
    m.allocate("a", SYS + [1], TenantScope(cache_salt="t"))  # 4 blocks
    m.fork("a", "b")
    return m


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m: m.free("nope"), UnknownSequenceError, "unknown sequence 'nope'"),
        (lambda m: m.append("nope", 1), UnknownSequenceError, "unknown sequence"),
        (lambda m: m.fork("nope", "z"), UnknownSequenceError, "unknown sequence"),
        (lambda m: m.fork("a", "b"), DuplicateSequenceError, "already allocated"),
        (lambda m: m.allocate("a", [1]), DuplicateSequenceError, "already allocated"),
        (lambda m: m.allocate("z", []), ValueError, "at least one token"),
        (lambda m: m.allocate("z", [1, "2"]), TypeError, "ints"),
        (lambda m: m.allocate("z", [1], TenantScope(cache_salt=3)), TypeError, "salt"),
        (lambda m: m.append("a", 1.0), TypeError, "ints"),
        (
            lambda m: m.allocate("z", list(range(200, 220))),
            NoFreeBlocksError,
            "needs 5 free blocks, 2 of 6",
        ),
        (lambda m: m.allocate("z", list(range(10**6))), NoFreeBlocksError, "free blocks"),
        (lambda m: m.free("a", 14), ValueError, r"uncache_from must be an int in \[0, 13\]"),
        (lambda m: m.free("a", 4.0), ValueError, "uncache_from must be an int"),
        # "a"'s blocks are shared with its fork "b"
        (lambda m: m.free("a", 4), ValueError, "block .* is still used by another sequence"),
    ],
)
def test_bad_calls_raise_and_change_nothing(call, error, match):
    m = _busy_manager()
    before = snapshot(m)
    with pytest.raises(error, match=match):
        call(m)
    assert snapshot(m) == before
    m.check_invariants()


def test_free_twice_raises_and_changes_nothing():
    m = _busy_manager()
    m.free("b")
    before = snapshot(m)
    with pytest.raises(UnknownSequenceError, match="already freed"):
        m.free("b")
    assert snapshot(m) == before


def test_append_without_a_free_block_raises_and_changes_nothing():
    m = BlockManager(3, 2)
    m.allocate("a", [1, 2, 3])
    m.fork("a", "b")
    m.allocate("c", [9])  # pool now full; "a" needs a copy to write
    assert not m.can_append("a")
    before = snapshot(m)
    with pytest.raises(NoFreeBlocksError, match="none is free"):
        m.append("a", 4)
    assert snapshot(m) == before


def test_can_allocate_counts_hits_and_changes_nothing():
    m = BlockManager(4, 4)
    m.allocate("a", SYS + [1])  # all 4 blocks
    before = snapshot(m)
    assert not m.can_allocate(SYS + [2])  # 3 hits in use, 1 new block needed, 0 free
    assert snapshot(m) == before
    m.free("a")
    assert m.can_allocate(SYS + [2])
    assert not m.can_allocate(list(range(17)))  # 5 blocks > pool


def test_check_invariants_finds_a_planted_leak():
    m = BlockManager(8, 4)
    m.allocate("a", SYS)
    m.pool.blocks[m.block_table("a")[0]].ref_count += 1  # a reference nobody will drop
    with pytest.raises(InvariantError, match="leak"):
        m.check_invariants()


# --- property test: random interleavings under pool pressure --------------------------------------
PREFIXES = [SYS, SYS[:5], [7] * 9, []]
op = st.one_of(
    st.tuples(
        st.just("alloc"),
        st.integers(0, 3),
        st.lists(st.integers(0, 5), max_size=7),
        st.integers(0, 2),
    ),
    st.tuples(st.just("append"), st.integers(0, 63), st.integers(0, 5)),
    st.tuples(st.just("append"), st.integers(0, 63), st.integers(0, 5)),
    st.tuples(st.just("fork"), st.integers(0, 63)),
    st.tuples(st.just("free"), st.integers(0, 63)),
)
OPS_SEEN = []


@pytest.mark.parametrize("hash_fn", [hash_block, collide], ids=["sha256", "all-collide"])
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ops=st.lists(op, min_size=200, max_size=260))
def test_random_interleavings_keep_every_invariant_and_leak_nothing(hash_fn, ops):
    m = BlockManager(12, 3, hash_fn=hash_fn, model_fingerprint="fp")
    model: dict[int, list[int]] = {}  # reference: what each live sequence must read back
    next_id = 0
    for o in ops:
        live = sorted(model)
        pick = live[o[1] % len(live)] if live and o[0] != "alloc" else None
        before = snapshot(m)
        try:
            if o[0] == "alloc":
                prompt = PREFIXES[o[1]] + o[2] or [0]
                cached = m.allocate(next_id, prompt, TenantScope(cache_salt=[None, "x", "y"][o[3]]))
                assert cached % 3 == 0 and cached <= len(prompt) - 1
                model[next_id] = list(prompt)
                next_id += 1
            elif pick is None:
                continue
            elif o[0] == "append":
                r = m.append(pick, o[2])
                model[pick].append(o[2])
                if r.cow:
                    assert r.cow[1] == m.block_table(pick)[-1]
            elif o[0] == "fork":
                m.fork(pick, next_id)
                model[next_id] = list(model[pick])
                next_id += 1
            else:
                m.free(pick)
                del model[pick]
        except NoFreeBlocksError:
            assert snapshot(m) == before
        m.check_invariants()
        for s, toks in model.items():
            assert m.read_tokens(s) == toks
        OPS_SEEN.append(1)
    for s in list(model):
        m.free(s)
    m.check_invariants()
    assert m.num_free_blocks == 12 and all(b.ref_count == 0 for b in m.pool.blocks)


def test_property_run_covers_at_least_2000_operations():
    # runs the property test's examples here (under xdist it may run on another worker, with its own
    # list)
    OPS_SEEN.clear()
    test_random_interleavings_keep_every_invariant_and_leak_nothing(hash_fn=hash_block)
    assert len(OPS_SEEN) >= 2000, len(OPS_SEEN)


def test_allocate_reuses_the_plan_of_can_allocate_and_hashes_once():
    calls = []

    def counting(parent, tokens, extra=()):
        calls.append(tuple(tokens))
        return hash_block(parent, tokens, extra)

    m = BlockManager(16, 4, hash_fn=counting)
    prompt = list(range(13))  # three full blocks and one token
    plan = m.can_allocate(prompt)
    assert plan and len(calls) == 3 and plan.blocks_needed == 4
    # the plan's hashes were reused
    assert m.allocate("a", prompt, plan=plan) == 0 and len(calls) == 3
    stale = m.can_allocate(prompt)
    m.allocate("b", list(range(100, 105)))  # the pool changes: the plan is stale
    n = len(calls)
    # recomputed, and it hits a's blocks
    assert m.allocate("c", prompt, plan=stale) == 12 and len(calls) > n
    m.check_invariants()


def test_a_preempted_requests_lookup_is_counted_apart():
    """As vLLM's PrefixCacheStats: ``requests`` and the hit rate count first lookups only."""
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(10)))
    bm.free("a")
    # re-admitted after a preemption: 8 tokens hit
    bm.allocate("a", list(range(10)), preempted=True)
    m = bm.metrics
    assert (m.total.requests, m.total.queries, m.total.hits) == (1, 10, 0)
    assert (m.preempted.requests, m.preempted.queries, m.preempted.hits) == (1, 10, 8)
    assert bm.stats()["preempted_hit_tokens"] == 8 and bm.stats()["hit_rate"] == 0.0
    assert [row["requests"] for row in m.tenant_table()] == [1]


def test_a_plan_of_another_manager_is_refused_before_anything_changes():
    """Two managers at the same clock: the other's plan counts its free blocks and uses its
    fingerprint."""
    prompt = list(range(13))  # four blocks
    big, small = BlockManager(16, 4), BlockManager(2, 4)
    plan = big.can_allocate(prompt)
    assert plan and plan.clock == small.pool.clock
    before = snapshot(small)
    with pytest.raises(ValueError, match="not made by this manager"):
        small.allocate("x", prompt, plan=plan)  # it would take both blocks, then fail: a leak
    assert snapshot(small) == before
    small.check_invariants()
    other = BlockManager(16, 4, model_fingerprint="another model")
    with pytest.raises(ValueError, match="not made by this manager"):
        # it would cache blocks under the first model's hashes
        other.allocate("x", prompt, plan=plan)
    assert other.seqs == {} and other.pool.cached == {}
    other.check_invariants()


def test_a_plan_made_before_the_pool_changed_is_planned_again():
    """Blocks taken from the pool directly (no manager clock tick): the plan's free count is
    stale."""
    m = BlockManager(4, 4)
    prompt = list(range(13))
    plan = m.can_allocate(prompt)
    assert plan
    intruder = m.pool.take("intruder")
    with pytest.raises(NoFreeBlocksError):
        m.allocate("x", prompt, plan=plan)
    assert m.num_free_blocks == 3 and m.seqs == {}  # nothing taken by the refused allocation
    m.pool.release(intruder, "intruder")
    assert m.allocate("x", prompt, plan=m.can_allocate(prompt)) == 0
    m.check_invariants()


def test_block_manager_implements_the_cache_interface():
    """``BlockManager`` is a ``CacheManager``: isinstance holds and every listed member exists and
    is usable."""
    import inspect

    from kvlab.cache import CacheManager, missing_members
    from kvlab.cache.interface import CACHE_MEMBERS

    declared = {
        n for n, v in vars(CacheManager).items() if inspect.isfunction(v) and not n.startswith("_")
    }
    # the list names the protocol
    assert declared | set(CacheManager.__annotations__) == set(CACHE_MEMBERS)
    # derived, not empty
    assert {"allocate", "seqs", "take_events", "block_size"} <= set(CACHE_MEMBERS)
    bm = BlockManager(8, 4)
    assert isinstance(bm, CacheManager) and missing_members(bm) == []
    assert (
        bm.num_blocks == bm.pool.num_blocks == 8
        and bm.take_events() == []
        and bm.reset_prefix_cache()
    )
    assert not isinstance(object(), CacheManager)
    assert set(missing_members(object())) == set(CACHE_MEMBERS)


def test_check_cache_names_missing_and_uncallable_members():
    """A wrong cache object is refused with a ``TypeError`` naming each member it lacks."""
    from kvlab.cache import check_cache

    class Half:
        block_size, num_blocks, num_free_blocks, seqs = 4, 8, 8, {}
        allocate = 3  # not a method

    with pytest.raises(
        TypeError, match=r"Half lacks allocate \(not callable\), append, block_table"
    ) as e:
        check_cache(Half())
    assert "take_events" in str(e.value) and "block_size" not in str(e.value)
    bm = BlockManager(4, 4)
    assert check_cache(bm) is bm


def test_cache_members_follow_the_protocol():
    """``CACHE_MEMBERS`` is read from ``CacheManager``: a member added to a copy of the Protocol
    shows up in it."""
    import inspect
    import types

    from kvlab.cache import interface, protocol

    src = inspect.getsource(protocol).replace(
        "    def take_events(self) -> list:",
        "    extra_attr: int\n\n    def extra_method(self) -> None:\n"
        '        """A member for this test."""\n\n    def take_events(self) -> list:',
    )
    copy = types.ModuleType("protocol_copy")
    exec(compile(src, "protocol_copy", "exec"), copy.__dict__)
    assert set(copy.CACHE_MEMBERS) == set(interface.CACHE_MEMBERS) | {"extra_attr", "extra_method"}
    assert copy.missing_members(BlockManager(4, 4)) == ["extra_attr", "extra_method"]


def test_both_caches_seq_entries_carry_what_the_protocol_declares():
    """Every entry of ``seqs`` has the ``CacheSeq`` members (the engine reads
    ``num_restored_tokens`` there)."""
    from kvlab.cache import CacheSeq
    from kvlab.cache.radix import RadixCache

    for cache in (BlockManager(8, 4), RadixCache(32, 1)):
        cache.allocate("a", list(range(10)))
        entry = cache.seqs["a"]
        assert all(hasattr(entry, name) for name in CacheSeq.__annotations__), type(cache).__name__
        assert entry.num_restored_tokens == 0 and list(entry.token_ids) == list(range(10))
