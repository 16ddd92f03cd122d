"""KV-cache events in vLLM's schema: what a replica tells a router about the blocks it caches.

A block manager created with ``enable_kv_events=True`` queues one event per change of its prefix
cache, with vLLM's semantics (``vllm/v1/core/block_pool.py``):

- ``BlockStored``: full blocks were just put into the cache, one event per call that caches them (a
  prompt's new full blocks at admission, each block filled during decode). ``block_hashes`` are
  those blocks' hashes in order, ``parent_block_hash`` the hash of the block before the first of
  them (None for a sequence's first block), ``token_ids`` the tokens of all of them together. A
  block the request *hit* is not stored again (vLLM emits those only in its opt-in "full" report
  mode).
- ``BlockRemoved``: a cached block left the cache, one event per block (evicted when its slot was
  taken for new data; kvlab also emits it when a failed step takes unwritten blocks out of the
  cache).
- ``AllBlocksCleared``: ``reset_prefix_cache`` dropped everything.

Each ``BlockStored`` / ``BlockRemoved`` names its tier in ``medium``, as vLLM's do: ``"GPU"`` for
the pool (kvlab's name for the device tier, whatever the device) and ``"CPU"`` for the host tier of
evicted or fetched blocks (``kvlab.cache.host_tier``). A consumer keeps the two apart: a block can
sit in both.

The same hash may be stored twice (two requests computed the same block in one step, or a prompt
whose length is a multiple of the block size recomputes its last block): a consumer that wants the
exact set of cached hashes counts stores minus removals per hash (``kvlab.cluster.router.KVIndex``
does).

``take_events()`` returns the queued events and empties the queue (vLLM's
``BlockPool.take_events``); an engine wraps each step's events in an ``EventBatch`` with a sequence
number, so a consumer can tell that it missed a batch. Hash values are kvlab's (sha256 bytes), so
they differ from vLLM's by design; the token ids, the parent links and the order are the same
(``tests/cache/test_kv_events.py`` checks it against real vLLM when its venv is present).

References: vLLM ``vllm/distributed/kv_events.py`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, ``KVEventBatch``), ``vllm/v1/core/block_pool.py`` (``cache_full_blocks``,
``_maybe_evict_cached_block``, ``reset_prefix_cache``, ``take_events``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .hashing import BlockHash

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "emit_stored",
]

# vLLM's name for the device tier, whatever the device (kvlab's blocks live with the model)
MEDIUM_GPU = "GPU"
# the host tier (kvlab.cache.host_tier): evicted blocks kept in host memory, fetched blocks staged
MEDIUM_CPU = "CPU"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Full blocks just cached: their hashes, the parent of the first, their tokens (vLLM's
    ``BlockStored``)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    # len(block_hashes) * block_size tokens
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"{len(self.block_hashes)} blocks of {self.block_size} need "
                f"{len(self.block_hashes) * self.block_size} token ids, got {len(self.token_ids)}"
            )


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks that left the cache (vLLM's ``BlockRemoved``; one hash per event, as vLLM emits
    them)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, frozen=True)
class EventBatch:
    """The events of one engine step: a timestamp, the events in order, a sequence number (from
    0)."""

    ts: float
    events: tuple[KVCacheEvent, ...] = field(default_factory=tuple)
    seq: int = 0
    data_parallel_rank: int | None = None


def emit_stored(pool: Any, hashes: Sequence[BlockHash], first: int, tokens: Sequence[int]) -> None:
    """Queue on ``pool`` one ``BlockStored`` for the full blocks ``first, first + 1, ...`` just
    cached, holding ``tokens`` (none when no block is full): the block manager's call, only with
    ``enable_kv_events=True``."""
    end = first + len(tokens) // pool.block_size
    if first < end:
        parent = hashes[first - 1] if first else None
        stored = BlockStored(tuple(hashes[first:end]), parent, tuple(tokens), pool.block_size)
        pool.emit_event(stored)


def describe(event: KVCacheEvent, short: int = 4) -> str:
    """One line for a notebook: the event's kind, hashes (first ``short`` hex digits) and token
    count."""
    hx = lambda h: "None" if h is None else h.hex()[:short]  # noqa: E731
    if isinstance(event, BlockStored):
        return (
            f"BlockStored(blocks=[{', '.join(map(hx, event.block_hashes))}], "
            f"parent={hx(event.parent_block_hash)}, "
            f"tokens={len(event.token_ids)}{_medium(event)})"
        )
    if isinstance(event, BlockRemoved):
        return f"BlockRemoved(blocks=[{', '.join(map(hx, event.block_hashes))}]{_medium(event)})"
    return "AllBlocksCleared()"


def _medium(event: BlockStored | BlockRemoved) -> str:
    return "" if event.medium in (None, MEDIUM_GPU) else f", medium={event.medium}"
