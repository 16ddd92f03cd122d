"""Invariants and reports of the block pool, the block manager and their metrics: debugging aids and
what a notebook or ``/metrics`` reads, never on a step (pure Python).

``check_pool`` and ``check_manager`` are what ``BlockPool.check_invariants`` and
``BlockManager.check_invariants`` run (an engine with ``debug=True`` after every step, the tests
after every operation); ``read_tokens`` and ``block_report`` are the article's debug views;
``TraceEvent`` is one line of a pool's ``trace=True`` log, ``history`` one block's lines.
``manager_stats``, ``metrics_report`` and ``tenant_report`` are ``BlockManager.stats()``,
``PrefixCacheMetrics.as_dict()`` and ``PrefixCacheMetrics.tenant_table()``: the counters are kept
in ``kvlab.cache.metrics``, read out here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "OTHER_TENANTS",
    "InvariantError",
    "TraceEvent",
    "block_report",
    "check",
    "check_manager",
    "check_pool",
    "history",
    "manager_stats",
    "metrics_report",
    "read_tokens",
    "tenant_report",
]

# the tenant column of the row that sums the tenants pushed out of the per-tenant table
# (kvlab.cache.metrics)
OTHER_TENANTS = "(other tenants)"


class InvariantError(AssertionError):
    """Raised by ``check_invariants`` when the block bookkeeping is inconsistent."""


def check(condition: bool, message: str) -> None:
    """Raise ``InvariantError(message)`` unless ``condition`` holds (kept under ``python -O``)."""
    if not condition:
        raise InvariantError(message)


@dataclass(slots=True, frozen=True)
class TraceEvent:
    """One change in a block's life, for debugging ref-count leaks."""

    t: int
    block_id: int
    # take | cow-copy | hit | share | release | evict | register | uncache
    event: str
    # after the event
    ref_count: int
    # the sequence that caused it
    owner: Hashable


def history(pool: Any, block_id: int) -> list[TraceEvent]:
    """Every traced event of one block of ``pool``, oldest first (needs ``trace=True``)."""
    if pool.trace is None:
        raise RuntimeError("tracing is off: create the pool with trace=True")
    return [e for e in pool.trace if e.block_id == block_id]


def block_report(pool: Any) -> list[dict]:
    """One row per block of ``pool``: ref count, created, last access, cached, free; the article's
    debug marks."""
    return [
        {
            "block_id": b.block_id,
            "ref_count": b.ref_count,
            "created_at": b.created_at,
            "last_access": b.last_access,
            "idle_for": pool.clock - b.last_access,
            "cached": b.block_hash is not None,
            "free": b.block_id in pool.free,
            "tokens": len(b.token_ids),
        }
        for b in pool.blocks
    ]


def check_pool(pool: Any, hash_fn: Callable | None = None) -> None:
    """Free list == blocks with ref 0; cache entries consistent (recomputed with ``hash_fn``)."""
    check(
        len(pool.free) + sum(b.ref_count > 0 for b in pool.blocks) == pool.num_blocks,
        "blocks not conserved: free + in use != num_blocks",
    )
    for b in pool.blocks:
        check(b.ref_count >= 0, f"block {b.block_id} has negative ref count {b.ref_count}")
        check(
            (b.ref_count == 0) == (b.block_id in pool.free),
            f"block {b.block_id}: ref count {b.ref_count} but free={b.block_id in pool.free}",
        )
        check(len(b.token_ids) <= pool.block_size, f"block {b.block_id} overfull")
    n_cached = 0
    for h, bucket in pool.cached.items():
        check(len(bucket) > 0, "empty cache bucket")
        for b in bucket:
            n_cached += 1
            check(b.block_hash == h, f"block {b.block_id} cached under a hash it does not carry")
            check(len(b.token_ids) == pool.block_size, f"cached block {b.block_id} is not full")
            check(b.serial > 0, f"cached block {b.block_id} has no serial")
            if hash_fn is not None:
                check(
                    hash_fn(b.parent_hash, b.token_ids, b.extra_keys) == h,
                    f"cached block {b.block_id}: tokens do not match its hash",
                )
    check(
        n_cached == sum(b.block_hash is not None for b in pool.blocks),
        "a block carries a hash but is not in the cache",
    )


def read_tokens(manager: Any, seq_id: Hashable) -> list[int | None]:
    """What a sequence reads back through its block table (None for an empty slot)."""
    seq, bs, blocks = manager._seq(seq_id), manager.block_size, manager.pool.blocks
    out = []
    for p in range(len(seq.token_ids)):
        slots = blocks[seq.block_table[p // bs]].token_ids
        out.append(slots[p % bs] if p % bs < len(slots) else None)
    return out


def check_manager(manager: Any) -> None:
    """Raise ``InvariantError`` unless every ref count, table, cache entry and slot of a
    ``BlockManager`` agrees."""
    pool, bs = manager.pool, manager.block_size
    check_pool(pool, manager.hash_fn)
    refs = Counter(b for seq in manager.seqs.values() for b in seq.block_table)
    for block in pool.blocks:
        check(
            block.ref_count == refs[block.block_id],
            f"block {block.block_id}: ref count {block.ref_count} but {refs[block.block_id]} "
            f"block-table references (leak or double free)",
        )
    for seq in manager.seqs.values():
        n = len(seq.token_ids)
        check(
            len(seq.block_table) == -(-n // bs),
            f"sequence {seq.seq_id!r}: {len(seq.block_table)} blocks for {n} tokens",
        )
        check(
            read_tokens(manager, seq.seq_id) == seq.token_ids,
            f"sequence {seq.seq_id!r} reads other tokens than it wrote (a shared block was "
            "written)",
        )
        if manager.enable_caching:
            check(
                len(seq.block_hashes) == n // bs,
                f"sequence {seq.seq_id!r}: wrong number of block hashes",
            )
            for i in range(n // bs):
                block = pool.blocks[seq.block_table[i]]
                check(
                    block.block_hash == seq.block_hashes[i],
                    f"sequence {seq.seq_id!r}: full block {i} is not cached under its hash",
                )


# --- reports: the counters of kvlab.cache.metrics and the pool's state, read out ------------------
def _counts_row(c: Any) -> dict:
    """One ``CacheCounts`` as columns: requests, query and hit tokens, hit rate, misses."""
    return {
        "requests": c.requests,
        "query_tokens": c.queries,
        "hit_tokens": c.hits,
        "hit_rate": c.hit_rate,
        **{f"miss_{r}": n for r, n in c.misses.items()},
    }


def metrics_report(metrics: Any) -> dict:
    """``PrefixCacheMetrics.as_dict()``: the totals as one flat dict (for JSON and DataFrames)."""
    return {
        **_counts_row(metrics.total),
        "preempted_requests": metrics.preempted.requests,
        "preempted_query_tokens": metrics.preempted.queries,
        "preempted_hit_tokens": metrics.preempted.hits,
        "hashed_blocks": metrics.hashed_blocks,
        "hashed_tokens": metrics.hashed_tokens,
        "blocks_taken": metrics.blocks_taken,
        "blocks_hit": metrics.blocks_hit,
        "cow_copies": metrics.cow_copies,
        "public_hits": metrics.public_hits,
        "cross_tenant_hits": metrics.cross_tenant_hits,
    }


def tenant_report(metrics: Any) -> list[dict]:
    """``PrefixCacheMetrics.tenant_table()``: one row per tenant (and one ``OTHER_TENANTS`` row once
    tenants were pushed out): requests, tokens, misses."""
    rows = list(metrics.by_tenant.items())
    if metrics.other.requests:
        rows.append((OTHER_TENANTS, metrics.other))
    return [{"tenant": k, **_counts_row(c)} for k, c in rows]


def manager_stats(manager: Any) -> dict[str, Any]:
    """``BlockManager.stats()``: its metrics plus the pool's state: usage, free and cached blocks,
    evictions, wasted slots, tokens restored from a second tier."""
    pool = manager.pool
    return {
        **manager.metrics.as_dict(),
        "usage": manager.usage,
        "num_free_blocks": manager.num_free_blocks,
        "num_cached_blocks": sum(len(v) for v in pool.cached.values()),
        "evictions": pool.num_evictions,
        "wasted_slots": manager.wasted_slots(),
        "restored_tokens": manager.restored_tokens["offload"],
        "fetched_tokens": manager.restored_tokens["peer"],
    }
