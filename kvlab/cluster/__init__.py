"""Beyond one replica: engine replicas (Ray actors or model-free), a KV-event-fed router, a fleet
driver.

- ``router``: ``KVIndex`` (built only from replicas' KV events), ``Router`` with the policies
  round_robin, least_loaded, session_affinity, prefix_tree (SGLang-style), kv_aware (Dynamo's cost)
  and pull (route for load, fetch the prefix from the replica that holds it:
  ``kvlab.engine.offload``)
- ``replica``: ``EngineReplica`` (a kvlab ``Engine``; ``ray_replicas`` runs them as Ray actors) and
  ``SimReplica`` (the real scheduler and block manager, no model)
- ``driver``: ``run_fleet``: Poisson arrivals through the router, per-request TTFT, cached tokens,
  replica
- ``pd``: ``run_pd``: one replica prefills and ships the blocks, another decodes
- ``cost``: ``CostModel``, a step's modelled seconds (the driver's model clock)
- ``sim``: ``simulate`` (model-free sweeps), ``agree`` (sim vs Ray on one workload)
- ``workloads``: multi-tenant multi-turn ``chat``; ``from_prompts`` (e.g. sys512)

Ray is optional (``pip install kvlab[cluster]``): nothing here imports it until a Ray replica is
started.
"""

from .cost import CostModel
from .driver import FleetResult, percentile, run_fleet
from .pd import pd_summary, run_pd
from .replica import (
           EngineReplica,
           LocalHandle,
           RayHandle,
           SimReplica,
           ray_available,
           ray_replicas,
           start_ray,
)
from .router import ALL_POLICIES, POLICIES, HashRing, KVIndex, PrefixTree, Router, RouteRequest
from .sim import agree, simulate
from .workloads import FleetWorkload, Session, chat, from_prompts

__all__ = [
    "ALL_POLICIES",
    "POLICIES",
    "CostModel",
    "EngineReplica",
    "FleetResult",
    "FleetWorkload",
    "HashRing",
    "KVIndex",
    "LocalHandle",
    "PrefixTree",
    "RayHandle",
    "RouteRequest",
    "Router",
    "Session",
    "SimReplica",
    "agree",
    "chat",
    "from_prompts",
    "pd_summary",
    "percentile",
    "ray_available",
    "ray_replicas",
    "run_fleet",
    "run_pd",
    "simulate",
    "start_ray",
]
