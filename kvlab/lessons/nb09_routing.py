"""Notebook 09 · Beyond one replica: KV events, cache-aware routing across engine replicas on Ray.

The experiments (all measured when called): KV events of one request on a real engine; the router's
index drawn from events; policies x replica counts on two workloads (model-free simulation, the same
driver as the Ray run); the kv_aware weight's trade-off; a replica failure; real engines as Ray actors,
checked against the simulation. Figures are pure ``fig_*`` functions; ``check_policy`` is the exercise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from kvlab.cache import DEFAULT_BLOCK_SIZE
from kvlab.cache.kv_events import AllBlocksCleared, BlockStored, describe
from kvlab.cluster import POLICIES, CostModel, FleetResult, agree, chat, from_prompts, simulate
from kvlab.lessons.common import Verdict, call_answer, verdict

__all__ = ["POLICIES", "chat_workload", "check_policy", "events_of_one_request", "events_table", "failure_runs",
           "failure_sentences", "ray_sentences",
           "fig_failure", "fig_index", "fig_policies", "fig_weight", "policy_sentences", "ray_fleet_run", "sweep",
           "index_sentence", "shared_prefix_tokens", "simulate_with_replicas", "sys512_workload", "weight_sentence", "weight_sweep"]


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


# --- workloads ---------------------------------------------------------------------------------------------
def chat_workload(smoke: bool, seed: int = 0):
    """The multi-tenant multi-turn chat of this notebook (smaller under SMOKE)."""
    if smoke:
        return chat(num_sessions=16, num_tenants=4, system_tokens=192, rate=6.0, seed=seed)
    return chat(num_sessions=48, num_tenants=6, system_tokens=256, rate=6.0, seed=seed)


def shared_prefix_tokens(workload) -> int:
    """How many leading tokens every session's first prompt has in common."""
    prompts = [s.prompt(0, []) for s in workload.sessions]
    n = 0
    while n < min(map(len, prompts)) and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def sys512_workload(vocab: int = 1024, seed: int = 0, rate: float = 20.0):
    """The series' sys512 (16 requests sharing a 512-token prefix) with Poisson arrivals."""
    from kvlab.lessons.workloads import sys512

    wl = sys512(vocab, seed=seed)
    return from_prompts(wl.prompts, wl.max_tokens, rate=rate, name="sys512", vocab=vocab, seed=seed)


# --- 1 · KV events -----------------------------------------------------------------------------------------
def events_of_one_request(model: Any, tokenizer: Any, prompt: Sequence[int], max_tokens: int = 20,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> list:
    """Run one request on a fresh engine with KV events on, then reset its cache: the event batches."""
    from kvlab.engine import Engine, SamplingParams

    eng = Engine(model, tokenizer, num_blocks=64, block_size=block_size, enable_kv_events=True)
    eng.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.reset_prefix_cache()
    return eng.take_kv_events()


def events_table(batches: Sequence) -> pd.DataFrame:
    """One row per event: batch sequence number, kind, blocks, parent, tokens, a one-line description."""
    rows = []
    for b in batches:
        for ev in b.events:
            rows.append({"batch": b.seq, "event": type(ev).__name__,
                         "blocks": 0 if isinstance(ev, AllBlocksCleared) else len(ev.block_hashes),
                         "parent": (ev.parent_block_hash.hex()[:8] if isinstance(ev, BlockStored) and ev.parent_block_hash
                                    else None),
                         "tokens": len(ev.token_ids) if isinstance(ev, BlockStored) else 0, "describe": describe(ev, 8)})
    return pd.DataFrame(rows)


# --- 2 · the index drawn -----------------------------------------------------------------------------------
def _layout(children: dict, max_roots: int) -> dict:
    """(depth, row) of every node of a forest given as parent -> children (None = the roots): leaves in rows."""
    pos: dict = {}
    row = 0

    def place(h, depth):
        nonlocal row
        kids = sorted(children.get(h, []))
        if not kids:
            pos[h] = (depth, row)
            row += 1
            return
        for k in kids:
            place(k, depth + 1)
        pos[h] = (depth, sum(pos[k][1] for k in kids) / len(kids))

    for root in sorted(children.get(None, []))[:max_roots]:
        place(root, 0)
    return pos


def fig_index(result: FleetResult, max_blocks: int = 400):
    """Each replica's cached blocks as the index knows them: trees by parent link, coloured by tenant prefix."""
    import matplotlib.pyplot as plt

    index = result.router.index
    reps = sorted(index.blocks)
    fig, axes = plt.subplots(1, max(1, len(reps)), figsize=(3.2 * max(1, len(reps)), 3.2), squeeze=False)
    for ax, r in zip(axes[0], reps):
        held = set(index.blocks[r])
        children: dict = {}
        for h in held:
            children.setdefault(index.parent.get(h) if index.parent.get(h) in held else None, []).append(h)
        pos = _layout(children, max_blocks)
        for h, (x, y) in pos.items():
            p = index.parent.get(h)
            if p in pos:
                ax.plot([pos[p][0], x], [pos[p][1], y], color="0.6", lw=0.6)
        if pos:
            xs, ys = zip(*pos.values())
            ax.scatter(xs, ys, s=6, color=f"C{r}")
        ax.set_title(f"replica {r}: {len(held)} blocks")
        ax.set_xlabel("block position in the prompt")
        ax.set_yticks([])
    axes[0][0].set_ylabel("cached chains")
    fig.suptitle("The router's index, built only from KV events (one dot per cached block)")
    fig.tight_layout()
    return fig


# --- 3 · policies x replicas --------------------------------------------------------------------------------
def sweep(workload, replicas: Sequence[int] = (1, 2, 4), policies: Sequence[str] = POLICIES, *, num_blocks: int = 96,
          cost: CostModel | None = None, **router_kwargs) -> pd.DataFrame:
    """Simulate every (replica count, policy): one summary row each."""
    rows = []
    for n in replicas:
        for p in policies:
            s = simulate(workload, n, p, num_blocks=num_blocks, cost=cost, **router_kwargs).summary()
            rows.append({**s, "workload": workload.name})
    return pd.DataFrame(rows)


def fig_policies(df: pd.DataFrame, title: str = ""):
    """Hit rate and TTFT p99 per policy, one bar per replica count."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    piv = df.pivot(index="policy", columns="replicas", values="hit_rate").reindex([p for p in POLICIES if p in set(df.policy)])
    piv.plot.bar(ax=a, rot=20)
    a.set_ylabel("fleet hit rate (cached / prompt tokens)")
    a.set_title("hit rate")
    piv = df.pivot(index="policy", columns="replicas", values="ttft_p99").reindex(piv.index)
    (piv * 1000).plot.bar(ax=b, rot=20)
    b.set_ylabel("TTFT p99 (ms, modelled clock)")
    b.set_title("TTFT p99")
    a.get_legend().remove()
    b.legend(title="replicas", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    for ax in (a, b):
        ax.set_xlabel("")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


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
            out.append(f"1 replica: every policy {'gives the same' if same else 'does NOT give the same'} hit rate "
                       f"({pct(d.hit_rate.iloc[0])}){'' if same else ' (unexpected: with one replica there is no choice)'}.")
            continue
        shown = d.hit_rate.map(pct)  # policies that print the same percentage are a tie
        top, bottom = shown[d.hit_rate.idxmax()], shown[d.hit_rate.idxmin()]
        if top == bottom:
            out.append(f"{n} replicas: every policy gives the same hit rate ({top}).")
        else:
            most, least = list(shown[shown == top].index), list(shown[shown == bottom].index)
            out.append(f"{n} replicas: {_names(most)} {'hits' if len(most) == 1 else 'tie for the'} most ({top}), "
                       f"{_names(least)} {'hits' if len(least) == 1 else 'tie for the'} least ({bottom})"
                       + (f"; round_robin {shown['round_robin']}." if "round_robin" in set(d.index) - {*most, *least}
                          else "."))
        if "kv_aware" in d.index and "round_robin" in d.index:
            k, r = d.loc["kv_aware"], d.loc["round_robin"]
            verb = "lower" if k.ttft_p99 < r.ttft_p99 else "not lower"
            out.append(f"  kv_aware vs round_robin: hit rate {pct(k.hit_rate)} vs {pct(r.hit_rate)}, TTFT p99 "
                       f"{1000 * k.ttft_p99:.1f} vs {1000 * r.ttft_p99:.1f} ms ({verb}), imbalance {k.imbalance:.2f} vs "
                       f"{r.imbalance:.2f}.")
    single = df[df.replicas == 1]
    if len(single) and len(df[df.replicas > 1]):
        one = single.hit_rate.iloc[0]
        rr = df[(df.replicas == df.replicas.max()) & (df.policy == "round_robin")].hit_rate
        if len(rr):
            out.append(f"Round robin on {df.replicas.max()} replicas hits {pct(rr.iloc[0])} against {pct(one)} on one: "
                       + ("spreading a prefix over replicas costs hits." if rr.iloc[0] < one else
                          "the bigger fleet cache outweighs the spreading here."))
    return [s for s in out if s]


def simulate_with_replicas(workload, num_replicas: int, policy: str, *, num_blocks: int = 96,
                           block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[FleetResult, list]:
    """``simulate``, keeping the replicas so their caches can be compared with the router's index."""
    from kvlab.cluster.driver import run_fleet
    from kvlab.cluster.replica import LocalHandle, SimReplica

    replicas = [SimReplica(num_blocks, block_size) for _ in range(num_replicas)]
    result = run_fleet(workload, [LocalHandle(r) for r in replicas], policy, clock="model", cost=CostModel())
    return result, replicas


def index_sentence(result: FleetResult, replicas: Sequence[Any]) -> str:
    """Whether the router's index (built from events only) holds exactly each replica's cached hashes."""
    index = result.router.index
    same = [set(index.blocks.get(i, {})) == r.cached_hashes() for i, r in enumerate(replicas)]
    held = ", ".join(f"{len(r.cached_hashes())}" for r in replicas)
    return (f"the index against the replicas' own caches (blocks held: {held}): "
            + ("the same hashes on every replica" if all(same) else
               f"DIFFERENT on replica(s) {[i for i, ok in enumerate(same) if not ok]}"))


# --- 4 · the weight ---------------------------------------------------------------------------------------
def weight_sweep(workload, num_replicas: int = 4, weights: Sequence[float] = (0, 0.25, 1, 4, 16), *,
                 num_blocks: int = 96, cost: CostModel | None = None) -> pd.DataFrame:
    """kv_aware at several overlap weights: hit rate, imbalance, TTFT."""
    rows = []
    for w in weights:
        rows.append({"weight": w, **simulate(workload, num_replicas, "kv_aware", num_blocks=num_blocks, cost=cost,
                                             weight=w).summary()})
    return pd.DataFrame(rows)


def fig_weight(df: pd.DataFrame):
    """Hit rate against load imbalance as the weight grows."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(df.imbalance, df.hit_rate, "o-")
    for _, r in df.iterrows():
        ax.annotate(f"w={r.weight:g}", (r.imbalance, r.hit_rate), textcoords="offset points", xytext=(5, -10))
    ax.set_xlabel("load imbalance (max / mean requests per replica)")
    ax.set_ylabel("fleet hit rate")
    ax.set_title("kv_aware: weight x blocks to prefill + active blocks")
    fig.tight_layout()
    return fig


def weight_sentence(df: pd.DataFrame) -> str:
    """What the weight did over the whole sweep, read off the measured rows (not only its two ends)."""
    ws = [f"{w:g}" for w in df.weight]
    best, calm = df.loc[df.hit_rate.idxmax()], df.loc[df.imbalance.idxmin()]
    line = (f"Weights {', '.join(ws)}: hit rate {', '.join(pct(h) for h in df.hit_rate)}; imbalance "
            f"{', '.join(f'{x:.2f}' for x in df.imbalance)}. Highest hit rate at w = {best.weight:g} ({pct(best.hit_rate)}), "
            f"lowest imbalance at w = {calm.weight:g} ({calm.imbalance:.2f}). ")
    if df.hit_rate.is_monotonic_increasing and df.imbalance.is_monotonic_increasing:
        return line + "As the weight grows, hits go up and balance goes down together: the trade Dynamo's cost intends."
    if calm.weight != df.weight.iloc[0]:
        return line + (f"w = {df.weight.iloc[0]:g} is not the most balanced point: it balances active blocks, while the "
                       "imbalance counts requests; no clean trade-off on this workload.")
    return line + "No clean trade-off on this workload: the two do not move together over the sweep."


# --- 5 · a replica fails ------------------------------------------------------------------------------------
def failure_runs(workload, num_replicas: int = 4, policies: Sequence[str] = ("round_robin", "session_affinity", "kv_aware"),
                 *, at: float = 3.0, rejoin_after: float | None = 2.0, num_blocks: int = 96, window: float = 1.0,
                 cost: CostModel | None = None) -> pd.DataFrame:
    """Replica 0 fails at ``at`` (its cache is lost) and rejoins empty: hit rate per arrival window, per policy."""
    rows = []
    for p in policies:
        res = simulate(workload, num_replicas, p, num_blocks=num_blocks, cost=cost, fail=(at, 0, rejoin_after))
        for t, h, n in res.hit_rate_over_time(window):
            rows.append({"policy": p, "t": t, "hit_rate": h, "requests": n})
    return pd.DataFrame(rows)


def fig_failure(df: pd.DataFrame, at: float, rejoin_after: float | None):
    """Hit rate per arrival window; the failure and the rejoin marked."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for p, d in df.groupby("policy", sort=False):
        ax.plot(d.t, d.hit_rate, "o-", label=p, ms=3)
    ax.axvline(at, color="C3", ls="--", label="replica 0 fails")
    if rejoin_after is not None:
        ax.axvline(at + rejoin_after, color="C2", ls=":", label="it rejoins, empty")
    ax.set_xlabel("arrival time (s, modelled clock)")
    ax.set_ylabel("hit rate of the requests arriving")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- 6 · real engines on Ray -------------------------------------------------------------------------------
RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropRayTokenNotice(logging.Filter):
    """Drops Ray's one-line notice that a new local cluster uses token authentication (its default)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_TOKEN_NOTICE)


def _quiet_ray_token_notice() -> None:
    """Silence that notice only: a participant would read it as an error. Setting ``RAY_AUTH_MODE=token``
    instead (Ray's advice) made ``ray.init`` fail here with InvalidAuthToken, so Ray keeps its default."""
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropRayTokenNotice) for f in log.filters):
        log.addFilter(_DropRayTokenNotice())


def ray_fleet_run(workload, num_replicas: int = 2, policies: Sequence[str] = ("round_robin", "kv_aware"), *,
                  num_blocks: int = 64, model: str | None = None) -> dict:
    """Real engines as Ray actors: each policy with the measured clock, then one modelled run checked by the sim.

    Returns ``{"ray": bool, "message", "rows" (summaries), "agreement", "cost" (fitted), "seconds"}``; without
    Ray, ``ray`` is False and the message says why (the notebook then stays with the simulation).
    """
    import time

    from kvlab.cluster import ray_available, ray_replicas, run_fleet, start_ray

    if not ray_available():
        return {"ray": False, "message": "Ray is not installed (pip install -e .[cluster]): simulation only."}
    _quiet_ray_token_notice()
    t0 = time.perf_counter()
    try:
        start_ray(num_cpus=2, logging_level=logging.WARNING)  # Ray's start-up INFO lines would show in red
    except Exception as e:  # installed but it would not start here (tests/cluster/test_cluster.py fails on this instead)
        return {"ray": False, "message": f"Ray is installed but did not start ({type(e).__name__}: {e}): "
                                         "simulation only."}
    handles = ray_replicas(num_replicas, model=model, num_blocks=num_blocks, block_size=DEFAULT_BLOCK_SIZE)
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
    return {"ray": True, "message": f"{num_replicas} engine replicas as Ray actors (start-up {startup:.1f} s)",
            "rows": pd.DataFrame(rows), "agreement": report, "cost": CostModel.fit(steps), "steps": len(steps),
            "seconds": time.perf_counter() - t0, "real": real, "sim": sim}


# --- exercise -------------------------------------------------------------------------------------------
def check_policy(my_policy: Callable | None, smoke: bool = True) -> Verdict:
    """Exercise: ``my_policy(router, request) -> replica`` routes by cache overlap and load, using the index only.

    Passes when, on 4 replicas of a chat workload, its hit rate beats round robin's by 10 points or more and
    the imbalance (max/mean requests per replica) stays at or below 2.
    """
    hint = ("router.hashes(request) gives the prompt's block hashes; router.index.overlap(r, hashes) how many "
            "leading blocks replica r holds; router.active_blocks(r) the blocks of its requests in flight. Prefer "
            "the largest overlap, but do not pile everything on one replica: subtract something for load.")
    wl = chat(num_sessions=16 if smoke else 32, num_tenants=4, system_tokens=192, rate=6.0, seed=1)
    res, bad = call_answer((lambda: simulate(wl, 4, my_policy, num_blocks=96)) if my_policy is not None else None,
                           hint=hint, name="my_policy")
    if bad is not None:
        return bad
    s = res.summary()
    ref = simulate(wl, 4, "round_robin", num_blocks=96).summary()
    ok = s["hit_rate"] >= ref["hit_rate"] + 0.10 and s["imbalance"] <= 2.0
    return verdict(ok, f"hit rate {pct(s['hit_rate'])} (round robin {pct(ref['hit_rate'])}), imbalance "
                       f"{s['imbalance']:.2f}",
                   f"hit rate {pct(s['hit_rate'])} vs round robin's {pct(ref['hit_rate'])} (needs 10 points more), "
                   f"imbalance {s['imbalance']:.2f} (needs <= 2). " + hint)


def failure_sentences(df: pd.DataFrame, at: float, rejoin_after: float | None, window: float = 1.0) -> list[str]:
    """Per policy: hit rate of the windows before the failure, the worst window after it, and the last windows."""
    out = []
    for p, d in df.groupby("policy", sort=False):
        d = d.dropna()
        before = d[(d.t + window <= at) & (d.t >= window)]  # skip the cold first window
        after = d[(d.t >= at) & (d.t < at + (rejoin_after or 2.0) + window)]
        if not len(before) or not len(after):
            continue
        b = (before.hit_rate * before.requests).sum() / before.requests.sum()
        worst = after.hit_rate.min()
        tail = d[d.t >= at + (rejoin_after or 2.0) + window]
        rec = (tail.hit_rate * tail.requests).sum() / tail.requests.sum() if len(tail) and tail.requests.sum() else math.nan
        dip = worst < b - 0.01  # a dip: at least a point below the level before
        out.append(f"{p}: {pct(b)} before the failure, {pct(worst)} in the worst window after it "
                   f"({'a dip' if dip else 'no dip of a point or more'}), {pct(rec)} once it has rejoined"
                   + ("" if math.isnan(rec) else (" (recovered to at least the level before)" if rec >= b else
                                                  " (not back to the level before)")) + ".")
    return out


def ray_sentences(out: dict, sim_rows: pd.DataFrame | None = None) -> list[str]:
    """What the Ray run measured, and whether the simulation reproduced it."""
    if not out.get("ray"):
        return [out["message"]]
    a = out["agreement"]
    lines = [out["message"] + f"; {out['steps']} engine steps measured in {out['seconds']:.1f} s in all.",
             f"Ray run vs simulation (kv_aware, modelled clock): {a['same_replica']}/{a['requests']} requests on the same "
             f"replica, {a['same_cached_tokens']}/{a['requests']} with the same cached tokens: "
             + ("they agree." if a["all_agree"] else "they DISAGREE (a bug: the simulation no longer mirrors the engine).")]
    c = out["cost"]
    lines.append(f"Step time fitted on the measured steps: {1000 * c.base:.2f} ms + {1e6 * c.per_prefill_token:.1f} us per "
                 f"prefill token + {1e3 * c.per_decode:.3f} ms per decode.")
    rows = out["rows"].set_index("policy")
    if {"kv_aware", "round_robin"} <= set(rows.index):
        k, r = rows.loc["kv_aware"], rows.loc["round_robin"]
        lines.append(f"Measured on real engines: kv_aware hits {pct(k.hit_rate)}, round_robin {pct(r.hit_rate)} "
                     f"({'more' if k.hit_rate > r.hit_rate else 'not more'} for kv_aware); TTFT p99 "
                     f"{1000 * k.ttft_p99:.1f} vs {1000 * r.ttft_p99:.1f} ms.")
    return lines
