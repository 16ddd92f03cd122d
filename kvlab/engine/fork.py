"""Forking: continue a running request as two that share every block (parallel sampling; pure Python).

A plug-in: ``Engine.fork`` is ``fork_request`` and ``Scheduler`` takes ``fork`` / ``check_fork`` from
``ForkingScheduler``; a default ``generate`` / ``step`` runs none of it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .sequence import Request, RequestStatus

__all__ = ["ForkingScheduler", "fork_request"]


class ForkingScheduler:
    """The scheduler's side of a fork (a base of ``Scheduler``)."""

    def fork(self, parent: Request, child: Request) -> None:
        """Run ``child`` as a copy of the running ``parent`` that shares all its blocks."""
        self.check_fork(parent)
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = RequestStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    def check_fork(self, parent: Request) -> None:
        """Raise ``ValueError`` unless ``parent`` runs, has generated a token and is not mid-prefill (``fork`` needs it)."""
        if (
            parent.status is not RequestStatus.RUNNING
            or not parent.output_ids
            or self.is_prefilling(parent)
        ):
            raise ValueError(
                "only a running sequence that has generated a token (and is not being prefilled again "
                "after a preemption) can be forked"
            )


def fork_request(
    engine: Any,
    request_id: Hashable,
    child_id: Hashable | None = None,
    sampling: Any = None,
    *,
    tenant: str | None = None,
) -> Hashable:
    """Continue a running request of ``tenant`` as two sharing every block; a refused fork changes nothing.

    ``Engine.fork``: the child (``child_id``, or an automatic id) has its own ids, ``sampling`` (default: the
    parent's) and generator; its scope, tokens and timing are the parent's.
    """
    from .intake import check_sampling

    with engine._lock:
        parent = engine._get(request_id, tenant)
        sampling = check_sampling(parent.sampling if sampling is None else sampling)
        engine.scheduler.check_fork(parent)
        seq_id, child_id = engine.intake.new_ids(child_id, engine.requests)
        # drawn after every check
        child = Request(
            seq_id,
            child_id,
            list(parent.prompt_ids),
            sampling,
            parent.scope,
            parent.arrival_time,
            list(parent.output_ids),
            num_cached_tokens=parent.num_cached_tokens,
            first_token_time=parent.first_token_time,
            generator=engine.intake.generator(sampling),
        )
        engine.scheduler.fork(parent, child)
        engine.requests[child_id] = child
        return child_id
