"""The engine's requests off the step (``Engine.abort``, ``fork``, ``stats``): what a reader of one
``generate`` step can skip. Each function runs under the engine's lock, which its caller holds."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from .errors import UnknownRequestError
from .intake import check_sampling
from .sampling_params import SamplingParams
from .sequence import Request

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["fork", "get_request", "stats"]


def get_request(engine: Engine, request_id: Hashable, tenant: str | None = None) -> Request:
    """The unfinished request ``request_id`` of ``tenant``; another tenant's looks like an unknown
    one (``UnknownRequestError``)."""
    seq = engine.requests.get(request_id)
    if seq is None or seq.tenant != tenant:
        who = "" if tenant is None else f" of tenant {tenant!r}"
        raise UnknownRequestError(
            f"unknown request id {request_id!r}{who} (never added, already finished, "
            "or added with another tenant)"
        )
    return seq


def fork(
    engine: Engine,
    request_id: Hashable,
    child_id: Hashable | None,
    sampling: SamplingParams | None,
    tenant: str | None,
) -> Hashable:
    """``Engine.fork``: the child shares every block of the parent (``kvlab.cache.fork``); a refused
    fork changes nothing."""
    parent = get_request(engine, request_id, tenant)
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


def stats(engine: Engine) -> dict[str, Any]:
    """``Engine.stats``: the cache's numbers, K/V bytes, preemptions, steps, queue lengths."""
    sched, tier = engine.scheduler, engine.host_tier
    return {
        **engine.block_manager.stats(),
        "kv_bytes_in_use": engine.kv_bytes_in_use,
        "peak_kv_bytes": engine.peak_kv_bytes,
        "kv_bytes_total": engine.store.nbytes,
        "num_preemptions": sched.num_preemptions,
        "num_steps": engine.num_steps,
        "num_mixed_steps": engine.num_mixed_steps,
        "num_waiting": len(sched.waiting),
        "num_running": len(sched.running),
        **(tier.stats() if tier is not None else {}),
    }
