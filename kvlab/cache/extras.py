"""What the block pool and block manager do off a default ``Engine.generate``: each part runs only when its
feature is used (a step failed, ``n > 1`` samples, a second tier, KV events, tracing, a reset, a debug query).

- ``TableExtras`` (``SequenceTables``, so also ``RadixCache``): the radix cache's token check,
  ``num_cached_tokens`` and ``slot_mapping`` (lessons and diagrams).
- ``PoolExtras`` (``BlockPool``): the per-block trace (``trace=True``), ``tick``, ``uncache`` (a failed step),
  ``reset``, ``share`` (fork), ``next_victim``, the KV-event queue (``enable_kv_events=True``), ``history``,
  ``block_report`` and ``check_invariants``.
- ``ManagerExtras`` (``BlockManager``): the debug reports (``usage``, ``read_tokens``, ``wasted_slots``,
  ``stats``), the KV-event queue and ``BlockStored``, the second tier (``attach_second_tier``, restore on a
  pool miss), a hit on another tenant's block, ``free(..., uncache_from=)``, ``reset_prefix_cache``, fork and
  copy-on-write, and ``check_invariants``.

They are mixins: ``kvlab.cache.block_pool`` and ``kvlab.cache.block_manager`` define the state they read.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from .hashing import block_extra_keys
from .kv_events import AllBlocksCleared, BlockStored, KVCacheEvent

__all__ = [
    "InvariantError",
    "ManagerExtras",
    "PoolExtras",
    "TableExtras",
    "TraceEvent",
    "check",
]


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


class TableExtras:
    """``SequenceTables``' token check (``RadixCache.append``) and the queries of lessons and diagrams."""

    @staticmethod
    def _check_token(token_id: int) -> None:
        if type(token_id) is not int:
            raise TypeError("token ids must be ints")
        if not 0 <= token_id < 2**63:
            # kvlab.cache.block_manager.MAX_TOKEN_ID
            raise ValueError(f"token ids must be in [0, 2**63), got {token_id}")

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """Prompt tokens this sequence took from the cache at ``allocate``."""
        return self._seq(seq_id).num_cached_tokens

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Physical slot (block_id * block_size + offset) of each position in ``[start, end)``."""
        seq, bs = self._seq(seq_id), self.block_size
        n = len(seq.token_ids)
        end = n if end is None else end
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= n:
            raise ValueError(
                f"positions [{start!r}, {end!r}) are not within the sequence's {n} tokens"
            )
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]


class PoolExtras:
    """``BlockPool``'s trace, reports, fork reference, KV-event queue and invariant check."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (empty or cached-but-evictable)."""
        return len(self.free)

    def _record(self, block: Any, event: str, owner: Hashable) -> None:
        """Trace one event of ``block`` (a no-op unless the pool was made with ``trace=True``)."""
        if self.trace is not None:
            self.trace.append(TraceEvent(self.clock, block.block_id, event, block.ref_count, owner))

    def tick(self) -> int:
        """Advance the logical clock (one tick per manager operation) and return it."""
        self.clock += 1
        return self.clock

    def uncache(self, block: Any, owner: Hashable = None) -> None:
        """Take a block out of the cache now, keeping its tokens and references (its K/V was never computed).

        The engine calls this (through ``BlockManager.free(..., uncache_from=...)``) for the blocks of a
        step that failed, so no later request can hit K/V that was never written. The hash is not
        remembered as evicted: the content was never really cached.
        """
        if block is not self.blocks[block.block_id % self.num_blocks] or block.block_hash is None:
            raise ValueError(f"{block!r} is not a cached block of this pool")
        self._uncache(block, "uncache", owner)

    def reset(self) -> bool:
        """Drop every cached hash, keeping the free list's order; refused (False) while any block is in use."""
        if any(b.ref_count for b in self.blocks):
            return False
        self.clock += 1
        for block in self.blocks:
            block.reset()
            block.token_ids = []
        self.cached.clear()
        self.evicted_hashes.clear()
        self.emit_event(AllBlocksCleared())
        return True

    def share(self, block: Any, owner: Hashable = None) -> None:
        """Add a reference to a block that is already in use (fork)."""
        if block is not self.blocks[block.block_id % self.num_blocks]:
            raise ValueError(f"{block!r} is not a block of this pool")
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} is not in use; cannot share it")
        block.ref_count += 1
        block.last_access = self.clock
        self._record(block, "share", owner)

    def next_victim(self) -> int | None:
        """The block id that the next ``take`` would reuse (None when nothing is free)."""
        return next(iter(self.free), None)

    def emit_event(self, event: KVCacheEvent) -> None:
        """Queue a KV event for ``take_events`` (dropped when ``enable_kv_events`` is off).

        The pool emits ``BlockRemoved`` and ``AllBlocksCleared`` itself; the block manager emits ``BlockStored``
        through here when it registers blocks, and a second tier its own events, so all share one ordered stream.
        """
        if self.enable_kv_events:
            self.kv_event_queue.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The queued KV events, oldest first, and an empty queue (vLLM's ``BlockPool.take_events``)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def history(self, block_id: int) -> list[TraceEvent]:
        """Every traced event of one block, oldest first (needs ``trace=True``)."""
        if self.trace is None:
            raise RuntimeError("tracing is off: create the pool with trace=True")
        return [e for e in self.trace if e.block_id == block_id]

    def block_report(self) -> list[dict]:
        """One row per block: ref count, created, last access, cached, free; the article's debug marks."""
        return [
            {
                "block_id": b.block_id,
                "ref_count": b.ref_count,
                "created_at": b.created_at,
                "last_access": b.last_access,
                "idle_for": self.clock - b.last_access,
                "cached": b.block_hash is not None,
                "free": b.block_id in self.free,
                "tokens": len(b.token_ids),
            }
            for b in self.blocks
        ]

    def check_invariants(self, hash_fn: Callable | None = None) -> None:
        """Free list == blocks with ref 0; cache entries consistent (recomputed with ``hash_fn``)."""
        check(
            len(self.free) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks,
            "blocks not conserved: free + in use != num_blocks",
        )
        for b in self.blocks:
            check(b.ref_count >= 0, f"block {b.block_id} has negative ref count {b.ref_count}")
            check(
                (b.ref_count == 0) == (b.block_id in self.free),
                f"block {b.block_id}: ref count {b.ref_count} but free={b.block_id in self.free}",
            )
            check(len(b.token_ids) <= self.block_size, f"block {b.block_id} overfull")
        n_cached = 0
        for h, bucket in self.cached.items():
            check(len(bucket) > 0, "empty cache bucket")
            for b in bucket:
                n_cached += 1
                check(
                    b.block_hash == h, f"block {b.block_id} cached under a hash it does not carry"
                )
                check(len(b.token_ids) == self.block_size, f"cached block {b.block_id} is not full")
                check(b.serial > 0, f"cached block {b.block_id} has no serial")
                if hash_fn is not None:
                    check(
                        hash_fn(b.parent_hash, b.token_ids, b.extra_keys) == h,
                        f"cached block {b.block_id}: tokens do not match its hash",
                    )
        check(
            n_cached == sum(b.block_hash is not None for b in self.blocks),
            "a block carries a hash but is not in the cache",
        )


class ManagerExtras:
    """``BlockManager``'s fork, second tier, KV events, reset, debug reports and invariant check."""

    # --- debug reports ------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence."""
        return 1.0 - len(self.pool.free) / self.num_blocks

    def read_tokens(self, seq_id: Hashable) -> list[int | None]:
        """What the sequence reads back through its block table (None for an empty slot)."""
        seq, bs, blocks = self._seq(seq_id), self.block_size, self.pool.blocks
        out = []
        for p in range(len(seq.token_ids)):
            slots = blocks[seq.block_table[p // bs]].token_ids
            out.append(slots[p % bs] if p % bs < len(slots) else None)
        return out

    def wasted_slots(self) -> int:
        """Empty slots in blocks that are in use (the partial tail blocks)."""
        return sum(self.block_size - len(b.token_ids) for b in self.pool.blocks if b.ref_count > 0)

    def stats(self) -> dict:
        """Metrics plus the pool's state: usage, free and cached blocks, evictions, wasted slots."""
        return {
            **self.metrics.as_dict(),
            "usage": self.usage,
            "num_free_blocks": self.num_free_blocks,
            "num_cached_blocks": sum(len(v) for v in self.pool.cached.values()),
            "evictions": self.pool.num_evictions,
            "wasted_slots": self.wasted_slots(),
            "restored_tokens": self.restored_tokens["offload"],
            "fetched_tokens": self.restored_tokens["peer"],
        }

    # --- KV events and the second tier ---------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """KV events queued since the last call (needs ``enable_kv_events=True``; vLLM's ``take_events``)."""
        return self.pool.take_events()

    def emit_event(self, event: KVCacheEvent) -> None:
        """Queue a KV event of a tier attached to this cache, in one stream with the pool's (dropped if events are off)."""
        self.pool.emit_event(event)

    def attach_second_tier(self, tier: Any, on_evict: Callable[[Any], None] | None = None) -> None:
        """Ask ``tier`` when a prompt misses the pool (``second_tier``); ``on_evict`` sees each cached block evicted."""
        self.second_tier = tier
        self.pool.on_evict = on_evict

    def _count_foreign_hit(self, public: bool) -> None:
        """A hit on a block another tenant registered: a public hit inside the public prefix, else cross-tenant."""
        if public:
            self.metrics.public_hits += 1
        else:
            self.metrics.cross_tenant_hits += 1

    def _emit_stored(self, hashes: list, first: int, tokens: list[int]) -> None:
        """One ``BlockStored`` for full blocks ``first, first + 1, ...`` just cached, holding ``tokens`` (vLLM's
        order; the manager calls this only with ``enable_kv_events=True``)."""
        end = first + len(tokens) // self.block_size
        if first < end:
            parent = hashes[first - 1] if first else None
            stored = BlockStored(tuple(hashes[first:end]), parent, tuple(tokens), self.block_size)
            self.pool.emit_event(stored)

    def _restore(self, seq: Any, i: int, block: Any) -> bool:
        """Copy prompt block ``i`` back from the second tier into ``block``; whether the tier had it."""
        h = seq.block_hashes
        source = self.second_tier.load(
            h[i],
            tuple(block.token_ids),
            block_extra_keys(i, self.model_fingerprint, seq.salt, seq.salt_block),
            h[i - 1] if i else None,
            block.block_id,
        )
        if source is not None:
            seq.num_restored_tokens += self.block_size
            self.restored_tokens[source] += self.block_size
        return source is not None

    def _uncached_blocks(self, seq: Any, uncache_from: int) -> list:
        """``free(..., uncache_from=)``: the cached blocks from that position on, none shared (else raise)."""
        n, doomed = len(seq.token_ids), []
        if type(uncache_from) is not int or not 0 <= uncache_from <= n:
            raise ValueError(f"uncache_from must be an int in [0, {n}], got {uncache_from!r}")
        for block_id in seq.block_table[uncache_from // self.block_size :]:
            block = self.pool.blocks[block_id]
            if block.block_hash is not None and block.ref_count > 1:
                raise ValueError(
                    f"block {block_id} (positions from {uncache_from} on) is still used by "
                    "another sequence: free that sequence first"
                )
            if block.block_hash is not None:
                doomed.append(block)
        return doomed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): refused, returning False, while a sequence holds blocks."""
        if self.seqs or not self.pool.reset():
            return False
        if self.second_tier is not None:
            self.second_tier.clear()
        return True

    # --- fork and copy-on-write ----------------------------------------------------------------------
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares every block (no copying yet)."""
        parent = self._seq(parent_id)
        self._check_new(child_id)
        self.pool.clock += 1
        for block_id in parent.block_table:
            self.pool.share(self.pool.blocks[block_id], child_id)
        self.seqs[child_id] = dataclasses.replace(
            parent,
            seq_id=child_id,
            token_ids=list(parent.token_ids),
            block_table=list(parent.block_table),
            block_hashes=list(parent.block_hashes),
            num_restored_tokens=0,
        )

    def _copy_on_write(self, seq: Any, shared: Any) -> Any:
        """Move ``seq`` off a shared partial block onto a private copy of it (``append`` writes into it)."""
        copy = self.pool.take(seq.seq_id, event="cow-copy")
        copy.token_ids = shared.token_ids[: len(seq.token_ids) % self.block_size]
        seq.block_table[-1] = copy.block_id
        self.pool.release(shared, seq.seq_id)
        self.metrics.cow_copies += 1
        return copy

    # --- invariants ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every ref count, table, cache entry and slot is consistent."""
        self.pool.check_invariants(self.hash_fn)
        refs = Counter(b for seq in self.seqs.values() for b in seq.block_table)
        for block in self.pool.blocks:
            check(
                block.ref_count == refs[block.block_id],
                f"block {block.block_id}: ref count {block.ref_count} but {refs[block.block_id]} "
                f"block-table references (leak or double free)",
            )
        bs = self.block_size
        for seq in self.seqs.values():
            n = len(seq.token_ids)
            check(
                len(seq.block_table) == -(-n // bs),
                f"sequence {seq.seq_id!r}: {len(seq.block_table)} blocks for {n} tokens",
            )
            check(
                self.read_tokens(seq.seq_id) == seq.token_ids,
                f"sequence {seq.seq_id!r} reads other tokens than it wrote (a shared block was written)",
            )
            if self.enable_caching:
                check(
                    len(seq.block_hashes) == n // bs,
                    f"sequence {seq.seq_id!r}: wrong number of block hashes",
                )
                for i in range(n // bs):
                    block = self.pool.blocks[seq.block_table[i]]
                    check(
                        block.block_hash == seq.block_hashes[i],
                        f"sequence {seq.seq_id!r}: full block {i} is not cached under its hash",
                    )
