"""``Engine.fork``: continue a running request as two that share every block (parallel sampling; off the step path)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .intake import check_sampling
from .sequence import Request

__all__ = ["fork_request"]


def fork_request(
    engine: Any, parent: Request, child_id: Hashable | None, sampling: Any
) -> Hashable:
    """Fork ``parent`` (a request of ``engine``, under its lock) into ``child_id``; a refused fork changes nothing.

    The child has its own ids, sampling and generator; its scope, tokens and timing are the parent's.
    """
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
