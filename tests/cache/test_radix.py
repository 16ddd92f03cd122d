"""The radix-tree prefix cache (SGLang's RadixAttention semantics): hand-made cases, bad input, and
two hypothesis property tests -- random insert / match+lock / unlock / evict sequences against an
independent brute-force model (resident prefixes, lock counts, LRU times), and random allocate /
append / fork / free interleavings under pool pressure against the longest common prefix over every
resident sequence."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.cache.block_manager import (
    BlockManager,
    DuplicateSequenceError,
    TenantScope,
    UnknownSequenceError,
)
from kvlab.cache.block_pool import InvariantError, NoFreeBlocksError
from kvlab.cache.radix import RadixCache

# a 37-token "system prompt": two full 16-token blocks and 5 tokens more
SYS = list(range(100, 137))


def snapshot(c: RadixCache):
    """Everything observable about a cache, to prove a refused call changed nothing."""
    return (c.dump(max_tokens=10_000), list(c.free_pages), c.clock, c.tree_pages, c.evictable_pages,
            {k: (tuple(s.token_ids), tuple(s.block_table), frozenset(s.private), s.node.node_id)
             for k, s in c.seqs.items()}, c.metrics.as_dict(), c.num_splits, c.num_evicted_pages)


# --- cached-token counts --------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 37])
def test_repeated_prompt_hits_all_but_the_last_token_in_whole_pages(page_size, n):
    c = RadixCache(64, page_size)
    assert c.allocate("first", SYS[:n]) == 0
    assert c.allocate("again", SYS[:n]) == (n - 1) // page_size * page_size
    c.check_invariants()


def test_a_prefix_shorter_than_a_block_hits_at_token_granularity():
    """37 shared tokens: the radix tree serves all 37, 16-token blocks serve 32."""
    a, b = SYS + [1, 2, 3], SYS + [7, 8, 9]
    radix, blocks = RadixCache(64, 1), BlockManager(8, 16)
    radix.allocate("a", a)
    blocks.allocate("a", a)
    assert radix.allocate("b", b) == 37
    assert blocks.allocate("b", b) == 32
    assert RadixCache(64, 16).allocate("a", a) == 0
    paged = RadixCache(64, 16)
    paged.allocate("a", a)
    assert paged.allocate("b", b) == 32  # SGLang's paged mode: whole pages, like blocks
    for c in (radix, paged):
        c.check_invariants()


def test_sharing_stops_at_the_first_differing_token_and_splits_the_node():
    c = RadixCache(64, 1)
    c.allocate("a", list(range(10)))
    assert c.allocate("b", list(range(6)) + [99, 98, 97]) == 6
    assert c.block_table("b")[:6] == c.block_table("a")[:6]
    assert not set(c.block_table("b")[6:]) & set(c.block_table("a"))
    assert c.num_splits == 1
    c.check_invariants()


def test_history_enters_the_tree_when_the_sequence_is_freed():
    """Turn 2 re-sends turn 1's prompt and reply: after turn 1 finishes, all of it hits."""
    c = RadixCache(64, 1)
    c.allocate("t1", [1, 2, 3, 4])
    for tok in (5, 6, 7):
        c.append("t1", tok)
    c.free("t1")
    assert c.allocate("t2", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 7
    c.check_invariants()


def test_prompt_is_hittable_before_it_is_freed():
    c = RadixCache(64, 1)
    c.allocate("a", [1, 2, 3, 4, 5])
    assert c.allocate("b", [1, 2, 3, 4, 5, 6]) == 5
    c.check_invariants()


def test_duplicate_pages_past_the_capped_match_are_freed_with_the_sequence():
    c = RadixCache(16, 1)
    c.allocate("a", [1, 2, 3])
    c.allocate("b", [1, 2, 3])  # hits 2; its page for token 3 duplicates a's
    assert len(c.seqs["b"].private) == 1
    c.free("b")
    c.free("a")
    assert c.total_size() == 3 and len(c.free_pages) == 13
    c.check_invariants()


# --- tenants --------------------------------------------------------------------------------------
def test_each_salt_is_its_own_root():
    c = RadixCache(256, 1)
    c.allocate("a", SYS, TenantScope(cache_salt="acme"))
    assert c.allocate("b", SYS, TenantScope(cache_salt="globex")) == 0
    assert c.allocate("c", SYS) == 0
    assert c.allocate("d", SYS, TenantScope(cache_salt="acme")) == len(SYS) - 1
    assert set(c.roots) == {"acme", "globex", None}
    assert c.metrics.cross_tenant_hits == 0
    c.check_invariants()


def test_unsalted_tenants_share_and_are_counted():
    c = RadixCache(64, 1)
    c.allocate("a", SYS, TenantScope(tenant="acme"))
    assert c.allocate("b", SYS, TenantScope(tenant="globex")) == len(SYS) - 1
    assert c.metrics.cross_tenant_hits == len(SYS) - 1


def test_a_public_prefix_cannot_cross_salts():
    c = RadixCache(64, 1)
    with pytest.raises(ValueError, match="own tree"):
        c.can_allocate(SYS, TenantScope(cache_salt="acme", public_tokens=8))
    c.can_allocate(SYS, TenantScope(public_tokens=8))  # no salt: nothing to cross


# --- locks and eviction ---------------------------------------------------------------------------
def test_eviction_takes_the_least_recently_used_unlocked_leaf():
    c = RadixCache(12, 1, trace=True)
    c.insert([1, 2, 3, 4])
    c.insert([5, 6, 7, 8])
    c.match_prefix([1, 2, 3, 4])  # [1..4] is now the more recent
    assert c.evict(1) == 4  # a leaf goes whole
    assert [path for _, path, _, _ in c.evict_log] == [(5, 6, 7, 8)]
    assert c.match_prefix([5, 6, 7, 8]).length == 0
    c.check_invariants()


def test_a_locked_path_is_never_evicted():
    c = RadixCache(8, 1)
    c.insert([1, 2, 3, 4])
    c.insert([1, 2, 9, 9])
    node = c.match_prefix([1, 2, 3, 4]).node
    c.lock(node)
    assert c.evict(8) == 2  # only [9, 9]; [1, 2] and [3, 4] are on the locked path
    assert c.match_prefix([1, 2, 3, 4]).length == 4
    with pytest.raises(NoFreeBlocksError):
        c.insert(list(range(20, 27)))
    c.unlock(node)
    assert c.evict(8) == 4
    c.check_invariants()


def test_an_evicted_parent_follows_its_children():
    c = RadixCache(16, 1)
    c.insert([1, 2])
    c.insert([1, 2, 3, 4])  # [1, 2] and [3, 4] are two nodes
    assert c.evict(3) == 4
    assert c.total_size() == 0 and c.num_evicted_nodes == 2
    c.check_invariants()


def test_allocate_evicts_what_it_needs_and_counts_evicted_misses():
    c = RadixCache(10, 1)
    c.allocate("a", list(range(8)))
    c.free("a")
    c.allocate("b", list(range(50, 58)))  # evicts a's sequence to find pages
    c.free("b")
    assert c.allocate("c", list(range(8))) == 0
    s = c.stats()
    assert s["miss_evicted"] == 7 and s["evicted_tokens"] >= 8
    c.check_invariants()


def test_refused_allocation_changes_nothing():
    c = RadixCache(8, 1)
    c.allocate("a", [1, 2, 3, 4, 5])
    before = snapshot(c)
    assert not c.can_allocate([1, 2, 3, 4, 5, 6, 7, 8, 9])
    with pytest.raises(NoFreeBlocksError):
        c.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert snapshot(c) == before


# --- decode, fork, free ---------------------------------------------------------------------------
def test_fork_shares_whole_pages_and_copies_a_partial_last_page():
    c = RadixCache(16, 4)
    c.allocate("p", list(range(6)))  # page 0 full (in the tree), page 1 holds 2 tokens
    c.append("p", 6)
    c.fork("p", "child")
    assert c.block_table("child")[0] == c.block_table("p")[0]
    first = c.append("child", 70)
    assert first.cow == (c.block_table("p")[1], c.block_table("child")[1])
    assert c.append("child", 71).cow is None
    c.append("p", 7)
    c.check_invariants()
    c.free("p")
    c.free("child")
    c.check_invariants()


def test_fork_at_token_granularity_copies_nothing():
    c = RadixCache(32, 1)
    c.allocate("p", [1, 2, 3])
    c.append("p", 4)
    c.fork("p", "child")
    assert c.block_table("child") == c.block_table("p")
    assert c.append("child", 5).cow is None
    c.check_invariants()


def test_uncache_removes_the_unwritten_pages_from_the_tree():
    c = RadixCache(32, 1)
    c.allocate("a", list(range(10)))
    c.allocate("b", list(range(10)) + [50])  # hits a's 10 tokens
    with pytest.raises(ValueError, match="still used"):
        c.free("a", uncache_from=4)
    c.free("b", uncache_from=10)
    c.free("a", uncache_from=4)
    assert c.match_prefix(list(range(10))).length == 4
    c.check_invariants()


def test_bad_input():
    with pytest.raises(ValueError):
        RadixCache(0, 1)
    with pytest.raises(ValueError):
        RadixCache(4, 0)
    c = RadixCache(16, 1)
    c.allocate("a", [1, 2])
    with pytest.raises(DuplicateSequenceError):
        c.allocate("a", [1, 2])
    with pytest.raises(UnknownSequenceError):
        c.free("nobody")
    with pytest.raises(ValueError):
        c.allocate("b", [])
    with pytest.raises(TypeError):
        c.allocate("b", [1.0])
    with pytest.raises(ValueError):
        c.allocate("b", [-1])
    with pytest.raises(TypeError):
        c.append("a", "x")
    with pytest.raises(ValueError):
        c.lock(c.roots[None])
    node = c.match_prefix([1, 2]).node
    with pytest.raises(ValueError):
        c.unlock(node)
    c.check_invariants()


def test_check_invariants_catches_a_leak():
    c = RadixCache(8, 1)
    c.allocate("a", [1, 2, 3])
    c.free_pages.popleft()
    with pytest.raises(InvariantError, match="leak"):
        c.check_invariants()


# --- the cache interface, no aliases (replays on this cache: tests/engine/test_trace_replay.py) ---
def test_the_radix_cache_has_its_own_shape_and_no_pool_alias():
    c = RadixCache(64, 4)
    # it once returned itself so code could read ``manager.pool.num_blocks``
    assert not hasattr(c, "pool")
    assert (c.num_blocks, c.block_size, c.num_free_blocks) == (64, 4, 64)


# --- property test 1: the tree against a brute-force model ----------------------------------------
class Model:
    """Resident page-aligned prefixes per salt with their last-access time, and lock counts per
    locked path."""

    def __init__(self, page_size):
        self.p = page_size
        self.time: dict[tuple, int] = {}  # (salt, prefix) -> last access
        self.locks: Counter = Counter()  # (salt, path) -> locks

    def lcp(self, salt, tokens):
        best = 0
        for j in range(self.p, len(tokens) + 1, self.p):
            if (salt, tuple(tokens[:j])) in self.time:
                best = j
            else:
                break
        return best

    def touch(self, salt, tokens, length, t):
        for j in range(self.p, length + 1, self.p):
            self.time[(salt, tuple(tokens[:j]))] = t

    def locked(self, salt, prefix):
        return any(
            s == salt and path[: len(prefix)] == prefix for (s, path), n in self.locks.items() if n
        )

    def is_leaf(self, salt, prefix):
        return not any(
            s == salt and len(q) > len(prefix) and q[: len(prefix)] == prefix
            for (s, q) in self.time
        )

    def evict(self, salt, path, edge, t):
        removed = [
            (salt, path[:j]) for j in range(len(path) - edge + self.p, len(path) + 1, self.p)
        ]
        assert all(r in self.time for r in removed), "evicted a prefix that was not resident"
        assert self.is_leaf(salt, path), "evicted a node that was not a leaf"
        assert not self.locked(salt, path), "evicted a locked node"
        assert self.time[(salt, path)] == t
        leaves = [(s, q) for (s, q) in self.time if self.is_leaf(s, q) and not self.locked(s, q)]
        assert t == min(self.time[x] for x in leaves), (
            "evicted a leaf that was not the least recently used"
        )
        for r in removed:
            del self.time[r]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "match", "match_lock", "unlock", "evict"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=12),
        st.sampled_from([None, None, "t"]),
        st.integers(0, 10),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(3, 20), ops=OPS)
def test_tree_agrees_with_brute_force(page_size, num_pages, ops):
    c = RadixCache(num_pages, page_size, trace=True)
    model = Model(page_size)
    held = []  # (node, salt, path) locked through lock()
    longest = 0
    for op, tokens, salt, k in ops:
        log = len(c.evict_log)
        if op == "insert":
            aligned = tokens[: len(tokens) // page_size * page_size]
            before = snapshot(c)
            try:
                got = c.insert(tokens, salt)
            except NoFreeBlocksError:
                assert snapshot(c) == before
                continue
            # the insert touches the path it extends and holds it locked while it evicts for new
            # pages
            k = model.lcp(salt, aligned)
            model.touch(salt, aligned, k, c.clock)
            model.locks[(salt, tuple(aligned[:k]))] += 1
            for s, path, edge, t in c.evict_log[log:]:
                model.evict(s, path, edge, t)
            model.locks[(salt, tuple(aligned[:k]))] -= 1
            assert got == k
            model.touch(salt, aligned, len(aligned), c.clock)
            longest = max(longest, len(aligned))
        elif op in ("match", "match_lock"):
            res = c.match_prefix(tokens, salt)
            assert res.length == model.lcp(salt, tokens) <= min(len(tokens), longest)
            assert res.length % page_size == 0 and len(res.pages) == res.length // page_size
            model.touch(salt, tokens, res.length, c.clock)
            if op == "match_lock" and res.length:
                c.lock(res.node)
                path = tuple(tokens[: res.length])
                model.locks[(salt, path)] += 1
                held.append((res.node, salt, path))
        elif op == "unlock" and held:
            node, s, path = held.pop(k % len(held))
            c.unlock(node)
            model.locks[(s, path)] -= 1
        elif op == "evict":
            evictable = c.evictable_pages
            freed = c.evict(k)
            assert freed >= k if evictable >= k else freed == evictable
            for s, path, edge, t in c.evict_log[log:]:
                model.evict(s, path, edge, t)
        c.check_invariants()
        for node, s, path in held:  # a locked path stays resident
            assert c.roots[s] is node.root() and tuple(node.path()[0]) == path
        assert c.total_size() == len(model.time) * page_size


# --- property test 2: sequences under pool pressure vs the longest common prefix of resident sequen
SEQ_OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "append", "append", "append", "fork", "free"]),
        st.integers(0, 5),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
        st.sampled_from([None, "t"]),
    ),
    max_size=50,
)


def brute_force_hit(c: RadixCache, tokens, salt):
    """Longest common prefix of the prompt (capped at n - 1, whole pages) and any resident
    sequence."""
    cap = (len(tokens) - 1) // c.page_size * c.page_size
    best = 0
    for s, seq in c.resident():
        if s != salt:
            continue
        j = 0
        while j < min(cap, len(seq)) and seq[j] == tokens[j]:
            j += 1
        best = max(best, j - j % c.page_size)
    return best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 24), ops=SEQ_OPS)
def test_sequences_agree_with_brute_force_and_keep_invariants(page_size, num_pages, ops):
    c = RadixCache(num_pages, page_size)
    live: list = []
    ids = iter(range(10_000))
    for op, k, tokens, salt in ops:
        if op == "alloc":
            plan = c.can_allocate(tokens, TenantScope(cache_salt=salt))
            expect = brute_force_hit(c, tokens, salt)
            assert plan.cached_tokens == expect
            before = snapshot(c)
            sid = next(ids)
            if plan:
                assert c.allocate(sid, tokens, TenantScope(cache_salt=salt), plan=plan) == expect
                live.append(sid)
            else:
                with pytest.raises(NoFreeBlocksError):
                    c.allocate(sid, tokens, TenantScope(cache_salt=salt))
                assert snapshot(c) == before
        elif op == "append" and live:
            sid = live[k % len(live)]
            if c.can_append(sid):
                c.append(sid, tokens[0])
            else:
                before = snapshot(c)
                with pytest.raises(NoFreeBlocksError):
                    c.append(sid, tokens[0])
                assert snapshot(c) == before
        elif op == "fork" and live:
            sid = next(ids)
            try:
                c.fork(live[k % len(live)], sid)
                live.append(sid)
            except NoFreeBlocksError:
                pass
        elif op == "free" and live:
            c.free(live.pop(k % len(live)))
        c.check_invariants()
    for sid in live:
        c.free(sid)
    c.check_invariants()
    assert c.num_free_blocks == c.num_pages and c.protected_size() == 0


def test_a_plan_of_another_cache_is_refused_and_leaves_no_locked_path():
    big, small = RadixCache(64, 1), RadixCache(4, 1)
    small.insert([1, 2, 3])  # a path the refused allocation would lock
    big.insert([9])  # the same clock
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    plan = big.can_allocate(prompt)
    assert plan and plan.clock == small.clock and not small.can_allocate(prompt)
    before = snapshot(small)
    with pytest.raises(ValueError, match="not made by this cache"):
        small.allocate("x", prompt, plan=plan)
    assert snapshot(small) == before and small.protected_size() == 0
    small.check_invariants()
    assert small.evict(3) == 3  # the path is still evictable


def test_evict_advances_the_clock_so_older_plans_are_stale():
    c = RadixCache(8, 1)
    c.insert([1, 2, 3, 4])
    c.insert([5, 6])
    c.match_prefix([1, 2, 3, 4])  # the more recent: [5, 6] goes first
    plan = c.can_allocate([1, 2, 3, 4, 9])
    t = c.clock
    assert c.evict(2) == 2
    assert c.clock == t + 1 and plan.clock != c.clock
    # a mutation call like the others, even when nothing goes
    assert c.evict(0) == 0 and c.clock == t + 2
    assert c.allocate("x", [1, 2, 3, 4, 9], plan=plan) == 4
    c.check_invariants()
