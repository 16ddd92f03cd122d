"""The physical KV-cache blocks: ref counts, an LRU free list, lazy eviction, and a per-block trace.

A block is taken from the head of the free list and comes back to its tail when its ref count drops
to 0 (a block that carries no hash, which can never be hit, goes back to the head: vLLM's order). A
full block keeps its hash while it sits in the free list, so a later request can revive it with a
cache hit (``hit``); only when the block is taken for new data is its hash dropped (lazy eviction).
The free list is therefore also the LRU eviction order, and it never holds a block that someone
still references: LRU can only evict blocks with ref count 0.

The cache maps a hash to the blocks registered under it. A lookup accepts a block only if its token
ids, its extra keys and its parent block (by ``serial``, a number given to each distinct cached
content) match, so a hash collision can never hand out another prefix's K/V.

The trace (``trace=True``), ``block_report`` and ``check_invariants`` are debugging aids, written in
``kvlab.cache.debug``.

References: vLLM ``vllm/v1/core/block_pool.py`` (``BlockPool``, ``get_new_blocks``, ``touch``,
``free_blocks``) and ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``,
``FreeKVCacheBlockQueue``); nano-vllm ``nanovllm/engine/block_manager.py`` (``Block``,
``free_block_ids``, ``hash_to_block_id``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from .debug import InvariantError, TraceEvent, block_report, check, check_pool, history
from .hashing import BlockHash, ExtraKeys
from .kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent

__all__ = ["Block", "BlockPool", "InvariantError", "NoFreeBlocksError", "TraceEvent", "check"]

FREE_ORDERS = ("vllm", "lru")
# remembered evicted hashes per block of the pool ...
EVICTED_HASHES_PER_BLOCK = 4
# ... and at least this many
MIN_EVICTED_HASHES = 1024


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is needed and every block is referenced."""


@dataclass(slots=True)
class Block:
    """One physical block: ``block_size`` slots of K/V, represented here by the token ids
    written."""

    block_id: int
    ref_count: int = 0
    # slot i holds token_ids[i]
    token_ids: list[int] = field(default_factory=list)
    # set while the block is registered in the cache
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    extra_keys: ExtraKeys = ()
    # names this exact content (prefix included); 0 = not cached
    serial: int = 0
    # serial of the block before it; 0 for a first block
    parent_serial: int = 0
    # pool clock when last taken from the free list
    created_at: int = 0
    # pool clock of the last take, hit, share or release
    last_access: int = 0
    # the tenant whose sequence registered it (set by the block manager; cross-tenant hit
    # accounting)
    tenant: Hashable = None

    def reset(self) -> None:
        """Forget the hash, keeping the tokens (the block leaves the cache); ``token_ids`` is the
        caller's."""
        self.block_hash = self.parent_hash = self.tenant = None
        self.extra_keys = ()
        self.serial = self.parent_serial = 0


class BlockPool:
    """``num_blocks`` blocks, a free list in LRU order, and the hash -> block cache.

    ``evicted_hashes`` remembers the hashes of evicted blocks, so a miss on one counts as
    ``evicted`` rather than ``no_prefix`` (``kvlab.cache.metrics``). It is bounded: it keeps the
    most recent ``max_evicted_hashes`` evictions (default ``max(4 * num_blocks, 1024)``, about 170
    bytes each), so a long-running pool's memory stays flat; a block evicted longer ago than that
    counts as ``no_prefix``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        trace: bool = False,
        free_order: str = "vllm",
        enable_kv_events: bool = False,
        max_evicted_hashes: int | None = None,
    ) -> None:
        if max_evicted_hashes is None and type(num_blocks) is int:
            max_evicted_hashes = max(EVICTED_HASHES_PER_BLOCK * num_blocks, MIN_EVICTED_HASHES)
        sizes = {"num_blocks": num_blocks, "block_size": block_size}
        for name, value in {**sizes, "max_evicted_hashes": max_evicted_hashes}.items():
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if free_order not in FREE_ORDERS:
            raise ValueError(f"free_order must be one of {FREE_ORDERS}, got {free_order!r}")
        self.free_order, self.block_size, self.num_blocks = free_order, block_size, num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # head = next victim
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, list[Block]] = {}
        # for classifying misses: the latest evicted hashes, oldest first, at most
        # max_evicted_hashes
        self.evicted_hashes: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_evicted_hashes = max_evicted_hashes
        self.trace: list[TraceEvent] | None = [] if trace else None
        self.clock = self.num_evictions = 0
        self._next_serial = 1
        # KV events (vLLM's schema, kvlab.cache.kv_events): the pool queues removals and clears, the
        # block manager queues stores (it knows which blocks one call caches together)
        self.enable_kv_events = enable_kv_events
        self.kv_event_queue: list[KVCacheEvent] = []
        # called with a cached block just before its eviction (contents still readable): a host
        # tier's seam
        self.on_evict: Callable[[Block], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (empty or cached-but-evictable)."""
        return len(self.free)

    def tick(self) -> int:
        """Advance the logical clock (one tick per manager operation) and return it."""
        self.clock += 1
        return self.clock

    def next_victim(self) -> int | None:
        """The block id that the next ``take`` would reuse (None when nothing is free)."""
        return next(iter(self.free), None)

    # --- taking and returning blocks -------------------------------------------------------------
    def take(self, owner: Hashable = None, event: str = "take") -> Block:
        """Take the least recently used free block, evicting its cached contents, with ref count
        1."""
        if not self.free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are referenced")
        block = self.blocks[next(iter(self.free))]
        if block.block_hash is not None:
            # before anything changes: a hook that raises leaves the pool as it was
            if self.on_evict is not None:
                self.on_evict(block)
            self.evicted_hashes[block.block_hash] = None
            self.evicted_hashes.move_to_end(block.block_hash)
            if len(self.evicted_hashes) > self.max_evicted_hashes:
                # forget the oldest eviction
                self.evicted_hashes.popitem(last=False)
            self.num_evictions += 1
            self._uncache(block, "evict", owner)
        del self.free[block.block_id]
        block.token_ids, block.ref_count = [], 1
        block.created_at = block.last_access = self.clock
        self._record(block, event, owner)
        return block

    def _check_own(self, block: Block) -> None:
        """Raise ``ValueError`` unless ``block`` is this pool's (not another pool's, not a copy)."""
        if block is not self.blocks[block.block_id % self.num_blocks]:
            raise ValueError(f"{block!r} is not a block of this pool")

    def hit(self, block: Block, owner: Hashable = None) -> None:
        """Reference a cached block found by ``lookup``; a free one leaves the free list."""
        self._check_own(block)
        if block.block_hash is None:
            raise ValueError(
                f"block {block.block_id} is not cached; only a cached block can be hit"
            )
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1
        block.last_access = self.clock
        self._record(block, "hit", owner)

    def release(self, block: Block, owner: Hashable = None) -> None:
        """Drop one reference; at 0 the block joins the free list: a cached block at the tail
        (evicted last).

        With ``free_order="vllm"`` (the default, as vLLM's ``BlockPool.free_blocks``) a block that
        carries no hash (a partial tail, which no request can ever hit) goes to the *head* instead,
        so it is reused before any cached block is evicted; ``"lru"`` puts every block at the tail.
        """
        self._check_own(block)
        if block.ref_count <= 0:
            raise ValueError(
                f"block {block.block_id} has ref count {block.ref_count}; double free?"
            )
        block.ref_count -= 1
        if block.ref_count == 0:
            # the tail: evicted last
            self.free[block.block_id] = None
            if block.block_hash is None and self.free_order == "vllm":
                # can never be hit: reuse it first
                self.free.move_to_end(block.block_id, last=False)
        block.last_access = self.clock
        self._record(block, "release", owner)

    def share(self, block: Block, owner: Hashable = None) -> None:
        """Add a reference to a block that is already in use (fork)."""
        self._check_own(block)
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} is not in use; cannot share it")
        block.ref_count += 1
        block.last_access = self.clock
        self._record(block, "share", owner)

    # --- the prefix cache ----------------------------------------------------------------------
    def lookup(
        self,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_serial: int,
        extra_keys: ExtraKeys = (),
    ) -> Block | None:
        """A cached block with this hash *and* these tokens, parent and extra keys, else None."""
        for block in self.cached.get(block_hash, ()):
            if (
                block.parent_serial == parent_serial
                and block.token_ids == token_ids
                and block.extra_keys == extra_keys
            ):
                return block
        return None

    def register(
        self,
        block: Block,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        parent_serial: int,
        extra_keys: ExtraKeys = (),
        owner: Hashable = None,
    ) -> None:
        """Put a full block in the cache under ``block_hash`` so later requests can hit it."""
        self._check_own(block)
        if len(block.token_ids) != self.block_size or block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is not a full, uncached block")
        twin = self.lookup(block_hash, block.token_ids, parent_serial, extra_keys)
        if twin is None:
            block.serial, self._next_serial = self._next_serial, self._next_serial + 1
        # same content computed twice: one serial, so children of either twin match
        else:
            block.serial = twin.serial
        block.block_hash, block.parent_hash = block_hash, parent_hash
        block.parent_serial, block.extra_keys = parent_serial, extra_keys
        self.cached.setdefault(block_hash, []).append(block)
        self.evicted_hashes.pop(block_hash, None)
        block.last_access = self.clock
        self._record(block, "register", owner)

    def _uncache(self, block: Block, event: str, owner: Hashable) -> None:
        """Drop ``block`` from the cache (``event``: evict or uncache), with its
        ``BlockRemoved``."""
        bucket = self.cached[block.block_hash]
        bucket.remove(block)
        if not bucket:
            del self.cached[block.block_hash]
        self.emit_event(BlockRemoved((block.block_hash,)))
        block.reset()
        block.last_access = self.clock
        self._record(block, event, owner)

    def uncache(self, block: Block, owner: Hashable = None) -> None:
        """Take a block out of the cache now, keeping its tokens and references (its K/V was never
        computed).

        The engine calls this (through ``BlockManager.free(..., uncache_from=...)``) for the blocks
        of a step that failed, so no later request can hit K/V that was never written. The hash is
        not remembered as evicted: the content was never really cached.
        """
        self._check_own(block)
        if block.block_hash is None:
            raise ValueError(f"{block!r} is not a cached block of this pool")
        self._uncache(block, "uncache", owner)

    def reset(self) -> bool:
        """Drop every cached hash, keeping the free list's order; refused (False) while any block is
        in use."""
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

    # --- KV events -------------------------------------------------------------------------------
    def emit_event(self, event: KVCacheEvent) -> None:
        """Queue a KV event for ``take_events`` (dropped when ``enable_kv_events`` is off).

        The pool emits ``BlockRemoved`` and ``AllBlocksCleared`` itself; the block manager emits
        ``BlockStored`` through here when it registers blocks, and a second tier its own events, so
        all share one ordered stream.
        """
        if self.enable_kv_events:
            self.kv_event_queue.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The queued KV events, oldest first, and an empty queue (vLLM's
        ``BlockPool.take_events``)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # --- debugging (kvlab.cache.debug) ------------------------------------------------------------
    def _record(self, block: Block, event: str, owner: Hashable) -> None:
        """Trace one event of ``block`` (a no-op unless the pool was made with ``trace=True``)."""
        if self.trace is not None:
            self.trace.append(TraceEvent(self.clock, block.block_id, event, block.ref_count, owner))

    def history(self, block_id: int) -> list[TraceEvent]:
        """Every traced event of one block, oldest first (needs ``trace=True``;
        ``debug.history``)."""
        return history(self, block_id)

    def block_report(self) -> list[dict]:
        """One row per block: ref count, created, last access, cached, free
        (``debug.block_report``)."""
        return block_report(self)

    def check_invariants(self, hash_fn: Callable | None = None) -> None:
        """Free list == blocks with ref 0; cache entries consistent (``debug.check_pool``)."""
        check_pool(self, hash_fn)
