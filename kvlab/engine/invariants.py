"""Consistency checks of an engine's bookkeeping (``EngineConfig(debug=True)`` runs them after every
step).

Pure Python: ``Scheduler.check_invariants`` and ``Engine.check_invariants`` call these; a default
step never does.
"""

from __future__ import annotations

import itertools
from typing import Any

from ..cache.debug import check
from .sequence import RequestStatus

__all__ = ["check_engine", "check_scheduler"]


def check_scheduler(scheduler: Any) -> None:
    """Raise unless the block manager and the queues agree: every running request holds its tokens'
    blocks."""
    bm = scheduler.block_manager
    bm.check_invariants()
    running = {s.seq_id for s in scheduler.running}
    check(
        running == set(bm.seqs),
        f"running {sorted(running)} but the block manager holds {sorted(bm.seqs)}",
    )
    # all but its last token; a prompt in chunks: all its tokens, some not computed yet
    for seq in scheduler.running:
        held = bm.seqs[seq.seq_id].token_ids
        check(
            seq.status is RequestStatus.RUNNING
            and held == (seq.token_ids if scheduler.is_prefilling(seq) else seq.token_ids[:-1]),
            f"sequence {seq.seq_id}: its blocks hold other tokens than all but its last",
        )
        check(
            0 < seq.num_computed_tokens <= len(held) <= seq.num_tokens,
            f"sequence {seq.seq_id}: {seq.num_computed_tokens} tokens computed of {len(held)} held",
        )
    for seq in scheduler.waiting:
        check(
            seq.status is RequestStatus.WAITING and seq.seq_id not in bm.seqs,
            f"waiting sequence {seq.seq_id} still holds blocks",
        )


def check_engine(engine: Any) -> None:
    """``check_scheduler``, and the engine's request table holds exactly the queued requests."""
    check_scheduler(engine.scheduler)
    live = {
        s.request_id for s in itertools.chain(engine.scheduler.running, engine.scheduler.waiting)
    }
    check(live == set(engine.requests), "the engine's request table and the queues disagree")
