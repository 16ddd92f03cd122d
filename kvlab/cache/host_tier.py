"""A second tier for evicted blocks: a bytes-bounded LRU store keyed by the same chained block
hashes (pure Python).

When the pool evicts a cached block (``BlockPool.on_evict``), ``TierLink`` copies it here: its hash,
its parent's hash, its token ids, its extra keys (model fingerprint, tenant salt) and an opaque
``payload`` (the K/V, which ``kvlab.engine.offload`` copies; ``None`` in a model-free replica). When
a later prompt misses the pool, the block manager asks the link for the next blocks of its chain
(``load``): an entry is served only if its hash, tokens, extra keys and parent hash all match what
the prompt asks for, so a collision or another tenant's salted block is never served (the salt is in
the extra keys, and in the hash). The payload is copied into a fresh pool block instead of
recomputing it: those prompt tokens are cached tokens of a second kind.

The same store stages blocks fetched from another replica (``source="peer"``,
``kvlab.engine.offload``). ``pin`` keeps an entry from being evicted while it is being read; a
pinned store may exceed nothing: a put that cannot make room among unpinned entries is refused.
Events (vLLM's schema, ``medium="CPU"``): a put emits ``BlockStored``, an eviction or removal
``BlockRemoved``.

References: vLLM's CPU offloading connector (``vllm/v1/kv_offload``: ``OffloadingManager``,
``LRUOffloadingManager``, ``lookup``/``prepare_store``/``prepare_load``) and LMCache's local CPU
backend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .debug import check
from .hashing import BlockHash, ExtraKeys, block_extra_keys
from .kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["HostTier", "SecondTier", "TierEntry", "TierLink", "collect_blocks", "restore_block"]

SOURCES = ("offload", "peer")


@dataclass(slots=True)
class TierEntry:
    """One block in the host tier: what identifies it, its K/V (opaque) and its size in bytes."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys
    payload: Any
    nbytes: int
    # "offload" (evicted here) or "peer" (fetched from another replica)
    source: str = "offload"
    pins: int = field(default=0, compare=False)

    def matches(
        self, token_ids: tuple[int, ...], extra_keys: ExtraKeys, parent_hash: BlockHash | None
    ) -> bool:
        """Whether this entry is exactly the block a prompt asks for (not just the same hash)."""
        return (
            self.token_ids == token_ids
            and self.extra_keys == extra_keys
            and self.parent_hash == parent_hash
        )


class HostTier:
    """Entries by block hash in LRU order (head = next victim), at most ``capacity_bytes`` of them
    in bytes."""

    def __init__(
        self,
        capacity_bytes: int,
        block_size: int,
        emit: Callable[[KVCacheEvent], None] | None = None,
    ) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.capacity_bytes, self.block_size = capacity_bytes, block_size
        self.entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        self.nbytes = 0
        # where events go (``BlockManager.emit_event``: both tiers share one stream)
        self.emit = emit
        self.num_puts = self.num_evictions = self.num_refused = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def _emit(self, event: KVCacheEvent) -> None:
        if self.emit is not None:
            self.emit(event)

    def put(self, entry: TierEntry) -> bool:
        """Store ``entry`` (replacing one with the same hash), evicting LRU unpinned entries; False
        if it cannot fit."""
        if not isinstance(entry, TierEntry):
            raise TypeError(f"entry must be a TierEntry, got {type(entry).__name__}")
        if entry.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {entry.source!r}")
        if (
            len(entry.token_ids) != self.block_size
            or type(entry.nbytes) is not int
            or entry.nbytes <= 0
        ):
            raise ValueError(
                f"a tier entry is one full block of {self.block_size} tokens with nbytes > 0"
            )
        old = self.entries.get(entry.block_hash)
        if old is not None and old.pins:
            self.num_refused += 1
            # someone is reading the old copy: keep it
            return False
        free = self.capacity_bytes - self.nbytes + (old.nbytes if old is not None else 0)
        free += sum(
            e.nbytes for h, e in self.entries.items() if not e.pins and h != entry.block_hash
        )
        if entry.nbytes > free:
            self.num_refused += 1
            return False
        if old is not None:
            self._remove(entry.block_hash, event=False)
        while self.nbytes + entry.nbytes > self.capacity_bytes:
            victim = next(h for h, e in self.entries.items() if not e.pins)
            self._remove(victim)
            self.num_evictions += 1
        entry.pins = 0
        self.entries[entry.block_hash] = entry
        self.nbytes += entry.nbytes
        self.num_puts += 1
        if old is None:
            self._emit(
                BlockStored(
                    (entry.block_hash,),
                    entry.parent_hash,
                    entry.token_ids,
                    self.block_size,
                    medium=MEDIUM_CPU,
                )
            )
        return True

    def get(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        parent_hash: BlockHash | None,
    ) -> TierEntry | None:
        """The entry for exactly this block (hash, tokens, extra keys, parent), now most recently
        used; else None."""
        entry = self.entries.get(block_hash)
        if entry is None or not entry.matches(tuple(token_ids), extra_keys, parent_hash):
            return None
        self.entries.move_to_end(block_hash)
        return entry

    def pin(self, block_hash: BlockHash) -> None:
        """Keep an entry from eviction until ``unpin`` (while its payload is being read)."""
        self.entries[block_hash].pins += 1

    def unpin(self, block_hash: BlockHash) -> None:
        """Undo one ``pin``."""
        entry = self.entries.get(block_hash)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def remove(self, block_hash: BlockHash) -> bool:
        """Drop an entry (e.g. its payload turned out unreadable); False if absent or pinned."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.pins:
            return False
        self._remove(block_hash)
        return True

    def _remove(self, block_hash: BlockHash, event: bool = True) -> None:
        entry = self.entries.pop(block_hash)
        self.nbytes -= entry.nbytes
        if event:
            self._emit(BlockRemoved((block_hash,), medium=MEDIUM_CPU))

    def clear(self) -> None:
        """Drop every unpinned entry (with the prefix cache's reset: K/V of old weights must not
        come back)."""
        for h in [h for h, e in self.entries.items() if not e.pins]:
            self._remove(h)

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless the bytes add up and stay within the bound."""
        check(
            self.nbytes == sum(e.nbytes for e in self.entries.values()), "tier bytes do not add up"
        )
        check(
            self.nbytes <= self.capacity_bytes,
            f"tier holds {self.nbytes} > {self.capacity_bytes} bytes",
        )
        check(
            all(h == e.block_hash for h, e in self.entries.items()),
            "a tier entry is filed under another hash",
        )


class SecondTier(Protocol):
    """What a ``BlockManager`` asks of a second tier (its ``second_tier`` seam)."""

    def load(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        parent_hash: BlockHash | None,
        block_id: int,
    ) -> str | None:
        """Copy this exact block into pool block ``block_id``; its source ("offload"/"peer"), or
        None on a miss."""

    def clear(self) -> None:
        """Forget everything (the prefix cache was reset)."""


def restore_block(manager: Any, seq: Any, i: int, block: Any) -> bool:
    """The block manager's side of the seam: copy ``seq``'s prompt block ``i`` back from the
    manager's second tier into the fresh pool ``block``; whether the tier had it (the restored
    tokens are counted by source)."""
    h = seq.block_hashes
    keys = block_extra_keys(i, manager.model_fingerprint, seq.cache_salt, seq.salt_block)
    source = manager.second_tier.load(
        h[i], tuple(block.token_ids), keys, h[i - 1] if i else None, block.block_id
    )
    if source is not None:
        seq.num_restored_tokens += manager.block_size
        manager.restored_tokens[source] += manager.block_size
    return source is not None


class TierLink:
    """Connects a block pool to a ``HostTier``: saves evicted blocks, loads them back; counts what
    moved.

    ``save_payload(block_id) -> (payload, nbytes)`` reads a pool block's K/V;
    ``load_payload(payload, block_id)`` writes it back (may raise: the load then counts as a miss).
    Both default to a model-free stand-in (no payload, ``bytes_per_block`` bytes), which is what
    ``SimReplica`` uses. ``offload=False`` keeps the tier as a staging area for fetched blocks only
    (evictions are not saved).
    """

    def __init__(
        self,
        tier: HostTier,
        bytes_per_block: int = 1,
        *,
        offload: bool = True,
        save_payload: Callable[[int], tuple[Any, int]] | None = None,
        load_payload: Callable[[Any, int], None] | None = None,
    ) -> None:
        self.tier, self.offload = tier, offload
        self.save_payload = save_payload or (lambda block_id: (None, bytes_per_block))
        self.load_payload = load_payload or (lambda payload, block_id: None)
        self.saved_blocks = 0
        # blocks loaded back, by source
        self.loaded: dict[str, int] = dict.fromkeys(SOURCES, 0)
        self.load_failures = 0

    def on_evict(self, block: Any) -> None:
        """``BlockPool.on_evict``: copy a cached block that is about to be reused into the tier."""
        if not self.offload:
            return
        try:
            payload, nbytes = self.save_payload(block.block_id)
        except Exception:  # noqa: BLE001 - a failed copy loses a tier entry, never the pool's state
            return
        entry = TierEntry(
            block.block_hash,
            block.parent_hash,
            tuple(block.token_ids),
            block.extra_keys,
            payload,
            nbytes,
        )
        if self.tier.put(entry):
            self.saved_blocks += 1

    def stage(self, entries: list[TierEntry], hash_fn: Callable) -> int:
        """Put blocks fetched from elsewhere into the tier (``source="peer"``); how many were
        accepted.

        Each block's hash is recomputed with ``hash_fn`` from its parent hash, tokens and extra keys
        (which carry the model fingerprint and the salt): a block whose label does not match its
        content is refused, and staging stops there (later blocks of the chain could never be
        reached).
        """
        n = 0
        for e in entries:
            if (
                not isinstance(e, TierEntry)
                or len(e.token_ids) != self.tier.block_size
                or hash_fn(e.parent_hash, list(e.token_ids), e.extra_keys) != e.block_hash
            ):
                break
            e.source = "peer"
            if not self.tier.put(e):
                break
            n += 1
        return n

    def load(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        parent_hash: BlockHash | None,
        block_id: int,
    ) -> str | None:
        """``SecondTier.load``: the entry's source after copying it into ``block_id``, or None (miss
        or failed copy)."""
        entry = self.tier.get(block_hash, tuple(token_ids), extra_keys, parent_hash)
        if entry is None:
            return None
        self.tier.pin(block_hash)
        try:
            self.load_payload(entry.payload, block_id)
        except Exception:  # noqa: BLE001 - an unreadable payload is a miss: the block is recomputed
            self.tier.unpin(block_hash)
            self.tier.remove(block_hash)
            self.load_failures += 1
            return None
        self.tier.unpin(block_hash)
        self.loaded[entry.source] += 1
        return entry.source

    def clear(self) -> None:
        """``SecondTier.clear``."""
        self.tier.clear()

    def stats(self) -> dict[str, Hashable]:
        """Blocks saved and loaded back (by source), entries and bytes held, evictions and
        refusals."""
        t = self.tier
        return {
            "tier_blocks": len(t),
            "tier_bytes": t.nbytes,
            "tier_capacity_bytes": t.capacity_bytes,
            "tier_saved_blocks": self.saved_blocks,
            "tier_loaded_blocks": self.loaded["offload"],
            "peer_loaded_blocks": self.loaded["peer"],
            "tier_evictions": t.num_evictions,
            "tier_refused": t.num_refused,
            "tier_load_failures": self.load_failures,
        }


def collect_blocks(
    block_manager: Any,
    tier: HostTier | None,
    hashes: list[BlockHash],
    read: Callable[[int], tuple[Any, int]] | None = None,
    parent: BlockHash | None = None,
    wire: Callable[[Any], Any] | None = None,
) -> list[TierEntry]:
    """The leading blocks of ``hashes`` that this replica holds (its ``BlockManager``'s pool, then
    its tier), as entries.

    ``read(block_id) -> (payload, nbytes)`` copies a pool block's K/V (None: model-free, one byte
    each); ``parent``: the hash before ``hashes[0]`` (None when they start the prompt);
    ``wire(payload)`` converts a tier entry's payload as ``read`` converts a pool block's (for
    shipping). Stops at the first hash it holds neither place, or whose parent is not the previous
    hash (a broken chain).
    """
    out: list[TierEntry] = []
    cached = block_manager.pool.cached
    for h in hashes:
        block = next(iter(cached.get(h, ())), None)
        if block is not None and block.parent_hash == parent:
            payload, nbytes = read(block.block_id) if read is not None else (None, 1)
            out.append(
                TierEntry(
                    h,
                    block.parent_hash,
                    tuple(block.token_ids),
                    block.extra_keys,
                    payload,
                    nbytes,
                    "peer",
                )
            )
        elif tier is not None and h in tier and tier.entries[h].parent_hash == parent:
            e = tier.entries[h]
            payload = wire(e.payload) if wire is not None and e.payload is not None else e.payload
            out.append(
                TierEntry(h, e.parent_hash, e.token_ids, e.extra_keys, payload, e.nbytes, "peer")
            )
        else:
            break
        parent = h
    return out
