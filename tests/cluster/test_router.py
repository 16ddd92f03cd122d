"""The router's KV index (built only from events), its hashing, and its policies (pure Python,
fast)."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache import BlockManager
from kvlab.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvlab.cluster.router import HashRing, KVIndex, PrefixTree, Router, RouteRequest

BS = 4

ops = st.lists(st.tuples(st.sampled_from(["alloc", "append", "free", "reset"]), st.integers(0, 2),
                         st.lists(st.integers(0, 2), min_size=1, max_size=14)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_index_equals_union_of_replica_caches(sequence):
    """After any operations on 3 replicas, index[r] == the hashes r's pool caches (and counts
    match)."""
    bms = [BlockManager(6, BS, enable_kv_events=True) for _ in range(3)]
    index, seqs, live, n = KVIndex(), [0, 0, 0], [[], [], []], 0
    for op, r, tokens in sequence:
        bm = bms[r]
        if op == "alloc" and bm.can_allocate(tokens):
            bm.allocate(f"s{n}", tokens)
            live[r].append(f"s{n}")
            n += 1
        elif op == "append" and live[r] and bm.can_append(live[r][-1]):
            bm.append(live[r][-1], tokens[0])
        elif op == "free" and live[r]:
            bm.free(live[r].pop(0))
        elif op == "reset":
            bm.reset_prefix_cache()
        events = bm.take_events()
        if events:
            index.apply(r, EventBatch(0.0, tuple(events), seqs[r]))
            seqs[r] += 1
        for i, b in enumerate(bms):
            assert index.hashes(i) == set(b.pool.cached), f"replica {i} after {op}"
            assert dict(index.blocks.get(i, {})) == {h: len(v) for h, v in b.pool.cached.items()}
    assert index.gaps == 0
    held = set().union(*(set(b.pool.cached) for b in bms))
    assert set(index.parent) == held  # parent links kept exactly while some replica holds the block


def test_index_counts_a_lost_batch():
    index = KVIndex()
    index.apply(0, EventBatch(0.0, (), 0))
    index.apply(0, EventBatch(0.0, (), 2))
    assert index.gaps == 1


def _stored(*hs):
    return BlockStored(tuple(hs), None, tuple(range(BS * len(hs))), BS)


H1, H2, H3 = b"h1" * 16, b"h2" * 16, b"h3" * 16


def test_a_duplicated_batch_is_dropped():
    """The same store delivered twice would count the block twice and outlive its removal."""
    index = KVIndex()
    index.apply(0, EventBatch(0.0, (), 0))
    index.apply(0, EventBatch(0.0, (_stored(H1),), 1))
    index.apply(0, EventBatch(0.0, (_stored(H1),), 1))  # re-delivered
    index.apply(0, EventBatch(0.0, (BlockRemoved((H1,)),), 2))
    assert index.hashes(0) == set() and index.duplicates == 1 and not index.stale


def test_a_lost_batch_marks_the_replica_stale_until_it_resets():
    index = KVIndex()
    index.apply(0, EventBatch(0.0, (_stored(H1),), 0))
    index.apply(1, EventBatch(0.0, (_stored(H1),), 0))  # another replica holds H1 too
    # batch 1 (BlockRemoved H1) is lost
    index.apply(0, EventBatch(0.0, (_stored(H2),), 2))
    assert H1 not in index.hashes(0) and index.stale == {0} and index.gaps == 1
    assert index.overlap(0, [H2]) == 0  # not routed on while stale
    assert index.hashes(1) == {H1} and H1 in index.parent  # the other replica is untouched
    # its cache was reset: exact again
    index.apply(0, EventBatch(0.0, (AllBlocksCleared(), _stored(H3)), 3))
    assert index.stale == set() and index.hashes(0) == {H3} and index.overlap(0, [H3]) == 1


def test_a_restarted_replica_leaves_no_stale_hashes():
    index = KVIndex()
    for seq, h in enumerate((H1, H2)):
        index.apply(0, EventBatch(0.0, (_stored(h),), seq))
    index.apply(0, EventBatch(0.0, (_stored(H3),), 0))  # it restarted empty: numbers from 0 again
    assert index.hashes(0) == {H3} and index.restarts == 1 and index.stale == {0}
    assert set(index.parent) == {H3}


def test_a_snapshot_resyncs_a_stale_replica():
    bm = BlockManager(8, BS, enable_kv_events=True)
    router = Router("kv_aware", [0, 1], BS)
    bm.allocate("a", list(range(13)))
    router.apply_events(0, EventBatch(0.0, tuple(bm.take_events()), 0))
    bm.free("a")
    bm.allocate("b", list(range(100, 129)))  # evicts a's blocks: this batch is lost
    bm.take_events()
    bm.free("b")
    bm.allocate("c", list(range(200, 205)))
    router.apply_events(0, EventBatch(0.0, tuple(bm.take_events()), 2))
    assert router.index.stale == {0}
    router.resync(0, {h: len(v) for h, v in bm.pool.cached.items()}, 2)
    assert not router.index.stale and router.index.hashes(0) == set(bm.pool.cached)
    bm.free("c")
    bm.allocate("d", list(range(300, 325)))
    router.apply_events(0, EventBatch(0.0, tuple(bm.take_events()), 3))
    assert router.index.hashes(0) == set(bm.pool.cached) and not router.index.stale


def test_kv_aware_does_not_route_on_a_stale_index():
    """Replica 0 evicted the prefix in a batch the router never got: it must not count it as
    cached."""
    bms, router = _fleet(2, "kv_aware", weight=10.0)
    seqs = [0, 0]
    prefix = list(range(100, 132))
    first, _ = _serve(bms, router, "a", prefix + [1], seqs)
    router.finish(first, "a")
    bms[first].free("a")
    bms[first].reset_prefix_cache()  # the batch saying so is lost
    bms[first].take_events()
    seqs[first] += 1
    bms[first].allocate("x", [7, 7, 7, 7, 7])
    router.apply_events(first, EventBatch(0.0, tuple(bms[first].take_events()), seqs[first] + 1))
    router.route(RouteRequest("b", tuple(prefix + [2])))
    assert router.last_overlap[first] == 0 and first in router.index.stale


faults = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "reset", "lose", "dup", "old", "restart", "snapshot"]),
        st.integers(0, 1),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(faults)
def test_index_is_exact_whenever_it_is_not_stale(sequence):
    """Under lost, duplicated and re-sent batches and restarts, a replica not marked stale is
    indexed exactly."""
    bms = [BlockManager(6, BS, enable_kv_events=True) for _ in range(2)]
    index, seqs, sent, live, n = KVIndex(), [0, 0], [[], []], [[], []], 0
    for op, r, tokens in sequence:
        bm, deliver = bms[r], True
        if op == "alloc" and bm.can_allocate(tokens):
            bm.allocate(f"s{n}", tokens)
            live[r].append(f"s{n}")
            n += 1
        elif op == "free" and live[r]:
            bm.free(live[r].pop(0))
        elif op == "reset" and not live[r]:
            bm.reset_prefix_cache()
        elif op == "lose" and live[r]:
            bm.free(live[r].pop(0))
            # never the first batch after a start (a restart is known by its batch 0)
            deliver = seqs[r] == 0
        elif op in ("dup", "old") and sent[r]:
            index.apply(r, sent[r][-1] if op == "dup" else sent[r][len(tokens) % len(sent[r])])
        elif op == "restart":
            bms[r], seqs[r], sent[r], live[r] = (
                BlockManager(6, BS, enable_kv_events=True),
                0,
                [],
                [],
            )
            bms[r].allocate(f"s{n}", tokens + [0] * BS)  # a full block: its store says it restarted
            live[r].append(f"s{n}")
            n += 1
        elif op == "snapshot":
            bm.take_events()
            index.resync(r, {h: len(v) for h, v in bm.pool.cached.items()}, max(seqs[r] - 1, 0))
        events = bms[r].take_events()
        if events:
            batch = EventBatch(0.0, tuple(events), seqs[r])
            seqs[r] += 1
            sent[r].append(batch)
            if deliver:
                index.apply(r, batch)
        for i, b in enumerate(bms):
            if i not in index.stale:
                assert dict(index.blocks.get(i, {})) == {
                    h: len(v) for h, v in b.pool.cached.items()
                }, (i, op)


def test_router_hashes_meet_the_replicas():
    """The router's prompt hashes are the ones a replica's block manager stores (fingerprint
    included)."""
    bm = BlockManager(16, BS, model_fingerprint="fp", enable_kv_events=True)
    prompt = list(range(11))
    bm.allocate("a", prompt)
    (stored,) = bm.take_events()
    router = Router("kv_aware", [0], BS, model_fingerprint="fp")
    # capped at n-1
    assert tuple(router.hashes(RouteRequest("x", tuple(prompt)))) == stored.block_hashes[:2]
    other = Router("kv_aware", [0], BS, model_fingerprint="other")
    assert not set(other.hashes(RouteRequest("x", tuple(prompt)))) & set(stored.block_hashes)


def _fleet(n, policy, **kw):
    bms = [BlockManager(64, BS, enable_kv_events=True) for _ in range(n)]
    return bms, Router(policy, list(range(n)), BS, **kw)


def _serve(bms, router, rid, prompt, seqs):
    r = router.route(RouteRequest(rid, tuple(prompt), None, max_tokens=2))
    cached = bms[r].allocate(rid, prompt)
    router.apply_events(r, EventBatch(0.0, tuple(bms[r].take_events()), seqs[r]))
    seqs[r] += 1
    return r, cached


def test_kv_aware_sends_a_repeated_prefix_to_the_replica_holding_it():
    bms, router = _fleet(4, "kv_aware", weight=4.0)
    seqs = [0] * 4
    prefix = list(range(100, 132))  # 8 blocks
    first, _ = _serve(bms, router, "a", prefix + [1, 2, 3], seqs)
    for i in range(3):  # other prefixes land elsewhere: load pushes them away from the busy replica
        _serve(bms, router, f"o{i}", [200 + 40 * i + k for k in range(30)], seqs)
    r, cached = _serve(bms, router, "b", prefix + [7, 8, 9], seqs)
    assert r == first and cached == len(prefix)
    assert router.last_overlap[first] == 8 and all(
        v == 0 for k, v in router.last_overlap.items() if k != first
    )


def test_kv_aware_weight_zero_ignores_the_cache():
    bms, router = _fleet(2, "kv_aware", weight=0.0)
    seqs = [0, 0]
    prefix = list(range(100, 132))
    first, _ = _serve(bms, router, "a", prefix + [1], seqs)
    r, cached = _serve(bms, router, "b", prefix + [2], seqs)  # "a" still in flight: load decides
    assert r != first and cached == 0


def test_kv_aware_forgets_a_failed_replica():
    bms, router = _fleet(2, "kv_aware", weight=10.0)
    seqs = [0, 0]
    prefix = list(range(100, 132))
    first, _ = _serve(bms, router, "a", prefix + [1], seqs)
    router.remove_replica(first)
    assert router.index.num_blocks(first) == 0
    assert router.route(RouteRequest("b", tuple(prefix + [2]))) != first


def test_round_robin_and_least_loaded():
    rr = Router("round_robin", [0, 1, 2], BS)
    assert [rr.route(RouteRequest(i, (1, 2))) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router("least_loaded", [0, 1], BS)
    assert [ll.route(RouteRequest(i, (1, 2))) for i in range(3)] == [0, 1, 0]
    ll.finish(1, 1)
    assert ll.route(RouteRequest(9, (1, 2))) == 1


def test_consistent_hash_moves_only_the_removed_replicas_sessions():
    ring = HashRing([0, 1, 2, 3])
    before = {f"s{i}": ring.get(f"s{i}") for i in range(400)}
    assert set(before.values()) == {0, 1, 2, 3}
    ring.remove(2)
    after = {k: ring.get(k) for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k in before if before[k] == 2}


def test_prefix_tree_matches_routed_prompts():
    tree = PrefixTree(chunk=4)
    tree.insert(list(range(12)), 1)
    tree.insert(list(range(8)) + [50, 51, 52, 53], 2)
    assert tree.match(list(range(12)) + [9]) == {1: 12, 2: 8}
    tree.remove_replica(1)
    assert tree.match(list(range(12))) == {2: 8}


def test_prefix_tree_policy_follows_the_longest_match_and_spreads_new_prefixes():
    router = Router("prefix_tree", [0, 1], BS)
    a = list(range(40))
    b = list(range(500, 540))
    ra = router.route(RouteRequest("a", tuple(a)))
    rb = router.route(RouteRequest("b", tuple(b)))
    assert ra != rb  # a new prefix goes to the smaller tree
    assert router.route(RouteRequest("c", tuple(a + [1, 2]))) == ra
    assert router.route(RouteRequest("d", tuple(b[:30] + [9] * 10))) == rb


def test_session_affinity_is_sticky():
    router = Router("session_affinity", [0, 1, 2, 3], BS)
    rng = random.Random(0)
    for s in range(20):
        picks = {
            router.route(
                RouteRequest(f"{s}/{t}", tuple(rng.randrange(9) for _ in range(5)), f"sess{s}")
            )
            for t in range(4)
        }
        assert len(picks) == 1


def test_the_router_index_keeps_the_host_tier_apart():
    """Blocks evicted into a host tier are indexed as host copies, apart from the pool's blocks."""
    from kvlab.cache.host_tier import HostTier, TierLink

    bm = BlockManager(4, BS, model_fingerprint="m", enable_kv_events=True)
    link = TierLink(
        HostTier(100, BS, emit=bm.emit_event), 1, load_payload=lambda payload, block_id: None
    )
    bm.attach_second_tier(link, link.on_evict)
    bm.allocate("a", list(range(2 * BS + 1)))
    bm.free("a")
    # evicts a's blocks into the tier
    bm.allocate("flood", list(range(1000, 1000 + bm.num_blocks * BS)))
    bm.free("flood")
    idx = KVIndex()
    idx.apply(0, EventBatch(0.0, tuple(bm.take_events()), 0))
    assert idx.hashes(0) == set(bm.pool.cached)
    assert set(idx.host[0]) == set(bm.second_tier.tier.entries)
    assert idx.host[0]  # something was evicted into the tier
