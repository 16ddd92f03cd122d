"""Prefill/decode split: one replica prefills and ships the blocks, another decodes (Dynamo's /
Mooncake's design).

``run_pd`` drives one-turn requests through two replicas on virtual clocks, as ``run_fleet`` does:
the prefill replica runs each prompt for one token (its TTFT), exports the prompt's full blocks into
the object store, and the decode replica gets ``prompt + first token`` with a fetch: it stages the
blocks in its host tier, restores them, computes only the partial last block, and decodes the rest.
Decode steps never share a step with a long prefill there, which is what the split buys (steadier
inter-token latency) at the price of a transfer per request. ``ttft`` = arrival -> first token on
the prefill replica; ``itl`` = (finish - first token) / (tokens - 1), transfer and the decode
replica's short prefill included. Request ids are ``run_fleet``'s (``"<session>/t0"``), so the two
runs of one workload compare request by request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from ..cache.hashing import prompt_block_hashes
from .cost import CostModel
from .driver import percentile
from .workloads import FleetWorkload

__all__ = ["itl_of", "pd_summary", "run_pd"]


def itl_of(record: dict) -> float:
    """Mean inter-token latency of one finished request (nan for a single token)."""
    n = record["output_tokens"]
    return (
        (record["finish"] - record["arrival"] - record["ttft"]) / (n - 1) if n > 1 else float("nan")
    )


def pd_summary(records: Sequence[dict], name: str) -> dict:
    """TTFT and inter-token latency p50/p99 (s) of finished requests."""
    ttft = [r["ttft"] for r in records]
    itl = [itl_of(r) for r in records if r["output_tokens"] > 1]
    return {
        "setup": name,
        "requests": len(records),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "restored_tokens": sum(r.get("restored_tokens", 0) for r in records),
    }


def run_pd(workload: FleetWorkload, prefill: Any, decode: Any, *, clock: str = "measured",
           cost: CostModel | None = None, fresh: bool = True) -> list[dict]:
    """Serve one-turn ``workload`` with ``prefill`` and ``decode`` handles; one record per request,
    arrival order."""
    if any(s.num_turns != 1 for s in workload.sessions):
        raise ValueError(
            "run_pd serves one-turn sessions (e.g. kvlab.cluster.from_prompts): a later turn's "
            "prompt would depend on replies routed through two replicas"
        )
    if clock not in ("model", "measured"):
        raise ValueError(f"clock must be 'model' or 'measured', got {clock!r}")
    cost = cost or CostModel()
    if fresh:
        prefill.call("fail")
        decode.call("fail")
    info = prefill.call("info")
    bs, fp = info["block_size"], info["model_fingerprint"]
    order = itertools.count()
    arrivals = [(s.start, next(order), s) for s in workload.sessions]
    heapq.heapify(arrivals)
    handles, clocks = (prefill, decode), [0.0, 0.0]
    inflight: list[dict] = [{}, {}]
    records = []
    while arrivals or inflight[0] or inflight[1]:
        busy = [k for k in (0, 1) if inflight[k]]
        k = min(busy, key=lambda k: (clocks[k], k)) if busy else None
        if arrivals and (k is None or arrivals[0][0] <= clocks[k]):
            t, _, s = heapq.heappop(arrivals)
            req = {
                "request_id": f"{s.session_id}/t0",
                "arrival": t,
                "prompt": list(s.users[0]),
                "max_tokens": s.reply_tokens[0],
                "reply": list(s.scripted_replies[0]),
            }
            if not inflight[0]:
                clocks[0] = max(clocks[0], t)
            inflight[0][req["request_id"]] = req
            prefill.call("add", req["request_id"], req["prompt"], 1, req["reply"][:1])
            continue
        res = handles[k].call("step")
        clocks[k] += (
            cost.seconds(res.prefill_tokens, res.decodes, res.moved_tokens)
            if clock == "model"
            else res.seconds
        )
        now = clocks[k]
        for fin in res.finished:
            req = inflight[k].pop(fin["request_id"])
            # first token out: ship the prompt's blocks, hand the request to the decode replica
            if k == 0:
                req["ttft"], req["first"] = now - req["arrival"], list(fin["output_ids"])
                ids = req["prompt"] + req["first"]
                hashes = prompt_block_hashes(ids[: (len(ids) - 1) // bs * bs], bs, fp)
                ref = prefill.call("export", hashes, None) if req["max_tokens"] > 1 else None
                if req["max_tokens"] == 1:
                    records.append(_record(req, now, req["first"], 0))
                    continue
                if not inflight[1]:
                    clocks[1] = max(clocks[1], now)
                inflight[1][req["request_id"]] = req
                decode.call(
                    "add", req["request_id"], ids, req["max_tokens"] - 1, req["reply"][1:], [ref]
                )
            else:
                records.append(
                    _record(
                        req,
                        now,
                        req["first"] + list(fin["output_ids"]),
                        fin.get("restored_tokens", 0),
                    )
                )
    records.sort(key=lambda r: (r["arrival"], r["request_id"]))
    return records


def _record(req: dict, finish: float, output_ids: list[int], restored: int) -> dict:
    return {
        "request_id": req["request_id"],
        "arrival": req["arrival"],
        "ttft": req["ttft"],
        "finish": finish,
        "prompt_tokens": len(req["prompt"]),
        "output_ids": output_ids,
        "output_tokens": len(output_ids),
        "restored_tokens": restored,
    }
