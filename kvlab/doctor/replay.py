"""Replay a log through a prefix cache with vLLM's rules: fast on block ids, and on the real
Scheduler (docs)."""

from __future__ import annotations

import functools
import itertools
import operator
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.cache import BlockManager, cdiv

from .divergence import divergence, lcp


@dataclass(slots=True)
class HitStats:
    """One replay's counters, in tokens, like vLLM's ``prefix_cache_queries`` /
    ``prefix_cache_hits``."""

    block_size: int
    capacity_blocks: int | None  # None = unbounded
    requests: int
    query_tokens: int
    hit_tokens: int
    too_big: int = 0
    seconds: float = 0.0
    per_request: list[int] = field(default_factory=list, repr=False)  # hit tokens of each request

    @property
    def hit_rate(self) -> float:
        """Hit tokens / query tokens (0.0 for an empty log)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefilled (the cost the cache did not save)."""
        return self.query_tokens - self.hit_tokens


def block_chains(prompts: Sequence[str], block_size: int, salts: Sequence[str | None] | None = None,
                 public_tokens: Sequence[int] | None = None) -> list[list[int]]:
    """Each prompt's full blocks as chain ids: equal ids <=> equal tokens, prefix and salt (no
    hashing)."""
    import numpy as np
    n, bs = len(prompts), block_size
    if not n:
        return []
    order = sorted(range(n), key=prompts.__getitem__)
    pos = np.argsort(order)  # the sorted position of each prompt
    # the common prefix of each prompt in sorted order with the one before it
    adj = np.array(
        [0] + [lcp(prompts[a], prompts[b]) for a, b in zip(order, order[1:])], dtype=np.int64
    )
    blocks = [len(p) // bs for p in prompts]
    if not (depth := max(blocks)):
        return [[] for _ in prompts]
    ar = np.arange(n, dtype=np.int64)
    # the block that takes the salt
    salted = [0] * n if public_tokens is None else [p // bs for p in public_tokens]
    gid: dict = {}  # (salt, salted block) -> group; by sorted position below
    code = np.array(
        [
            0
            if salts is None or salts[i] is None
            else 1 + gid.setdefault((salts[i], salted[i]), len(gid))
            for i in order
        ],
        dtype=np.int64,
    )
    salted_sorted = np.array([salted[i] for i in order], dtype=np.int64)
    groups = len(gid) + 1
    ids = np.empty((depth, n), dtype=np.int64)  # [block, sorted position]
    for j in range(depth):
        run = np.maximum.accumulate(np.where(adj < (j + 1) * bs, ar, 0))
        ids[j] = run * groups + np.where(salted_sorted <= j, code, 0) + j * n * groups
    rows = ids.T[pos].tolist()  # back to log order
    return [row[:b] for row, b in zip(rows, blocks)]


def pool_blocks(lengths: Sequence[int], block_size: int, capacity_blocks: int | None) -> int:
    """The blocks a replay allocates for a cache of ``capacity_blocks`` (None: unbounded): no more
    than the log fills.

    A pool of every block the log's requests hold together (plus one) never evicts, so any larger
    pool replays the same hits: allocating ``min(capacity, that)`` keeps ``--kv-gib 1e30`` from
    filling memory.
    """
    enough = sum(cdiv(n, block_size) for n in lengths) + 1
    return enough if capacity_blocks is None else min(capacity_blocks, enough)


def replay(
    chains: Sequence[Sequence[int]],
    lengths: Sequence[int],
    block_size: int,
    capacity_blocks: int | None = None,
    concurrency: int = 1,
    free_order: str = "vllm",
) -> HitStats:
    """Replay chains (``block_chains``) through an unbounded or an LRU cache; ``free_order`` as
    BlockPool's."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if free_order not in ("vllm", "lru"):
        raise ValueError(f"free_order must be 'vllm' or 'lru', got {free_order!r}")
    t0, bs, per, too_big = time.perf_counter(), block_size, [], 0
    if capacity_blocks is None:
        seen: set[int] = set()
        for ch, n in zip(chains, lengths):
            cap, k = (n - 1) // bs, 0
            while k < cap and ch[k] in seen:
                k += 1
            per.append(k * bs)
            seen.update(ch)
    elif capacity_blocks < 1:
        raise ValueError("capacity_blocks must be >= 1")
    elif concurrency == 1:
        pool = pool_blocks(lengths, bs, capacity_blocks)
        per, too_big = _replay_lru_one(chains, lengths, bs, pool, free_order == "vllm")
    else:  # several requests at a time: the real scheduler decides who runs (block ids as tokens)
        toks = [
            [c for c in ch for _ in range(bs)] + [0] * (n - len(ch) * bs)
            for ch, n in zip(chains, lengths)
        ]
        ref = replay_block_manager(
            toks, bs, capacity_blocks, None, None, concurrency, False, free_order
        )
        per, too_big = ref.per_request, ref.too_big
    return HitStats(
        bs,
        capacity_blocks,
        len(per),
        int(sum(lengths)),
        sum(per),
        too_big,
        time.perf_counter() - t0,
        per,
    )


def unbounded_hits(
    prompts: Sequence[str], block_size: int, salts: Sequence[str | None] | None = None
) -> list[int]:
    """Per request, the hit tokens of an unbounded cache, from divergence positions alone (no block
    ids)."""
    groups: dict = {}  # salt -> its requests: only those share
    for i in range(len(prompts)):
        groups.setdefault(salts[i] if salts is not None else None, []).append(i)
    out = [0] * len(prompts)
    for idx in groups.values():
        d = divergence([prompts[i] for i in idx])
        for i, pos, n in zip(idx, d.position, d.lengths):
            out[i] = min(pos, n - 1) // block_size * block_size
    return out


def _replay_lru_one(
    chains, lengths, bs: int, num_blocks: int, vllm_order: bool = True
) -> tuple[list[int], int]:
    """The LRU pool for one request at a time: each request is a few bulk operations in C (see
    docs/doctor.md)."""
    # insertion order = LRU order (plain dicts pop and append fast)
    free = dict.fromkeys(range(num_blocks))
    key: dict[int, object] = {}  # block -> chain id it caches (None or absent: nothing)
    first, twins = {}, {}  # chain id -> the oldest block caching it; -> later copies (twins)
    get, pop, update, keyget = first.get, free.pop, free.update, key.get
    not_none = functools.partial(operator.is_not, None)
    # free blocks that cache nothing, at the head of the free list (vLLM's order)
    spare: list[int] = []
    per, too_big = [], 0
    for ch, n in zip(chains, lengths):
        nblk = cdiv(n, bs)
        if nblk > num_blocks:
            per.append(0)
            too_big += 1
            continue
        cap = (n - 1) // bs
        found = list(map(get, ch[:cap]))
        try:
            nh = found.index(None)
            del found[nh:]
        except ValueError:
            nh = cap
        deque(map(pop, found), 0)  # revived: out of the free list, back at its tail below
        k = min(nblk - nh, len(spare))
        victims = spare[len(spare) - k:][::-1]  # the head of the free list first
        del spare[len(spare) - k:]
        lru = list(itertools.islice(free, nblk - nh - k))  # then the least recently used
        deque(map(pop, lru), 0)
        victims += lru
        if olds := list(filter(not_none, map(keyget, victims))):
            if twins and not twins.keys().isdisjoint(olds):
                for b in victims:
                    _forget(b, keyget(b), first, twins)
            else:
                deque(map(first.pop, olds), 0)
        new_ids = ch[nh:n // bs]
        # a twin: cached, but the n-1 rule kept it from hitting
        if new_ids and not first.keys().isdisjoint(new_ids):
            for b, c in zip(victims, new_ids):
                if c in first:
                    twins.setdefault(c, []).append(b)
                else:
                    first[c] = b
        else:
            first.update(zip(new_ids, victims))
        # a partial tail block caches nothing (None)
        key.update(itertools.zip_longest(victims, new_ids))
        per.append(nh * bs)
        if vllm_order and len(victims) > len(new_ids):
            spare += victims[len(new_ids):]  # the partial tail: to the head of the free list
            del victims[len(new_ids):]
        found += victims
        found.reverse()  # released tail first
        update(dict.fromkeys(found))
    return per, too_big


def _forget(b: int, old, first: dict, twins: dict) -> None:
    """Drop block ``b``'s entry under chain id ``old`` (first or twin)."""
    if old is None:
        return
    if first.get(old) == b:
        if old not in twins:
            del first[old]
            return
        first[old] = twins[old].pop(0)  # its oldest twin takes over
    else:
        twins[old].remove(b)
    if not twins[old]:
        del twins[old]


def replay_tokens(
    prompts: Sequence[str],
    block_size: int,
    capacity_blocks: int | None = None,
    salts: Sequence[str | None] | None = None,
    public_tokens: Sequence[int] | None = None,
    concurrency: int = 1,
    free_order: str = "vllm",
) -> HitStats:
    """Chains + replay in one call, on token strs."""
    t0 = time.perf_counter()
    chains = block_chains(prompts, block_size, salts, public_tokens)
    st = replay(
        chains, [len(p) for p in prompts], block_size, capacity_blocks, concurrency, free_order
    )
    st.seconds = time.perf_counter() - t0
    return st


def replay_block_manager(
    prompts: Sequence[str | Sequence[int]],
    block_size: int,
    capacity_blocks: int | None = None,
    salts: Sequence[str | None] | None = None,
    public_tokens: Sequence[int] | None = None,
    concurrency: int = 1,
    check: bool = True,
    free_order: str = "vllm",
) -> HitStats:
    """The same replay on kvlab's real Scheduler and BlockManager (slow, the reference); ``check``:
    invariants after."""
    from kvlab.engine.trace_replay import UNLIMITED_TOKENS, ScriptedScheduler
    t0, bs = time.perf_counter(), block_size
    toks = [[ord(c) for c in p] if isinstance(p, str) else list(p) for p in prompts]
    nb = pool_blocks([len(t) for t in toks], bs, capacity_blocks)
    bm = BlockManager(nb, bs, free_order=free_order)
    run = ScriptedScheduler(bm, max_num_seqs=concurrency, max_num_batched_tokens=UNLIMITED_TOKENS)
    fits = [cdiv(len(t), bs) <= nb for t in toks]
    waiting = deque(i for i, ok in enumerate(fits) if ok)  # too big: all miss, never run
    per = [0] * len(toks)
    while waiting or run.has_unfinished():
        while waiting and len(run.requests) < concurrency:
            i = waiting.popleft()
            run.add(i, toks[i], [0], cache_salt=salts[i] if salts is not None else None,
                    public_tokens=public_tokens[i] if public_tokens is not None else 0)
        for seq in run.step().first_token:
            per[seq.request_id] = seq.num_cached_tokens or 0
    if check:
        bm.check_invariants()
    return HitStats(bs, capacity_blocks, len(per), sum(map(len, toks)), sum(per), fits.count(False),
                    time.perf_counter() - t0, per)


def spot_check(
    prompts: Sequence[str],
    block_size: int,
    capacity_blocks: int | None,
    limit: int = 100,
    salts: Sequence[str | None] | None = None,
    public_tokens: Sequence[int] | None = None,
    concurrency: int = 1,
    free_order: str = "vllm",
) -> dict:
    """Replay the first ``limit`` requests both ways; return both hit counts and whether they
    agree."""
    head, s, p = (None if x is None else list(x[:limit]) for x in (prompts, salts, public_tokens))
    fast = replay_tokens(head, block_size, capacity_blocks, s, p, concurrency, free_order)
    ref = replay_block_manager(
        head, block_size, capacity_blocks, s, p, concurrency, check=False, free_order=free_order
    )
    return {"requests": len(head), "block_size": block_size, "capacity_blocks": capacity_blocks,
            "fast_hit_tokens": fast.hit_tokens, "block_manager_hit_tokens": ref.hit_tokens,
            "equal": fast.per_request == ref.per_request, "block_manager_seconds": ref.seconds}
