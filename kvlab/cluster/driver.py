"""The fleet driver: timed arrivals through a router to replicas, per-request TTFT, hits and
replica.

One discrete-event loop serves both backends (model-free ``SimReplica``s and real engines as Ray
actors), so the two differ only in what a replica does in a step. Time is a virtual clock per
replica: a step lasts either its modelled seconds (``clock="model"``: ``CostModel`` of what it
computed, deterministic) or its measured wall seconds on the replica (``clock="measured"``). Events
happen in time order:

- an arrival (a session's next turn; the first turns arrive as a Poisson process, each later one a
  think time after the previous reply) is routed with what the router knows *at that time*: the KV
  events and completions of steps that ended before it;
- otherwise the busy replica with the earliest clock runs one step; its KV-event batches and
  completions reach the router at the step's end time.

Under the ``pull`` policy (``Router.pull_plan``) a request routed for load to a replica that lacks a
prefix another replica holds is sent with a fetch: the holder exports those blocks into the object
store at routing time, the chosen replica stages them at its next step and restores them instead of
recomputing (records: ``restored_tokens``; the modelled clock charges ``CostModel.per_moved_token``
for them). A holder whose export raises is out of the fleet, as any replica that raises; the request
then simply recomputes.

TTFT = end of the step that produced the first token - arrival. A replica failure (``fail=(time,
replica, rejoin_after)``) drops the replica's cache and its requests in flight (they are routed
again, keeping their arrival time); it rejoins empty ``rejoin_after`` seconds later (never when
None).

A replica whose call raises (a crashed actor, a bug) is treated as failed for the rest of the run:
it leaves the router, its requests in flight are reported in ``FleetResult.failed`` with the error
(not routed again: the request being added may be what made it raise), and later turns of their
sessions never arrive. The healthy replicas' records are kept; ``FleetResult.errors`` names each
raiser. A request that arrives (or is routed again) while no replica is in the fleet is failed the
same way.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .cost import CostModel
from .router import Router, RouteRequest
from .workloads import FleetWorkload

__all__ = ["FleetResult", "percentile", "run_fleet"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank; nan for no values)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class FleetResult:
    """Per-request records, per-step rows, the replies, the router at the end, and the run's
    settings."""

    policy: str
    num_replicas: int
    records: list[dict]
    steps: list[tuple[int, int, int, float]]  # replica, prefill tokens, decodes, seconds (measured)
    replies: dict
    router: Router
    stats: list[dict] = field(default_factory=list)  # each replica's stats at the end
    fail: tuple | None = None
    failed: list[dict] = field(default_factory=list)  # requests lost with a replica that raised
    errors: dict[int, str] = field(default_factory=dict)  # replica -> the error it raised

    def summary(self) -> dict:
        """Fleet hit rate, TTFT p50/p99 (s), load imbalance (max/mean requests per replica),
        preemptions."""
        recs = self.records
        prompt = sum(r["prompt_tokens"] for r in recs)
        cached = sum(r["cached_tokens"] for r in recs)
        ttft = [r["ttft"] for r in recs]
        per = Counter(r["replica"] for r in recs)
        counts = [per.get(i, 0) for i in range(self.num_replicas)]
        restored = sum(r.get("restored_tokens", 0) for r in recs)
        return {
            "policy": self.policy,
            "replicas": self.num_replicas,
            "requests": len(recs),
            "hit_rate": cached / prompt if prompt else 0.0,
            "restored_rate": restored / prompt if prompt else 0.0,
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "imbalance": max(counts) / statistics.mean(counts) if recs else math.nan,
            "preemptions": sum(r["preemptions"] for r in recs),
            "makespan": max((r["finish"] for r in recs), default=0.0),
            "failed": len(self.failed),
        }

    def hit_rate_over_time(self, window: float) -> list[tuple[float, float, int]]:
        """(window start, hit rate of the requests arriving in it, requests) for consecutive
        windows."""
        if not self.records:
            return []
        end = max(r["arrival"] for r in self.records)
        out = []
        for k in range(int(end // window) + 1):
            rs = [r for r in self.records if k * window <= r["arrival"] < (k + 1) * window]
            p = sum(r["prompt_tokens"] for r in rs)
            out.append(
                (k * window, sum(r["cached_tokens"] for r in rs) / p if p else math.nan, len(rs))
            )
        return out


def run_fleet(workload: FleetWorkload, handles: Sequence[Any], policy: str, *, clock: str = "model",
              cost: CostModel | None = None, replies: dict | None = None, fail: tuple | None = None,
              fresh: bool = True, **router_kwargs: Any) -> FleetResult:
    """Drive ``workload`` through a ``Router(policy)`` onto ``handles`` (``LocalHandle`` /
    ``RayHandle``).

    ``replies``: request id -> reply tokens a model-free replica should "generate" (default: the
    session's scripted replies); pass a real run's ``FleetResult.replies`` to replay it exactly.
    ``fresh``: restart every replica empty first (so runs on the same actors do not share a warm
    cache).
    """
    if clock not in ("model", "measured"):
        raise ValueError(f"clock must be 'model' or 'measured', got {clock!r}")
    cost = cost or CostModel()
    n = len(handles)
    if fresh:
        for h in handles:
            h.call("fail")
    info = handles[0].call("info")
    router = Router(
        policy,
        list(range(n)),
        info["block_size"],
        model_fingerprint=info["model_fingerprint"],
        **router_kwargs,
    )
    order = itertools.count()
    arrivals: list = []  # (time, order, kind, payload)
    for s_idx, s in enumerate(workload.sessions):
        heapq.heappush(arrivals, (s.start, next(order), "turn", (s_idx, 0, s.start)))
    if fail is not None:
        heapq.heappush(arrivals, (fail[0], next(order), "fail", fail[1]))
    pending: list = []  # (time, order, replica, kind, payload): what reaches the router at ``time``
    clocks = [0.0] * n
    live = set(range(n))
    inflight: list[dict] = [{} for _ in range(n)]  # replica -> request id -> request dict
    got: dict[str, list[list[int]]] = {s.session_id: [] for s in workload.sessions}
    records, steps, outputs = [], [], {}
    failed: list[dict] = []
    errors: dict[int, str] = {}

    def crash(r: int, t: float, err: Exception) -> None:
        """Replica ``r`` raised: out of the fleet for good, its requests in flight reported as
        failed."""
        errors[r] = f"{type(err).__name__}: {err}"
        live.discard(r)
        router.remove_replica(r)
        pending[:] = [p for p in pending if p[2] != r]
        heapq.heapify(pending)
        for req in inflight[r].values():
            lose(req, t, f"replica {r} raised {errors[r]}")
        inflight[r] = {}

    def lose(req: dict, t: float, why: str) -> None:
        failed.append(
            {
                "request_id": req["request_id"],
                "session": req["session"],
                "tenant": req["tenant"],
                "turn": req["turn"],
                "replica": req.get("replica"),
                "arrival": req["arrival"],
                "failed_at": t,
                "error": why,
            }
        )

    def flush(t: float) -> None:
        while pending and pending[0][0] <= t:
            _, _, r, kind, payload = heapq.heappop(pending)
            if kind == "events":
                router.apply_events(r, payload)
            else:
                router.finish(r, payload)

    def submit(req: dict, t: float) -> None:
        if not router.replicas:
            lose(req, t, "no replica left in the fleet")
            return
        rr = RouteRequest(
            req["request_id"], tuple(req["prompt"]), req["session"], req["max_tokens"]
        )
        r = router.route(rr)
        fetch = None
        plan = router.pull_plan(rr, r) if router.policy == "pull" else None
        # the holder exports the blocks r lacks; r fetches them at its next step
        if plan is not None:
            holder, first, end = plan
            hashes = router.hashes(rr)
            try:
                fetch = [
                    handles[holder].call(
                        "export", hashes[first:end], hashes[first - 1] if first else None
                    )
                ]
            except Exception as err:  # noqa: BLE001 - the holder is gone: r recomputes
                crash(holder, t, err)
        req["replica"] = r
        if not inflight[r]:
            clocks[r] = max(clocks[r], t)
        inflight[r][req["request_id"]] = req
        reply = None
        if replies is not None and req["request_id"] in replies:
            reply = replies[req["request_id"]]
        else:
            reply = workload.sessions[req["s_idx"]].scripted_replies[req["turn"]]
        try:
            handles[r].call(
                "add", req["request_id"], req["prompt"], req["max_tokens"], list(reply), fetch
            )
        except Exception as err:  # noqa: BLE001 - any error of a replica is that replica's failure
            crash(r, t, err)

    while arrivals or any(inflight[r] for r in live):
        busy = [r for r in live if inflight[r]]
        r_next = min(busy, key=lambda r: (clocks[r], r)) if busy else None
        if arrivals and (r_next is None or arrivals[0][0] <= clocks[r_next]):
            t, _, kind, payload = heapq.heappop(arrivals)
            flush(t)
            if kind == "turn":
                s_idx, turn, arrival = payload
                s = workload.sessions[s_idx]
                req = {
                    "request_id": f"{s.session_id}/t{turn}",
                    "session": s.session_id,
                    "tenant": s.tenant,
                    "s_idx": s_idx,
                    "turn": turn,
                    "arrival": arrival,
                    "max_tokens": s.reply_tokens[turn],
                    "prompt": s.prompt(turn, got[s.session_id]),
                    "first": None,
                }
                submit(req, t)
            elif kind == "fail":
                r = payload
                if r in errors:  # it raised before: already out for good
                    continue
                try:
                    lost = handles[r].call("fail")
                except Exception as err:  # noqa: BLE001
                    # any error of a replica is that replica's failure
                    crash(r, t, err)
                    continue
                router.remove_replica(r)
                live.discard(r)
                pending[:] = [p for p in pending if p[2] != r]
                heapq.heapify(pending)
                requeue = [inflight[r][rid] for rid in lost]
                inflight[r] = {}
                for req in requeue:
                    req["first"] = None
                    submit(req, t)
                if fail[2] is not None:
                    heapq.heappush(arrivals, (t + fail[2], next(order), "rejoin", r))
            else:  # rejoin, empty
                r = payload
                if r in errors:
                    continue
                live.add(r)
                clocks[r] = t
                router.add_replica(r)
            continue
        r = r_next
        try:
            res = handles[r].call("step")
        except Exception as err:  # noqa: BLE001 - any error of a replica is that replica's failure
            crash(r, clocks[r], err)
            continue
        steps.append((r, res.prefill_tokens, res.decodes, res.seconds))
        clocks[r] += (
            cost.seconds(res.prefill_tokens, res.decodes, res.moved_tokens)
            if clock == "model"
            else res.seconds
        )
        now = clocks[r]
        for b in res.batches:
            heapq.heappush(pending, (now, next(order), r, "events", b))
        for rid in res.first_token:
            if rid in inflight[r] and inflight[r][rid]["first"] is None:
                inflight[r][rid]["first"] = now
        for fin in res.finished:
            req = inflight[r].pop(fin["request_id"])
            heapq.heappush(pending, (now, next(order), r, "finish", fin["request_id"]))
            s = workload.sessions[req["s_idx"]]
            got[s.session_id].append(list(fin["output_ids"]))
            outputs[req["request_id"]] = list(fin["output_ids"])
            first = req["first"] if req["first"] is not None else now
            records.append(
                {
                    "request_id": req["request_id"],
                    "session": req["session"],
                    "tenant": req["tenant"],
                    "turn": req["turn"],
                    "replica": r,
                    "arrival": req["arrival"],
                    "ttft": first - req["arrival"],
                    "finish": now,
                    "prompt_tokens": len(req["prompt"]),
                    "cached_tokens": fin["num_cached_tokens"],
                    "preemptions": fin["num_preemptions"],
                    "restored_tokens": fin.get("restored_tokens", 0),
                }
            )
            if req["turn"] + 1 < s.num_turns:
                heapq.heappush(
                    arrivals,
                    (
                        now + s.think,
                        next(order),
                        "turn",
                        (req["s_idx"], req["turn"] + 1, now + s.think),
                    ),
                )
    flush(math.inf)  # the last steps' events and completions reach the router too
    stats = [{"error": errors[r]} if r in errors else handles[r].call("stats") for r in range(n)]
    records.sort(key=lambda x: (x["arrival"], x["request_id"]))
    failed.sort(key=lambda x: (x["arrival"], x["request_id"]))
    name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    return FleetResult(name, n, records, steps, outputs, router, stats, fail, failed, errors)
