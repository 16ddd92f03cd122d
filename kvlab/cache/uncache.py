"""Blocks whose K/V was never written leave the prefix cache: ``BlockManager.free(seq_id,
uncache_from=)`` (pure Python).

The block manager caches a full block when it is allocated, before the engine writes its K/V
(``BlockManager._cache_block``). When a step fails, or a prompt in chunks is aborted halfway, the
positions from ``uncache_from`` on were never computed: ``free`` takes their blocks out of the cache
(``BlockPool.uncache``) before it releases them, so no later request can hit them. A plain
``Engine.generate`` never comes here (``kvlab.engine.recovery``, ``Scheduler.finish``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["uncached_blocks"]


def uncached_blocks(manager: Any, seq: Any, uncache_from: int) -> list[Any]:
    """The cached blocks of ``seq`` from position ``uncache_from`` on.

    Raises ``ValueError``, changing nothing, for a bad position or for such a block still shared
    with another sequence (free that sequence first).
    """
    n, doomed = len(seq.token_ids), []
    if type(uncache_from) is not int or not 0 <= uncache_from <= n:
        raise ValueError(f"uncache_from must be an int in [0, {n}], got {uncache_from!r}")
    for block_id in seq.block_table[uncache_from // manager.block_size :]:
        block = manager.pool.blocks[block_id]
        if block.block_hash is not None and block.ref_count > 1:
            raise ValueError(
                f"block {block_id} (positions from {uncache_from} on) is still used by "
                "another sequence: free that sequence first"
            )
        if block.block_hash is not None:
            doomed.append(block)
    return doomed
