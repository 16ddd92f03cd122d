"""Model-free fleet simulation: block managers and schedulers only, a cost model for time.

``CostModel`` (``kvlab.cluster.cost``, re-exported here) turns what a step ran into seconds.

``simulate`` runs a workload through ``SimReplica``s (kvlab's real scheduler and block manager,
scripted tokens) under the same driver as the Ray run, so a sweep over replica counts and policies
takes seconds. ``agree`` checks a simulation against a real run of the same workload: same replica
for every request, same cached tokens.
"""

from __future__ import annotations

from ..cache.hashing import DEFAULT_BLOCK_SIZE
from .cost import CostModel
from .driver import run_fleet
from .object_store import LocalObjectStore
from .replica import LocalHandle, SimReplica

__all__ = ["CostModel", "agree", "simulate"]


def simulate(
    workload,
    num_replicas: int,
    policy: str,
    *,
    num_blocks: int = 256,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cost: CostModel | None = None,
    replies: dict | None = None,
    fail=None,
    tier_blocks: int | None = None,
    offload: bool = False,
    **router_kwargs,
):
    """Run ``workload`` on ``num_replicas`` model-free replicas under ``policy``; a ``FleetResult``.

    ``tier_blocks``: each replica's host tier, in blocks (default: none, or ``num_blocks`` under
    ``pull``, which stages fetched blocks there); ``offload``: the tier also keeps evicted blocks.
    """
    if tier_blocks is None and policy == "pull":
        tier_blocks = num_blocks
    store = LocalObjectStore()  # one for the fleet: what one replica exports, another fetches
    handles = [
        LocalHandle(
            SimReplica(
                num_blocks, block_size, tier_blocks=tier_blocks, offload=offload, object_store=store
            )
        )
        for _ in range(num_replicas)
    ]
    return run_fleet(
        workload,
        handles,
        policy,
        clock="model",
        cost=cost or CostModel(),
        replies=replies,
        fail=fail,
        **router_kwargs,
    )


def agree(a, b) -> dict:
    """Compare two runs of one workload: per request, the same replica and the same cached
    tokens?"""
    ra = {r["request_id"]: r for r in a.records}
    rb = {r["request_id"]: r for r in b.records}
    common = sorted(set(ra) & set(rb), key=str)
    same_replica = sum(ra[k]["replica"] == rb[k]["replica"] for k in common)
    same_cached = sum(ra[k]["cached_tokens"] == rb[k]["cached_tokens"] for k in common)
    return {
        "requests": len(common),
        "missing": len(set(ra) ^ set(rb)),
        "same_replica": same_replica,
        "same_cached_tokens": same_cached,
        "all_agree": not (set(ra) ^ set(rb)) and same_replica == same_cached == len(common),
    }
