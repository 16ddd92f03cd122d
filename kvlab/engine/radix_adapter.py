"""Which prefix cache an ``Engine`` runs on: vLLM's hash blocks (``"blocks"``) or SGLang's radix tree (``"radix"``).

Both expose the methods the scheduler and the engine call (``can_allocate``, ``allocate``, ``can_append``,
``append``, ``fork``, ``free``, ``block_table``, ``stats``, ``check_invariants``), so the engine only
chooses one here and sizes its K/V store after it: ``num_blocks x block_size`` slots either way, in
blocks of ``block_size`` or in pages of ``page_size`` (one token by default: every cached token is
reused, a partial block's too).

The radix tree keeps each tenant salt under its own root, so it cannot share an operator's public prefix
across salted tenants: ``isolation="public-prefix"`` needs the block cache.
"""

from __future__ import annotations

from ..cache.block_manager import BlockManager
from ..cache.radix import RadixCache

__all__ = ["CACHES", "make_prefix_cache"]

CACHES = ("blocks", "radix")


def make_prefix_cache(cache: str, num_blocks: int, block_size: int, page_size: int, isolation: str,
                      model_fingerprint: str = "", enable_caching: bool = True,
                      enable_kv_events: bool = False) -> BlockManager | RadixCache:
    """The engine's prefix cache: ``BlockManager(num_blocks, block_size)`` or a radix tree of the same slots."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    if cache == "blocks":
        return BlockManager(num_blocks, block_size, model_fingerprint=model_fingerprint, enable_caching=enable_caching,
                            enable_kv_events=enable_kv_events)
    if enable_kv_events:
        raise ValueError("KV events (vLLM's schema) describe hash blocks: use cache='blocks' with enable_kv_events=True")
    if type(page_size) is not int or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if isolation == "public-prefix":
        raise ValueError("the radix cache keeps each tenant's salt in its own tree and cannot share a public "
                         "prefix across tenants: use cache='blocks' with isolation='public-prefix'")
    slots = num_blocks * block_size
    if slots < page_size:
        raise ValueError(f"{num_blocks} blocks of {block_size} slots hold no page of {page_size} slots")
    return RadixCache(slots // page_size, page_size, model_fingerprint=model_fingerprint,
                      enable_caching=enable_caching)
