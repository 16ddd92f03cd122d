"""What a load test checks after a run: the engine's invariants and leaked blocks (``GET
/debug/engine``).

Called in the engine thread between two steps (``EngineRunner.call``), so it sees a consistent
state. A block is leaked when its ref count is above zero but no live sequence's block table holds
it; a request is orphaned (``orphan_requests``, added by the endpoint) when the engine holds it but
the server no longer tracks it. After every client has its answer (or is gone), both must be 0 and
``live_requests`` too.
"""

from __future__ import annotations

from ..engine.engine import Engine

__all__ = ["engine_report"]


def engine_report(engine: Engine) -> dict:
    """``{"invariants_ok", "invariant_error", "leaked_blocks", "blocks_in_use", "live_requests",
    ...}``."""
    try:
        engine.check_invariants()
        error = None
    except Exception as e:  # reported, not raised: the endpoint's job is to say what is wrong
        error = f"{type(e).__name__}: {e}"
    bm = engine.block_manager
    held = {b for seq_id in bm.seqs for b in bm.block_table(seq_id)}
    # through the cache interface: any CacheManager, radix included
    in_use = bm.num_blocks - bm.num_free_blocks
    stats = engine.stats()
    return {
        "invariants_ok": error is None,
        "invariant_error": error,
        "leaked_blocks": max(0, in_use - len(held)),
        "blocks_in_use": in_use,
        "num_blocks": bm.num_blocks,
        "live_requests": len(engine.requests),
        "num_running": stats["num_running"],
        "num_waiting": stats["num_waiting"],
        "num_preemptions": stats["num_preemptions"],
        "num_cached_blocks": stats["num_cached_blocks"],
    }
