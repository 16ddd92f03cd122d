"""Per-sequence block tables on top of the block pool: prefix hits, decode, fork with copy-on-write.

``allocate`` walks the prompt's full blocks through the cache and stops at the first miss, but never
serves the last prompt token from the cache (its logits are needed), so at most ``n - 1`` tokens
hit, rounded down to whole blocks. Every full block, from the prompt or filled during decode, is
registered in the cache the moment it is full. ``fork`` shares all blocks, including a partial tail;
the first write into a shared partial block copies it (copy-on-write) and reports ``(src, dst)`` so
an engine can copy the K/V tensors. ``free`` releases tail first, so the ends of chains are evicted
before their shared heads. Every public method either succeeds or raises with the state unchanged.

A second tier (``second_tier``, e.g. ``kvlab.cache.host_tier.TierLink``): when a prompt's chain
misses the pool, ``allocate`` asks the tier for the next blocks, one by one, and copies each one
found into the fresh block it takes for it instead of leaving it to be computed; it returns pool
hits plus those restored tokens (both are served without a forward) and counts the restored ones
apart (``SeqBlocks.num_restored_tokens``, ``stats``).

Tenants: a ``cache_salt`` enters the hash of one block (``hashing.salted_block``: block 0 by
default, as vLLM's), so a tenant's blocks from there on are its own while the blocks of an
operator's public prefix before it stay shared (a block straddling the boundary is private). Each
cached block remembers the tenant that registered it; a hit on another tenant's block is counted as
a *public* hit when it lies inside the public prefix and as a *cross-tenant* hit otherwise (0 under
salting).

Beside this file: ``interface`` (``SeqState``, the per-sequence queries, ``TenantScope``), ``fork``
(fork and copy-on-write), ``host_tier`` (the second tier and its restore), ``uncache``
(``free(..., uncache_from=)``), ``kv_events`` (``BlockStored``), ``debug`` (invariants and reports,
``stats``).

References: vLLM ``vllm/v1/core/kv_cache_manager.py`` (``get_computed_blocks``, ``allocate_slots``,
``free``) and ``vllm/v1/core/single_type_kv_cache_manager.py`` (``cache_blocks``); vLLM v0
``vllm/core/block/cpu_gpu_block_allocator.py`` (copy-on-write); nano-vllm
``nanovllm/engine/block_manager.py`` (``can_allocate``, ``allocate``, ``may_append``,
``deallocate``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .block_pool import Block, BlockPool, NoFreeBlocksError
from .debug import check_manager, manager_stats, read_tokens
from .fork import copy_on_write, fork_sequence
from .hashing import (
    DEFAULT_BLOCK_SIZE,
    BlockHash,
    HashFn,
    block_extra_keys,
    hash_block,
    prompt_block_hashes,
    salted_block,
)
from .host_tier import SecondTier, restore_block
from .interface import (
    MAX_TOKEN_ID,
    NO_SCOPE,
    DuplicateSequenceError,
    SeqState,
    SequenceTables,
    TenantScope,
    UnknownSequenceError,
    check_prompt,
    check_token,
)
from .kv_events import KVCacheEvent, emit_stored
from .metrics import PrefixCacheMetrics
from .uncache import uncached_blocks

__all__ = [
    "MAX_TOKEN_ID",
    "NO_SCOPE",
    "AllocationPlan",
    "AppendResult",
    "BlockManager",
    "DuplicateSequenceError",
    "NoFreeBlocksError",
    "SeqBlocks",
    "SeqState",
    "SequenceTables",
    "TenantScope",
    "UnknownSequenceError",
    "cdiv",
    "check_prompt",
]


def cdiv(n: int, d: int) -> int:
    """Ceiling division: the blocks of ``d`` slots needed for ``n`` tokens."""
    return -(-n // d)


@dataclass(slots=True, kw_only=True)
class SeqBlocks(SeqState):
    """A live sequence of the block manager: also the hashes of its full blocks and where its salt
    enters."""

    # one per full block
    block_hashes: list[BlockHash] = field(default_factory=list)
    # the block whose hash takes the salt (hashing.salted_block)
    salt_block: int = 0


@dataclass(slots=True, frozen=True)
class AllocationPlan:
    """What ``allocate`` would do for one prompt: its hashes, the blocks it would hit, why the rest
    misses, the blocks it needs."""

    tokens: tuple[int, ...]
    scope: TenantScope
    # one per full block of the prompt
    hashes: tuple[BlockHash, ...]
    # cached blocks of the longest prefix (capped at n - 1 tokens)
    hits: tuple[Block, ...]
    # the missed tokens by reason (kvlab.cache.metrics), as the pool stood when planned
    misses: dict[str, int]
    # free blocks allocation takes (new ones + hits revived from the free list)
    blocks_needed: int
    num_free_blocks: int
    # the pool's clock when planned: the plan is stale once anything changed
    clock: int
    # the planning manager: another one refuses the plan
    owner: object = field(default=None, repr=False, compare=False)

    def __bool__(self) -> bool:
        return self.blocks_needed <= self.num_free_blocks


@dataclass(slots=True, frozen=True)
class AppendResult:
    """What one decode write did: a newly taken block, and a copy-on-write ``(src, dst)`` pair."""

    new_block: int | None = None
    cow: tuple[int, int] | None = None


class BlockManager(SequenceTables):
    """Block tables for many sequences sharing one pool, with prefix caching and copy-on-write."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        model_fingerprint: str = "",
        hash_fn: HashFn = hash_block,
        enable_caching: bool = True,
        cow: bool = True,
        trace: bool = False,
        free_order: str = "vllm",
        enable_kv_events: bool = False,
    ) -> None:
        # BlockPool validates the sizes
        self.pool = BlockPool(
            num_blocks, block_size, trace, free_order=free_order, enable_kv_events=enable_kv_events
        )
        # blocks in the pool (``kvlab.cache.CacheManager``)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.model_fingerprint, self.hash_fn = model_fingerprint, hash_fn
        # cow=False: the article's "writable shared block" bug, kept for teaching
        self.enable_caching, self.cow = enable_caching, cow
        self.seqs: dict[Hashable, SeqBlocks] = {}
        self.metrics = PrefixCacheMetrics()
        # where evicted/fetched blocks wait (kvlab.cache.host_tier)
        self.second_tier: SecondTier | None = None
        # tokens restored from the second tier, by source
        self.restored_tokens: Counter = Counter()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (empty or cached-but-evictable)."""
        return len(self.pool.free)

    def can_allocate(
        self, token_ids: Sequence[int], scope: TenantScope = NO_SCOPE
    ) -> AllocationPlan:
        """What ``allocate`` would do, changing nothing: a plan that is truthy when enough blocks
        are free.

        The plan holds the prompt's full-block hashes, the cached blocks it would hit and why the
        rest misses; pass it to ``allocate(..., plan=plan)`` so the prompt is not hashed twice (it
        is used only while the pool is exactly as it was when planned; a plan is this manager's
        only: another manager refuses it).
        """
        tokens = check_prompt(token_ids, scope)
        bs, n, pool, fp = self.block_size, len(tokens), self.pool, self.model_fingerprint
        salt, salt_block = scope.cache_salt, salted_block(scope.public_tokens, bs)
        # one hash per full block; the cached blocks of the longest prefix
        hashes, hits = [], []
        if self.enable_caching:
            hashes = prompt_block_hashes(tokens, bs, fp, salt, salt_block, self.hash_fn)
            # the longest cached prefix, capped so that the last prompt token is recomputed
            for i in range((n - 1) // bs):
                keys = block_extra_keys(i, fp, salt, salt_block)
                block = pool.lookup(
                    hashes[i], tokens[i * bs : (i + 1) * bs], hits[-1].serial if i else 0, keys
                )
                if block is None:
                    break
                hits.append(block)
        # a missed full block that could have hit was evicted (or cut off from its chain by an
        # evicted parent) or never cached; the rest is short
        eligible, found = (n - 1) // bs, len(hits)
        seen = sum(h in pool.evicted_hashes or h in pool.cached for h in hashes[found:eligible])
        no_prefix, evicted = (eligible - found - seen) * bs, seen * bs
        misses = {"short": n - eligible * bs, "no_prefix": no_prefix, "evicted": evicted}
        # new blocks + cached hits that sit in the free list (reviving one uses a free slot too)
        needed = cdiv(n, bs) - len(hits) + sum(b.ref_count == 0 for b in hits)
        free, clock = len(pool.free), pool.clock
        # owner (self): another manager refuses this plan
        return AllocationPlan(
            tuple(tokens), scope, tuple(hashes), tuple(hits), misses, needed, free, clock, self
        )

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        scope: TenantScope = NO_SCOPE,
        *,
        plan: AllocationPlan | None = None,
        preempted: bool = False,
    ) -> int:
        """Give a new sequence its blocks, reusing the longest cached prefix; return the tokens not
        to compute.

        Those are the cached tokens, plus any restored from ``second_tier`` right after them
        (``SeqBlocks.num_restored_tokens``). ``scope.cache_salt`` enters the hash of block
        ``salted_block(scope.public_tokens, block_size)``; ``scope.label`` names the sequence in
        per-tenant metrics and in the cross-tenant hit count. ``plan``: what ``can_allocate``
        returned for the same prompt and scope (reused if nothing changed since, planned again if
        stale); a plan of another manager raises ``ValueError``, as a refusal changes nothing.
        ``preempted``: the sequence was preempted before (its lookup is counted apart, as vLLM
        does).
        """
        self._check_new(seq_id)
        plan = self._current_plan(plan, token_ids, scope)
        if not plan:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {plan.blocks_needed} free blocks, "
                f"{len(self.pool.free)} of {self.num_blocks} are free"
            )
        pool, bs, tokens, hits = self.pool, self.block_size, list(plan.tokens), plan.hits
        n, hashes = len(tokens), list(plan.hashes)
        pool.clock += 1
        seq = SeqBlocks(seq_id, tokens, cache_salt=scope.cache_salt, tenant=scope.label)
        seq.block_hashes, seq.salt_block = hashes, salted_block(scope.public_tokens, bs)
        # 1. the cached prefix: one more reference per hit block
        for i, block in enumerate(hits):
            pool.hit(block, seq_id)
            seq.block_table.append(block.block_id)
            if block.tenant != seq.tenant:
                self._count_foreign_hit(seq, i)
        seq.num_cached_tokens = len(hits) * bs
        # 2. the rest: a fresh block each, copied back from the second tier while the tier has the
        # chain
        restoring = self.enable_caching and self.second_tier is not None
        for i in range(len(hits), cdiv(n, bs)):
            block = pool.take(seq_id)
            block.token_ids = tokens[i * bs : (i + 1) * bs]
            seq.block_table.append(block.block_id)
            restoring = restoring and i < (n - 1) // bs and restore_block(self, seq, i, block)
            # 3. every full block is cached now, before its K/V is written (_cache_block)
            if self.enable_caching and i < n // bs:
                self._cache_block(seq, i, block, hashes[i])
        self.seqs[seq_id] = seq
        if pool.enable_kv_events:
            emit_stored(pool, hashes, len(hits), tokens[len(hits) * bs : len(hashes) * bs])
        self.metrics.record_blocks(len(hashes), bs, len(hits), len(seq.block_table) - len(hits))
        # the misses as planned: before this request filled the cache
        self.metrics.record_lookup(seq.tenant, n, seq.num_cached_tokens, plan.misses, preempted)
        return seq.num_cached_tokens + seq.num_restored_tokens

    def _current_plan(
        self, plan: AllocationPlan | None, token_ids: Sequence[int], scope: TenantScope
    ) -> AllocationPlan:
        """``plan`` while it still describes the pool (same clock, free count and cached hits), else
        a new one."""
        if plan is None:
            return self.can_allocate(token_ids, scope)
        if not isinstance(plan, AllocationPlan) or plan.owner is not self:
            raise ValueError(
                "this plan was not made by this manager's can_allocate (plans do not travel "
                "between managers: another pool's free blocks and cached hits are not this one's)"
            )
        pool = self.pool
        if (
            plan.clock == pool.clock
            and plan.num_free_blocks == len(pool.free)
            and plan.scope == scope
            and plan.tokens == tuple(token_ids)
            and all(b.block_hash == h for b, h in zip(plan.hits, plan.hashes))
        ):
            return plan
        return self.can_allocate(token_ids, scope)

    def _count_foreign_hit(self, seq: SeqBlocks, i: int) -> None:
        """A hit of ``seq`` on block ``i`` that another tenant registered: a public hit inside the
        public prefix (before the salted block), else a cross-tenant one (0 while tenants are
        salted)."""
        if i < seq.salt_block:
            self.metrics.public_hits += 1
        else:
            self.metrics.cross_tenant_hits += 1

    def _cache_block(self, seq: SeqBlocks, i: int, block: Block, h: BlockHash) -> None:
        """Register ``seq``'s full block ``i`` under hash ``h``: other requests can hit it from now
        on.

        Register before compute: the block is hittable now, before the engine has written its K/V.
        That is correct because an engine step writes every new token's K/V before any sequence
        reads (kvlab.engine.paged_attention), so a request that hits this block in the same step
        reads what this one writes (tests/engine/test_engine.py checks it).
        """
        parent = seq.block_hashes[i - 1] if i else None
        parent_serial = self.pool.blocks[seq.block_table[i - 1]].serial if i else 0
        keys = block_extra_keys(i, self.model_fingerprint, seq.cache_salt, seq.salt_block)
        self.pool.register(block, h, parent, parent_serial, keys, seq.seq_id)
        block.tenant = seq.tenant

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether the next ``append`` has the free block it may need."""
        seq, pool = self._seq(seq_id), self.pool
        # a block is needed when the last one is full, or shared (copy-on-write)
        full = len(seq.token_ids) % self.block_size == 0
        shared = self.cow and pool.blocks[seq.block_table[-1]].ref_count > 1
        return bool(pool.free) or not (full or shared)

    def copy_shared_block(self, seq: Any, shared: Any) -> Any:
        """``seq``'s private copy of the shared partial block it is about to write into
        (``fork.copy_on_write``); a method, so a subclass can replace it (notebook 04's leak)."""
        return copy_on_write(self, seq, shared)

    def append(self, seq_id: Hashable, token_id: int) -> AppendResult:
        """Write one decoded token: take a block if the last is full, copy it first if it is
        shared."""
        seq = self._seq(seq_id)
        check_token(token_id)
        if not self.can_append(seq_id):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs a block and none is free")
        pool, bs = self.pool, self.block_size
        i, offset = divmod(len(seq.token_ids), bs)
        full_hash = None
        # this token fills its block: hash it before changing anything
        if offset == bs - 1 and self.enable_caching:
            last = [] if offset == 0 else pool.blocks[seq.block_table[-1]].token_ids[:offset]
            keys = block_extra_keys(i, self.model_fingerprint, seq.cache_salt, seq.salt_block)
            full_hash = self.hash_fn(seq.block_hashes[-1] if i else None, last + [token_id], keys)
        pool.clock += 1
        new_block = cow = None
        if offset == 0:
            block = pool.take(seq_id)
            seq.block_table.append(new_block := block.block_id)
        else:
            block = pool.blocks[seq.block_table[-1]]
            if block.ref_count > 1 and self.cow:
                block, shared = self.copy_shared_block(seq, block), block
                cow = (shared.block_id, block.block_id)
        # appends; with cow=False a shared block may already hold this slot: it is overwritten
        block.token_ids[offset : offset + 1] = [token_id]
        seq.token_ids.append(token_id)
        if full_hash is not None and block.block_hash is None:
            # cache the block this token filled
            self._cache_block(seq, i, block, full_hash)
            seq.block_hashes.append(full_hash)
            self.metrics.record_blocks(1, bs)
            if pool.enable_kv_events:
                emit_stored(pool, seq.block_hashes, i, block.token_ids)
        return AppendResult(new_block, cow)

    def free(self, seq_id: Hashable, uncache_from: int | None = None) -> None:
        """Release a finished sequence's blocks, tail first, so chain tails are evicted first.

        ``uncache_from``: the K/V of the positions from there on was never computed (an engine step
        failed). The blocks holding them leave the prefix cache too, so no request can ever hit
        them; none of them may still be shared with another sequence (free that one first).
        """
        seq, pool = self._seq(seq_id), self.pool
        # the blocks whose K/V was never written (kvlab.cache.uncache), checked before any change
        doomed = [] if uncache_from is None else uncached_blocks(self, seq, uncache_from)
        pool.clock += 1
        for block in doomed:
            pool.uncache(block, seq_id)
        for block_id in reversed(seq.block_table):
            pool.release(pool.blocks[block_id], seq_id)
        del self.seqs[seq_id]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares every block
        (``kvlab.cache.fork``)."""
        fork_sequence(self, parent_id, child_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): refused, returning False,
        while a sequence holds blocks."""
        if self.seqs or not self.pool.reset():
            return False
        if self.second_tier is not None:
            self.second_tier.clear()
        return True

    def attach_second_tier(
        self, tier: SecondTier, on_evict: Callable[[Block], None] | None = None
    ) -> None:
        """Ask ``tier`` when a prompt misses the pool (``host_tier.restore_block``); ``on_evict``
        sees each cached block evicted."""
        self.second_tier = tier
        self.pool.on_evict = on_evict

    # --- KV events --------------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """KV events queued since the last call (needs ``enable_kv_events=True``; vLLM's
        ``take_events``)."""
        return self.pool.take_events()

    def emit_event(self, event: KVCacheEvent) -> None:
        """Queue a KV event of a tier attached to this cache, in one stream with the pool's (dropped
        if events are off)."""
        self.pool.emit_event(event)

    # --- reports and invariants (kvlab.cache.debug) -----------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence."""
        return 1.0 - len(self.pool.free) / self.num_blocks

    def wasted_slots(self) -> int:
        """Empty slots in blocks that are in use (the partial tail blocks)."""
        return sum(self.block_size - len(b.token_ids) for b in self.pool.blocks if b.ref_count > 0)

    def stats(self) -> dict[str, Any]:
        """Metrics plus the pool's state: usage, free and cached blocks, evictions, wasted slots
        (``debug.manager_stats``)."""
        return manager_stats(self)

    def read_tokens(self, seq_id: Hashable) -> list[int | None]:
        """What the sequence reads back through its block table (None for an empty slot)."""
        return read_tokens(self, seq_id)

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every ref count, table, cache entry and slot is
        consistent."""
        check_manager(self)
