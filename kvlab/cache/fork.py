"""Fork and copy-on-write for the block manager: two sequences share every block until one writes
(pure Python).

``fork`` gives a child every block of its parent, the partial tail included (ref counts go up,
nothing is copied). The first ``append`` into a shared partial block moves the writer onto a private
copy of it (``copy_on_write``) and reports ``(src, dst)`` so an engine copies the K/V tensors. Full
blocks are never written again, so they stay shared. A default ``Engine.generate`` never forks.

References: vLLM v0 ``vllm/core/block/cpu_gpu_block_allocator.py`` (copy-on-write); vLLM v1 shares
only full blocks and has no fork.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

__all__ = ["copy_on_write", "fork_sequence"]


def fork_sequence(manager: Any, parent_id: Hashable, child_id: Hashable) -> None:
    """Start ``child_id`` as a copy of ``parent_id`` that shares every block (no copying yet)."""
    parent = manager._seq(parent_id)
    manager._check_new(child_id)
    pool = manager.pool
    pool.clock += 1
    for block_id in parent.block_table:
        pool.share(pool.blocks[block_id], child_id)
    manager.seqs[child_id] = dataclasses.replace(
        parent,
        seq_id=child_id,
        token_ids=list(parent.token_ids),
        block_table=list(parent.block_table),
        block_hashes=list(parent.block_hashes),
        num_restored_tokens=0,
    )


def copy_on_write(manager: Any, seq: Any, shared: Any) -> Any:
    """Move ``seq`` off a shared partial block onto a private copy of it (``append`` writes into
    it)."""
    pool = manager.pool
    copy = pool.take(seq.seq_id, event="cow-copy")
    copy.token_ids = shared.token_ids[: len(seq.token_ids) % manager.block_size]
    seq.block_table[-1] = copy.block_id
    pool.release(shared, seq.seq_id)
    manager.metrics.cow_copies += 1
    return copy
