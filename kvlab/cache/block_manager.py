"""Per-sequence block tables on top of the block pool: prefix hits, decode, fork with copy-on-write.

``allocate`` walks the prompt's full blocks through the cache and stops at the first miss, but never
serves the last prompt token from the cache (its logits are needed), so at most ``n - 1`` tokens
hit, rounded down to whole blocks. Every full block, from the prompt or filled during decode, is
registered in the cache the moment it is full. ``fork`` shares all blocks, including a partial tail;
the first write into a shared partial block copies it (copy-on-write) and reports ``(src, dst)`` so an
engine can copy the K/V tensors. ``free`` releases tail first, so the ends of chains are evicted
before their shared heads. Every public method either succeeds or raises with the state unchanged.

A second tier (``second_tier``, e.g. ``kvlab.cache.host_tier.TierLink``): when a prompt's chain misses the pool,
``allocate`` asks the tier for the next blocks, one by one, and copies each one found into the fresh block it
takes for it instead of leaving it to be computed; it returns pool hits plus those restored tokens (both are
served without a forward) and counts the restored ones apart (``SeqBlocks.num_restored_tokens``, ``stats``).

Tenants: a ``salt`` enters the hash of block ``public_tokens // block_size`` (block 0 by default, as
vLLM's ``cache_salt``), so a tenant's blocks from there on are its own while the blocks of an operator's
public prefix before it stay shared (a block straddling the boundary is private). Each cached block
remembers the tenant that registered it; a hit on another tenant's block is counted as a *public*
hit when it lies inside the public prefix and as a *cross-tenant* hit otherwise (0 under salting).

What a default ``Engine.generate`` never runs lives in ``kvlab.cache.extras.ManagerExtras``: fork and
copy-on-write, the second tier's restore, the KV-event queue, debug reports and ``check_invariants``.

References: vLLM ``vllm/v1/core/kv_cache_manager.py`` (``get_computed_blocks``, ``allocate_slots``,
``free``) and ``vllm/v1/core/single_type_kv_cache_manager.py`` (``cache_blocks``); vLLM v0
``vllm/core/block/cpu_gpu_block_allocator.py`` (copy-on-write); nano-vllm
``nanovllm/engine/block_manager.py`` (``can_allocate``, ``allocate``, ``may_append``, ``deallocate``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .block_pool import Block, BlockPool, NoFreeBlocksError
from .extras import ManagerExtras, TableExtras
from .hashing import (
    DEFAULT_BLOCK_SIZE,
    BlockHash,
    HashFn,
    block_extra_keys,
    hash_block,
    prompt_block_hashes,
)
from .host_tier import SecondTier
from .metrics import PrefixCacheMetrics

__all__ = [
    "NO_SCOPE",
    "AllocationPlan",
    "AppendResult",
    "BlockManager",
    "DuplicateSequenceError",
    "NoFreeBlocksError",
    "SeqBlocks",
    "TenantScope",
    "UnknownSequenceError",
    "cdiv",
]


# token ids are hashed as int64: every id must be in [0, MAX_TOKEN_ID)
MAX_TOKEN_ID = 2**63


class UnknownSequenceError(LookupError):
    """Raised for a sequence id the manager does not hold (never allocated, or already freed)."""


class DuplicateSequenceError(ValueError):
    """Raised when allocating or forking into a sequence id that is already live."""


@dataclass(slots=True)
class SeqState:
    """What every cache keeps of a live sequence (``kvlab.cache.CacheSeq``): tokens, table, counts, tenant."""

    seq_id: Hashable
    token_ids: list[int]
    # logical block i -> physical block id
    block_table: list[int] = field(default_factory=list)
    salt: str | None = None
    # who this sequence serves (metrics, cross-tenant accounting)
    tenant: Hashable = None
    # prompt tokens hit in the cache at allocate
    num_cached_tokens: int = 0
    # prompt tokens copied back from a second tier at allocate (not computed; 0 without one)
    num_restored_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class SeqBlocks(SeqState):
    """A live sequence of the block manager: also the hashes of its full blocks and where its salt enters."""

    # one per full block
    block_hashes: list[BlockHash] = field(default_factory=list)
    # the block whose hash takes the salt: the first past the public prefix
    salt_block: int = 0


class SequenceTables(TableExtras):
    """The per-sequence API every cache shares: ``seqs`` by id, block tables, slots, the new-id and token checks
    (those off the default path in ``kvlab.cache.extras.TableExtras``).

    A cache sets ``seqs`` (id -> ``SeqState``) and ``block_size``; ``BlockManager`` and ``RadixCache`` inherit this.
    """

    seqs: dict[Hashable, SeqState]
    block_size: int

    def _seq(self, seq_id: Hashable) -> SeqState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id!r} (never allocated, or already freed)"
            ) from None

    def _check_new(self, seq_id: Hashable) -> None:
        if seq_id in self.seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of a sequence, in logical order."""
        return list(self._seq(seq_id).block_table)


def cdiv(n: int, d: int) -> int:
    """Ceiling division: the blocks of ``d`` slots needed for ``n`` tokens."""
    return -(-n // d)


@dataclass(slots=True, frozen=True)
class TenantScope:
    """Whose cached blocks a sequence may share: its salt, the public prefix before it, and its label.

    ``salt`` enters the hash of block ``public_tokens // block_size`` (block 0 by default, like vLLM's
    ``cache_salt``): from there on a tenant's blocks are its own, the whole blocks of an operator's public
    prefix before it stay shared. ``tenant`` labels the sequence in per-tenant metrics (default: the salt).
    """

    salt: str | None = None
    public_tokens: int = 0
    tenant: Hashable = None
    # the name metrics use: the tenant, or the salt when no tenant is given (set from the fields)
    label: Hashable = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.salt is not None and not isinstance(self.salt, str):
            raise TypeError(f"salt must be a str or None, got {type(self.salt).__name__}")
        if type(self.public_tokens) is not int or self.public_tokens < 0:
            raise ValueError(f"public_tokens must be an int >= 0, got {self.public_tokens!r}")
        try:
            # a key of the per-tenant metrics
            hash(self.tenant)
        except TypeError:
            raise TypeError(f"tenant must be hashable, got {type(self.tenant).__name__}") from None
        object.__setattr__(self, "label", self.salt if self.tenant is None else self.tenant)


# no salt, no public prefix: every request may hit every cached block
NO_SCOPE = TenantScope()


def check_prompt(
    token_ids: Sequence[int], scope: TenantScope = NO_SCOPE, what: str = "a prompt"
) -> list[int]:
    """``token_ids`` as a list, or a clear error: at least one token, plain ints in [0, MAX_TOKEN_ID), and
    ``scope``'s public prefix within it (every cache runs this before it looks anything up)."""
    if not isinstance(scope, TenantScope):
        raise TypeError(f"scope must be a TenantScope, got {type(scope).__name__}")
    tokens = list(token_ids)
    if not tokens:
        raise ValueError(f"{what} needs at least one token")
    if any(type(t) is not int for t in tokens):
        raise TypeError("token ids must be ints")
    if min(tokens) < 0 or max(tokens) >= MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, 2**63), got {min(tokens)} .. {max(tokens)}")
    if not 0 <= scope.public_tokens <= len(tokens):
        raise ValueError(
            f"public_tokens must be in [0, {len(tokens)}], got {scope.public_tokens!r}"
        )
    return tokens


@dataclass(slots=True, frozen=True)
class AllocationPlan:
    """What ``allocate`` would do for one prompt: its hashes, the blocks it would hit, the blocks it needs."""

    tokens: tuple[int, ...]
    scope: TenantScope
    # one per full block of the prompt
    hashes: tuple[BlockHash, ...]
    # cached blocks of the longest prefix (capped at n - 1 tokens)
    hits: tuple[Block, ...]
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


class BlockManager(SequenceTables, ManagerExtras):
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
        """What ``allocate`` would do, changing nothing: a plan that is truthy when enough blocks are free.

        The plan holds the prompt's full-block hashes and the cached blocks it would hit; pass it to
        ``allocate(..., plan=plan)`` so the prompt is not hashed twice (it is used only while the pool is
        exactly as it was when planned; a plan is this manager's only: another manager refuses it).
        """
        tokens = check_prompt(token_ids, scope)
        bs, n, pool, fp = self.block_size, len(tokens), self.pool, self.model_fingerprint
        salt_block = scope.public_tokens // bs
        # one hash per full block; the cached blocks of the longest prefix
        hashes, hits = [], []
        if self.enable_caching:
            hashes = prompt_block_hashes(tokens, bs, fp, scope.salt, salt_block, self.hash_fn)
            # the longest cached prefix, capped so that the last prompt token is recomputed
            for i in range((n - 1) // bs):
                keys = block_extra_keys(i, fp, scope.salt, salt_block)
                block = pool.lookup(
                    hashes[i], tokens[i * bs : (i + 1) * bs], hits[-1].serial if i else 0, keys
                )
                if block is None:
                    break
                hits.append(block)
        # new blocks + cached hits that sit in the free list (reviving one uses a free slot too)
        needed = cdiv(n, bs) - len(hits) + sum(b.ref_count == 0 for b in hits)
        free, clock = len(pool.free), pool.clock
        # owner (self): another manager refuses this plan
        return AllocationPlan(
            tuple(tokens), scope, tuple(hashes), tuple(hits), needed, free, clock, self
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
        """Give a new sequence its blocks, reusing the longest cached prefix; return the tokens not to compute.

        Those are the cached tokens, plus any restored from ``second_tier`` right after them
        (``SeqBlocks.num_restored_tokens``). ``scope.salt`` enters the hash of block
        ``scope.public_tokens // block_size``; ``scope.label`` names the sequence in per-tenant metrics and
        in the cross-tenant hit count. ``plan``: what ``can_allocate`` returned for the same prompt and scope
        (reused if nothing changed since, planned again if stale); a plan of another manager raises
        ``ValueError``, as a refusal changes nothing. ``preempted``: the sequence was preempted before (its
        lookup is counted apart, as vLLM does).
        """
        self._check_new(seq_id)
        if plan is not None and (not isinstance(plan, AllocationPlan) or plan.owner is not self):
            raise ValueError(
                "this plan was not made by this manager's can_allocate (plans do not travel between "
                "managers: another pool's free blocks and cached hits are not this one's)"
            )
        pool, bs = self.pool, self.block_size
        # a plan holds while it still describes the pool: same clock, free count and cached hits
        if plan is None or not (
            plan.clock == pool.clock
            and plan.num_free_blocks == len(pool.free)
            and plan.scope == scope
            and plan.tokens == tuple(token_ids)
            and all(b.block_hash == h for b, h in zip(plan.hits, plan.hashes))
        ):
            plan = self.can_allocate(token_ids, scope)
        if not plan:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {plan.blocks_needed} free blocks, {len(pool.free)} of "
                f"{self.num_blocks} are free"
            )
        tokens, hashes, hits, n = list(plan.tokens), list(plan.hashes), plan.hits, len(plan.tokens)
        # missed tokens by reason, before this request fills the cache: a full block that could have hit
        # was evicted (or cut off from its chain by an evicted parent) or never cached; the rest is short
        eligible = (n - 1) // bs
        evicted, cached = pool.evicted_hashes, pool.cached
        seen = sum(h in evicted or h in cached for h in hashes[len(hits) : eligible])
        short, no_prefix = n - eligible * bs, (eligible - len(hits) - seen) * bs
        misses = {"short": short, "no_prefix": no_prefix, "evicted": seen * bs}
        pool.clock += 1
        seq = SeqBlocks(seq_id, tokens, salt=scope.salt, tenant=scope.label, block_hashes=hashes)
        seq.num_cached_tokens, seq.salt_block = len(hits) * bs, scope.public_tokens // bs
        for i, block in enumerate(hits):
            pool.hit(block, seq_id)
            seq.block_table.append(block.block_id)
            # another tenant's block: a public hit inside the public prefix, else a cross-tenant one
            if block.tenant != seq.tenant:
                self._count_foreign_hit(i < seq.salt_block)
        restoring = self.enable_caching and self.second_tier is not None
        for i in range(len(hits), cdiv(n, bs)):
            block = pool.take(seq_id)
            block.token_ids = tokens[i * bs : (i + 1) * bs]
            seq.block_table.append(block.block_id)
            # the chain continues in the second tier? copy it back; its first miss ends it
            restoring = restoring and i < eligible and self._restore(seq, i, block)
            if self.enable_caching and i < n // bs:
                self._cache_block(seq, i, block, hashes[i])
        self.seqs[seq_id] = seq
        if pool.enable_kv_events:
            self._emit_stored(hashes, len(hits), tokens[len(hits) * bs : len(hashes) * bs])
        self.metrics.record_blocks(len(hashes), bs, len(hits), len(seq.block_table) - len(hits))
        self.metrics.record_lookup(seq.tenant, n, seq.num_cached_tokens, misses, preempted)
        return seq.num_cached_tokens + seq.num_restored_tokens

    def _cache_block(self, seq: SeqBlocks, i: int, block: Block, h: BlockHash) -> None:
        """Register ``seq``'s full block ``i`` under hash ``h``: other requests can hit it from now on.

        Register before compute: the block is hittable now, before the engine has written its K/V. That is
        correct because an engine step writes every new token's K/V before any sequence reads
        (kvlab.engine.paged_attention), so a request that hits this block in the same step reads what this
        one writes (tests/engine/test_engine.py checks it).
        """
        parent = seq.block_hashes[i - 1] if i else None
        parent_serial = self.pool.blocks[seq.block_table[i - 1]].serial if i else 0
        keys = block_extra_keys(i, self.model_fingerprint, seq.salt, seq.salt_block)
        self.pool.register(block, h, parent, parent_serial, keys, seq.seq_id)
        block.tenant = seq.tenant

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether the next ``append`` has the free block it may need."""
        seq, pool = self._seq(seq_id), self.pool
        # a block is needed when the last one is full, or shared (copy-on-write)
        full = len(seq.token_ids) % self.block_size == 0
        shared = self.cow and pool.blocks[seq.block_table[-1]].ref_count > 1
        return bool(pool.free) or not (full or shared)

    def append(self, seq_id: Hashable, token_id: int) -> AppendResult:
        """Write one decoded token: take a block if the last is full, copy it first if it is shared."""
        seq = self._seq(seq_id)
        if type(token_id) is not int:
            raise TypeError("token ids must be ints")
        if not 0 <= token_id < MAX_TOKEN_ID:
            raise ValueError(f"token ids must be in [0, 2**63), got {token_id}")
        if not self.can_append(seq_id):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs a block and none is free")
        pool, bs = self.pool, self.block_size
        i, offset = divmod(len(seq.token_ids), bs)
        full_hash = None
        # this token fills its block: hash it before changing anything
        if offset == bs - 1 and self.enable_caching:
            last = [] if offset == 0 else pool.blocks[seq.block_table[-1]].token_ids[:offset]
            keys = block_extra_keys(i, self.model_fingerprint, seq.salt, seq.salt_block)
            full_hash = self.hash_fn(seq.block_hashes[-1] if i else None, last + [token_id], keys)
        pool.clock += 1
        new_block = cow = None
        if offset == 0:
            block = pool.take(seq_id)
            seq.block_table.append(new_block := block.block_id)
        else:
            block = pool.blocks[seq.block_table[-1]]
            if block.ref_count > 1 and self.cow:
                block, shared = self._copy_on_write(seq, block), block
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
                self._emit_stored(seq.block_hashes, i, block.token_ids)
        return AppendResult(new_block, cow)

    def free(self, seq_id: Hashable, uncache_from: int | None = None) -> None:
        """Release a finished sequence's blocks, tail first, so chain tails are evicted first.

        ``uncache_from``: the K/V of the positions from there on was never computed (an engine step
        failed). The blocks holding them leave the prefix cache too, so no request can ever hit them;
        none of them may still be shared with another sequence (free that one first).
        """
        seq, pool = self._seq(seq_id), self.pool
        doomed = [] if uncache_from is None else self._uncached_blocks(seq, uncache_from)
        pool.clock += 1
        for block in doomed:
            pool.uncache(block, seq_id)
        for block_id in reversed(seq.block_table):
            pool.release(pool.blocks[block_id], seq_id)
        del self.seqs[seq_id]
