"""What notebook 09_beyond_one_replica.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

import pandas as pd

from kvlab.cache import DEFAULT_BLOCK_SIZE
from kvlab.cache.kv_events import AllBlocksCleared, BlockStored, describe
from kvlab.cluster import POLICIES, CostModel, FleetResult, agree, simulate
from kvlab.lessons.common import pct


# --- 09_beyond_one_replica.ipynb, cell 5 ---
def events_of_one_request(model: Any, tokenizer: Any, prompt: Sequence[int], max_tokens: int = 20,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> list:
    """Run a request on a fresh engine with KV events on, reset its cache: the event batches."""
    from kvlab.engine import Engine, SamplingParams

    eng = Engine(model, tokenizer, num_blocks=64, block_size=block_size, enable_kv_events=True)
    eng.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.reset_prefix_cache()
    return eng.take_kv_events()


def events_table(batches: Sequence) -> pd.DataFrame:
    """One row per event: batch number, kind, blocks, parent, tokens, a one-line description."""
    rows = []
    for b in batches:
        for ev in b.events:
            stored = isinstance(ev, BlockStored)
            rows.append({"batch": b.seq, "event": type(ev).__name__,
                         "blocks": 0 if isinstance(ev, AllBlocksCleared) else len(ev.block_hashes),
                         "parent": (ev.parent_block_hash.hex()[:8]
                                    if stored and ev.parent_block_hash else None),
                         "tokens": len(ev.token_ids) if stored else 0, "describe": describe(ev, 8)})
    return pd.DataFrame(rows)


# --- 09_beyond_one_replica.ipynb, cell 8 ---
def simulate_with_replicas(workload, num_replicas: int, policy: str, *, num_blocks: int = 96,
                           block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[FleetResult, list]:
    """``simulate``, keeping the replicas so their caches can be compared to the router's index."""
    from kvlab.cluster.driver import run_fleet
    from kvlab.cluster.replica import LocalHandle, SimReplica

    replicas = [SimReplica(num_blocks, block_size) for _ in range(num_replicas)]
    result = run_fleet(workload, [LocalHandle(r) for r in replicas], policy, clock="model",
                       cost=CostModel())
    return result, replicas


def index_sentence(result: FleetResult, replicas: Sequence[Any]) -> str:
    """Whether the router's index (from events only) holds exactly each replica's cached hashes."""
    index = result.router.index
    same = [set(index.blocks.get(i, {})) == r.cached_hashes() for i, r in enumerate(replicas)]
    held = ", ".join(f"{len(r.cached_hashes())}" for r in replicas)
    return (f"the index against the replicas' own caches (blocks held: {held}): "
            + ("the same hashes on every replica" if all(same) else
               f"DIFFERENT on replica(s) {[i for i, ok in enumerate(same) if not ok]}"))


# --- 09_beyond_one_replica.ipynb, cell 11 ---
def sweep(workload, replicas: Sequence[int] = (1, 2, 4), policies: Sequence[str] = POLICIES, *,
          num_blocks: int = 96, cost: CostModel | None = None, **router_kwargs) -> pd.DataFrame:
    """Simulate each (replicas, policy): summary, mean TTFT, cold prefills, ``slowest_cold``."""
    rows = []
    for n in replicas:
        for p in policies:
            res = simulate(workload, n, p, num_blocks=num_blocks, cost=cost, **router_kwargs)
            recs = res.records
            slowest = max(recs, key=lambda r: r["ttft"])
            cold = [r["cached_tokens"] + r.get("restored_tokens", 0) == 0 for r in recs]  # no hit
            rows.append({**res.summary(), "ttft_mean": statistics.mean(r["ttft"] for r in recs),
                         "cold_prefills": sum(cold), "slowest_cold": cold[recs.index(slowest)],
                         "workload": workload.name})
    return pd.DataFrame(rows)


# --- 09_beyond_one_replica.ipynb, cell 13 ---
def _names(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def policy_sentences(df: pd.DataFrame) -> list[str]:
    """Sentences comparing the policies, each from the measured rows and with its verdict."""
    out = []
    for n in sorted(set(df.replicas)):
        d = df[df.replicas == n].set_index("policy")
        if n == 1:
            same = d.hit_rate.max() - d.hit_rate.min() < 1e-12
            how = "gives the same" if same else "does NOT give the same"
            note = "" if same else " (unexpected: with one replica there is no choice)"
            out.append(f"1 replica: every policy {how} hit rate ({pct(d.hit_rate.iloc[0])}){note}.")
            continue
        shown = d.hit_rate.map(pct)  # policies that print the same percentage are a tie
        top, bottom = shown[d.hit_rate.idxmax()], shown[d.hit_rate.idxmin()]
        if top == bottom:
            out.append(f"{n} replicas: every policy gives the same hit rate ({top}).")
        else:
            most, least = list(shown[shown == top].index), list(shown[shown == bottom].index)
            out.append(f"{n} replicas: {_names(most)} "
                       f"{'hits' if len(most) == 1 else 'tie for the'} most ({top}), "
                       f"{_names(least)} {'hits' if len(least) == 1 else 'tie for the'} "
                       f"least ({bottom})"
                       + (f"; round_robin {shown['round_robin']}."
                          if "round_robin" in set(d.index) - {*most, *least} else "."))
        if "kv_aware" in d.index and "round_robin" in d.index:
            k, r = d.loc["kv_aware"], d.loc["round_robin"]
            def cmp(a, b):
                return "lower" if a < b else "the same" if a == b else "higher"
            out.append(f"  kv_aware vs round_robin: hit rate {pct(k.hit_rate)} vs "
                       f"{pct(r.hit_rate)}; TTFT mean {1000 * k.ttft_mean:.1f} vs "
                       f"{1000 * r.ttft_mean:.1f} ms ({cmp(k.ttft_mean, r.ttft_mean)}), p99 "
                       f"{1000 * k.ttft_p99:.1f} vs {1000 * r.ttft_p99:.1f} ms "
                       f"({cmp(k.ttft_p99, r.ttft_p99)}); imbalance "
                       f"{k.imbalance:.2f} vs {r.imbalance:.2f}.")
    single = df[df.replicas == 1]
    if len(single) and len(df[df.replicas > 1]):
        one = single.hit_rate.iloc[0]
        rr = df[(df.replicas == df.replicas.max()) & (df.policy == "round_robin")].hit_rate
        if len(rr):
            out.append(f"Round robin on {df.replicas.max()} replicas hits {pct(rr.iloc[0])} "
                       f"against {pct(one)} on one: "
                       + ("spreading a prefix over replicas costs hits." if rr.iloc[0] < one else
                          "the bigger fleet cache outweighs the spreading here."))
    return [s for s in out if s]


# --- 09_beyond_one_replica.ipynb, cell 18 ---
def weight_sweep(workload, num_replicas: int = 4, weights: Sequence[float] = (0, 0.25, 1, 4, 16), *,
                 num_blocks: int = 96, cost: CostModel | None = None) -> pd.DataFrame:
    """kv_aware at several overlap weights: hit rate, imbalance, TTFT."""
    rows = []
    for w in weights:
        res = simulate(workload, num_replicas, "kv_aware", num_blocks=num_blocks, cost=cost,
                       weight=w)
        rows.append({"weight": w, **res.summary()})
    return pd.DataFrame(rows)


def weight_sentence(df: pd.DataFrame) -> str:
    """What the weight did over the whole sweep, read off the measured rows (not just its ends)."""
    ws = [f"{w:g}" for w in df.weight]
    best, calm = df.loc[df.hit_rate.idxmax()], df.loc[df.imbalance.idxmin()]
    line = (f"Weights {', '.join(ws)}: hit rate {', '.join(pct(h) for h in df.hit_rate)}; "
            f"imbalance {', '.join(f'{x:.2f}' for x in df.imbalance)}. "
            f"Highest hit rate at w = {best.weight:g} ({pct(best.hit_rate)}), "
            f"lowest imbalance at w = {calm.weight:g} ({calm.imbalance:.2f}). ")
    if df.hit_rate.is_monotonic_increasing and df.imbalance.is_monotonic_increasing:
        return line + ("As the weight grows, hits go up and balance goes down together: "
                       "the trade Dynamo's cost intends.")
    if calm.weight != df.weight.iloc[0]:
        return line + (f"w = {df.weight.iloc[0]:g} is not the most balanced point: it balances "
                       "active blocks, while the imbalance counts requests; no clean trade-off "
                       "on this workload.")
    return line + ("No clean trade-off on this workload: the two do not move together over "
                   "the sweep.")


# --- 09_beyond_one_replica.ipynb, cell 21 ---
def ray_fleet_run(workload, num_replicas: int = 2,
                  policies: Sequence[str] = ("round_robin", "kv_aware"), *,
                  num_blocks: int = 64, model: str | None = None) -> dict:
    """Real engines as Ray actors: each policy on the measured clock, then a modelled run the sim
    checks."""
    import time

    from kvlab.cluster import ray_available, ray_replicas, run_fleet, start_ray

    if not ray_available():
        return {"ray": False,
                "message": "Ray is not installed (pip install -e .[cluster]): simulation only."}
    t0 = time.perf_counter()
    try:
        start_ray(num_cpus=2, logging_level=logging.WARNING)  # its INFO lines would show in red
    except Exception as e:  # installed but would not start (tests/cluster fail on this instead)
        return {"ray": False, "message": f"Ray is installed but did not start "
                                         f"({type(e).__name__}: {e}): simulation only."}
    handles = ray_replicas(num_replicas, model=model, num_blocks=num_blocks,
                           block_size=DEFAULT_BLOCK_SIZE)
    startup = time.perf_counter() - t0
    rows, steps = [], []
    for p in policies:
        res = run_fleet(workload, handles, p, clock="measured")
        rows.append({**res.summary(), "clock": "measured"})
        steps += [(pf, d, s) for _, pf, d, s in res.steps]
    real = run_fleet(workload, handles, "kv_aware", clock="model")
    sim = simulate(workload, num_replicas, "kv_aware", num_blocks=num_blocks, replies=real.replies)
    report = agree(real, sim)
    import ray

    ray.shutdown()
    return {"ray": True,
            "message": f"{num_replicas} engine replicas as Ray actors (start-up {startup:.1f} s)",
            "rows": pd.DataFrame(rows), "agreement": report, "cost": CostModel.fit(steps),
            "steps": len(steps), "seconds": time.perf_counter() - t0, "real": real, "sim": sim}


def ray_sentences(out: dict, sim_rows: pd.DataFrame | None = None) -> list[str]:
    """What the Ray run measured, and whether the simulation reproduced it."""
    if not out.get("ray"):
        return [out["message"]]
    a = out["agreement"]
    lines = [out["message"] + f"; {out['steps']} engine steps measured in {out['seconds']:.1f} s "
             "in all.",
             "Ray run vs simulation (kv_aware, modelled clock): "
             f"{a['same_replica']}/{a['requests']} requests on the same replica, "
             f"{a['same_cached_tokens']}/{a['requests']} with the same cached tokens: "
             + ("they agree." if a["all_agree"] else
                "they DISAGREE (a bug: the simulation no longer mirrors the engine).")]
    c = out["cost"]
    lines.append(f"Step time fitted on the measured steps: {1000 * c.base:.2f} ms + "
                 f"{1e6 * c.per_prefill_token:.1f} us per prefill token + "
                 f"{1e3 * c.per_decode:.3f} ms per decode.")
    rows = out["rows"].set_index("policy")
    if {"kv_aware", "round_robin"} <= set(rows.index):
        k, r = rows.loc["kv_aware"], rows.loc["round_robin"]
        more = "more" if k.hit_rate > r.hit_rate else "not more"
        lines.append(f"Measured on real engines: kv_aware hits {pct(k.hit_rate)}, "
                     f"round_robin {pct(r.hit_rate)} ({more} for kv_aware); TTFT p99 "
                     f"{1000 * k.ttft_p99:.1f} vs {1000 * r.ttft_p99:.1f} ms.")
    return lines
