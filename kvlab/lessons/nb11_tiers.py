"""Notebook 11 · Beyond one pool: a host tier for evicted blocks, K/V moved between replicas, a prefill/decode split.

The experiments (all measured when called): the crossover of copying a prefix's K/V against recomputing it, by
prefix length; the host tier under pool pressure on a real engine; route-to-cache vs pull-the-cache vs round
robin on notebook 09's workloads (simulated with a cost model from the crossover, then on real engines, checked
against the simulation); a prefill/decode split against co-located replicas. Figures are pure ``fig_*``
functions; ``check_worth_pulling`` is the exercise.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from kvlab.cache.hashing import prompt_block_hashes
from kvlab.cache.host_tier import collect_blocks
from kvlab.cluster import (
    CostModel,
    EngineReplica,
    LocalHandle,
    agree,
    from_prompts,
    pd_summary,
    run_fleet,
    run_pd,
    simulate,
)
from kvlab.cluster.object_store import LocalObjectStore, PickleObjectStore
from kvlab.lessons.common import Verdict, call_answer, verdict

__all__ = ["check_worth_pulling", "crossover", "crossover_sentences", "failure_demo", "fig_crossover", "fig_policies", "fig_tier",
           "pd_run", "pd_sentences", "pd_workload", "per_token_costs", "policy_sentences", "policy_table",
           "real_policy_table", "real_sentences",
           "tier_sentences", "tier_under_pressure", "tiers_are_ram", "worth_pulling_reference"]

BS = 16


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


def ms(x: float) -> str:
    """Seconds as milliseconds with two decimals."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:.2f} ms"


def tiers_are_ram(device: Any) -> str:
    """Say what "host tier" and "transfer" mean on this machine."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return ("The model runs on the CPU: the pool and the host tier are both RAM, so an offload or a restore is a "
                "memcpy and a 'transfer' between replicas is a serialization in this process. The times below say "
                "what a copy costs against a recompute here, not what PCIe or a network would.")
    return (f"The model runs on {dev}: the host tier is CPU RAM, so an offload or a restore is a real device <-> host "
            "copy; a transfer between replicas is a serialization in this process (no network).")


def _rand(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


# --- 1 · the crossover -------------------------------------------------------------------------------------
def crossover(model: Any, tokenizer: Any, lengths: Sequence[int] = (16, 64, 128, 256, 512, 768), repeats: int = 3,
              seed: int = 0, torch_threads: int | None = 1) -> pd.DataFrame:
    """TTFT of a prompt whose first ``L`` tokens are recomputed, restored from the host tier, or fetched from a peer.

    One row per ``L`` (the fastest of ``repeats``: the least disturbed by other work on the machine): ``recompute_s`` (cold cache), ``tier_s`` (the prefix was evicted to
    the host tier: restored), ``transfer_s`` (a peer exports it, it is pickled and unpickled as between processes,
    staged and restored: the whole path), the bytes moved, and the copy seconds alone (host -> pool).
    ``torch_threads``: as the engine replicas use (``EngineReplica``'s default, 1); None leaves torch's setting.
    """
    import torch

    before = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        return _crossover(model, tokenizer, lengths, repeats, seed)
    finally:
        torch.set_num_threads(before)


def _crossover(model: Any, tokenizer: Any, lengths: Sequence[int], repeats: int, seed: int) -> pd.DataFrame:
    from kvlab.engine import Engine, SamplingParams

    rng = random.Random(f"nb11-crossover:{seed}")
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    nb = max(lengths) // BS + 2  # room for the longest prompt; evicting the pool empties it whole
    cold = Engine(model, tokenizer, num_blocks=nb + 2)
    tiered = Engine(model, tokenizer, num_blocks=nb, host_tier_bytes=64 << 20)
    peer = Engine(model, tokenizer, num_blocks=nb + 2, host_tier_bytes=64 << 20)
    fp = tiered.block_manager.model_fingerprint
    for eng in (cold, tiered, peer):
        eng.generate([_rand(max(lengths) + 1, rng)], sp)  # warm-up
    rows = []
    for L in lengths:
        rec, tie, tra, copy = [], [], [], []
        for _ in range(repeats):
            p = _rand(L + 1, rng)  # L tokens of prefix (L // 16 blocks) + 1 to compute
            t0 = time.perf_counter()
            cold.generate([p], sp)
            rec.append(time.perf_counter() - t0)
            tiered.generate([p], sp)
            _evict_everything(tiered)  # p's blocks go to the host tier
            before = tiered.host_tier.seconds_in
            t0 = time.perf_counter()
            out = tiered.generate([p], sp)[0]
            tie.append(time.perf_counter() - t0)
            copy.append(tiered.host_tier.seconds_in - before)
            assert out.num_restored_tokens == L // BS * BS, (L, out.num_restored_tokens)
            store = PickleObjectStore()  # ``cold`` ran p: its pool holds the prefix, it is the holder
            hashes = prompt_block_hashes(p[: L // BS * BS], BS, fp)
            t0 = time.perf_counter()
            entries = collect_blocks(cold.block_manager, None, hashes, _reader(cold))
            peer.host_tier.stage(store.get(store.put(entries)))
            got = peer.generate([p], sp)[0]
            tra.append(time.perf_counter() - t0)
            assert got.num_restored_tokens == L // BS * BS
            peer.reset_prefix_cache()
        rows.append({"prefix_tokens": L // BS * BS, "recompute_s": min(rec), "tier_s": min(tie), "transfer_s": min(tra),
                     "copy_s": min(copy), "bytes": L // BS * tiered.store.bytes_per_block})
    df = pd.DataFrame(rows)
    for k in ("recompute", "tier", "transfer"):
        df[f"{k}_us_per_token"] = 1e6 * df[f"{k}_s"] / df.prefix_tokens
    return df


def _evict_everything(engine: Any) -> None:
    """Evict every cached block of an idle engine (into its host tier) without running the model.

    A request takes every block and is dropped before any forward, as a failed step's request is: its blocks
    leave the cache (``free(..., uncache_from=0)``), so nobody can hit the K/V it never wrote.
    """
    bm = engine.block_manager
    bm.allocate("evict-all", list(range(3, 3 + bm.num_blocks * bm.block_size)))
    bm.free("evict-all", uncache_from=0)


def _reader(engine: Any) -> Callable[[int], tuple]:
    from kvlab.engine.offload import to_wire

    store = engine.store

    def read(block_id: int) -> tuple:
        k, v = store.k[:, block_id].to("cpu", copy=True), store.v[:, block_id].to("cpu", copy=True)
        return (to_wire(k), to_wire(v)), store.bytes_per_block
    return read


def per_token_costs(df: pd.DataFrame) -> dict[str, float]:
    """Seconds per prefix token at the longest prefix measured (where a fixed cost weighs least), per path."""
    big = df.iloc[-1]
    return {k: float(big[f"{k}_s"]) / float(big.prefix_tokens) for k in ("recompute", "tier", "transfer")}


def fig_crossover(df: pd.DataFrame):
    """TTFT against prefix length: recomputed, restored from the host tier, fetched from a peer."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for k, label in (("recompute", "recompute the prefix"), ("tier", "restore from the host tier"),
                     ("transfer", "fetch from a peer (pickled)")):
        a.plot(df.prefix_tokens, 1000 * df[f"{k}_s"], "o-", label=label)
        b.plot(df.prefix_tokens, df[f"{k}_us_per_token"], "o-", label=label)
    a.set_xlabel("prefix tokens")
    a.set_ylabel("TTFT (ms, wall)")
    a.set_title("time to first token")
    b.set_xlabel("prefix tokens")
    b.set_ylabel("µs per prefix token")
    b.set_yscale("log")
    b.set_title("per prefix token")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def crossover_sentences(df: pd.DataFrame) -> list[str]:
    """Where moving K/V beats recomputing it, read off the measured rows."""
    out = []
    for k, name in (("tier", "restoring from the host tier"), ("transfer", "fetching from a peer")):
        wins = df[df[f"{k}_s"] < df.recompute_s].prefix_tokens.tolist()
        loses = df[df[f"{k}_s"] >= df.recompute_s].prefix_tokens.tolist()
        if not loses:
            out.append(f"{name.capitalize()} beats recomputing at every prefix length measured "
                       f"({int(df.prefix_tokens.min())}-{int(df.prefix_tokens.max())} tokens): no crossover in this range.")
        elif not wins:
            out.append(f"{name.capitalize()} never beats recomputing here (up to {int(df.prefix_tokens.max())} tokens).")
        else:
            out.append(f"{name.capitalize()} beats recomputing from {int(min(wins))} prefix tokens on"
                       + (f" (not at {', '.join(str(int(x)) for x in loses)})" if loses else "") + ".")
    big = df.iloc[-1]
    out.append(f"At {int(big.prefix_tokens)} tokens ({big.bytes / 1024:.0f} KiB of K/V): recompute {ms(big.recompute_s)}, "
               f"tier {ms(big.tier_s)} (of which the copy back {ms(big.copy_s)}), transfer {ms(big.transfer_s)}.")
    return out


# --- 2 · the host tier under pool pressure -----------------------------------------------------------------
def tier_under_pressure(workload, num_blocks: int = 48, tier_blocks: Sequence[int] = (0, 64, 256), *,
                        model: str | None = None, **engine_kw: Any) -> pd.DataFrame:
    """One real engine replica, a pool too small for the workload, host tiers of several sizes: measured clock."""
    rows = []
    for tb in tier_blocks:
        rep = EngineReplica(model, num_blocks=num_blocks, block_size=BS, tier_blocks=tb or None, offload=True,
                            **engine_kw)
        res = run_fleet(workload, [LocalHandle(rep)], "round_robin", clock="measured")
        st = rep.stats()
        s = res.summary()
        rows.append({"tier_blocks": tb, "pool_hit_rate": s["hit_rate"] - s["restored_rate"],
                     "restored_rate": s["restored_rate"], "served_rate": s["hit_rate"], "ttft_p50": s["ttft_p50"],
                     "ttft_p99": s["ttft_p99"], "evictions": st["evictions"],
                     "bytes_to_host": st.get("bytes_to_host", 0), "bytes_from_host": st.get("bytes_from_host", 0),
                     "copy_s": st.get("seconds_to_host", 0.0) + st.get("seconds_from_host", 0.0)})
    return pd.DataFrame(rows)


def fig_tier(df: pd.DataFrame):
    """Served tokens by kind (pool hit, restored from the tier) and TTFT p99, per tier size."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = [str(t) for t in df.tier_blocks]
    a.bar(x, df.pool_hit_rate, label="pool hit")
    a.bar(x, df.restored_rate, bottom=df.pool_hit_rate, label="restored from the host tier")
    a.set_xlabel("host tier (blocks; 0 = none)")
    a.set_ylabel("share of prompt tokens not computed")
    a.legend(fontsize=8)
    a.set_title("cached tokens, two kinds")
    b.bar(x, 1000 * df.ttft_p50, label="p50")
    b.bar(x, 1000 * (df.ttft_p99 - df.ttft_p50), bottom=1000 * df.ttft_p50, label="p99")
    b.set_xlabel("host tier (blocks; 0 = none)")
    b.set_ylabel("TTFT (ms, measured)")
    b.legend(fontsize=8)
    b.set_title("TTFT")
    fig.tight_layout()
    return fig


def tier_sentences(df: pd.DataFrame) -> list[str]:
    """What the tier did to hits and TTFT, from the measured rows."""
    base, best = df.iloc[0], df.iloc[-1]
    out = [f"Without a tier {pct(base.served_rate)} of prompt tokens were served from the pool; with {int(best.tier_blocks)} "
           f"tier blocks {pct(best.served_rate)} ({pct(best.pool_hit_rate)} pool hits + {pct(best.restored_rate)} restored): "
           + ("the tier turned evictions into hits." if best.served_rate > base.served_rate else "no gain here.")]
    out.append(f"TTFT p50 {ms(base.ttft_p50)} -> {ms(best.ttft_p50)}, p99 {ms(base.ttft_p99)} -> {ms(best.ttft_p99)} "
               f"({'lower' if best.ttft_p99 < base.ttft_p99 else 'not lower'} at p99); the tier moved "
               f"{best.bytes_to_host / 2**20:.1f} MiB out and {best.bytes_from_host / 2**20:.1f} MiB back in "
               f"{ms(best.copy_s)} of copying.")
    return out


# --- 3 · route to the cache, or pull the cache -------------------------------------------------------------
def policy_table(workloads: Sequence, replicas: Sequence[int] = (2, 4),
                 policies: Sequence[str] = ("round_robin", "kv_aware", "pull"), *, num_blocks: int = 96,
                 cost: CostModel | None = None) -> pd.DataFrame:
    """Simulated rows (modelled clock) per workload x replicas x policy: served rate, fetched share, TTFT, imbalance."""
    rows = []
    for wl in workloads:
        for n in replicas:
            for p in policies:
                s = simulate(wl, n, p, num_blocks=num_blocks, cost=cost).summary()
                rows.append({"workload": wl.name, **s})
    return pd.DataFrame(rows)[["workload", "replicas", "policy", "hit_rate", "restored_rate", "ttft_p50", "ttft_p99",
                               "imbalance", "preemptions"]]


def real_policy_table(workload, num_replicas: int = 2, policies: Sequence[str] = ("round_robin", "kv_aware", "pull"),
                      *, num_blocks: int = 64, model: str | None = None, ray: bool = False, **engine_kw: Any) -> dict:
    """Real engines (measured clock), then pull once on the modelled clock replayed by the simulation.

    ``ray=False``: engine replicas in this process, blocks through an in-process object store; ``ray=True``: Ray
    actors and Ray's object store (returns ``{"error": ...}`` when Ray is missing or will not start).
    """
    t0 = time.perf_counter()
    if ray:
        from kvlab.cluster import ray_available, ray_replicas, start_ray

        if not ray_available():
            return {"error": "Ray is not installed (pip install -e .[cluster])"}
        try:
            start_ray(num_cpus=2)
        except Exception as e:  # noqa: BLE001 - installed but it would not start here
            return {"error": f"Ray did not start ({type(e).__name__}: {e})"}
        handles = ray_replicas(num_replicas, model=model, num_blocks=num_blocks, block_size=BS, tier_blocks=num_blocks,
                               **engine_kw)
    else:
        store = LocalObjectStore()
        handles = [LocalHandle(EngineReplica(model, num_blocks=num_blocks, block_size=BS, tier_blocks=num_blocks,
                                             object_store=store, **engine_kw)) for _ in range(num_replicas)]
    rows, replies = [], {}
    for p in policies:
        res = run_fleet(workload, handles, p, clock="measured")
        rows.append({"workload": workload.name, **res.summary()})
        replies[p] = res.replies
    real = run_fleet(workload, handles, "pull", clock="model")
    sim = simulate(workload, num_replicas, "pull", num_blocks=num_blocks, tier_blocks=num_blocks, replies=real.replies)
    df = pd.DataFrame(rows)[["workload", "replicas", "policy", "hit_rate", "restored_rate", "ttft_p50", "ttft_p99",
                             "imbalance"]]
    same = all(r == replies[policies[0]] for r in replies.values())
    if ray:
        import ray as ray_mod

        ray_mod.shutdown()
    return {"rows": df, "agreement": agree(real, sim), "same_tokens": same, "seconds": time.perf_counter() - t0,
            "backend": "Ray actors" if ray else "engines in this process"}


def real_sentences(out: dict) -> list[str]:
    """What the real run measured, and whether the simulation reproduced pull's routing and hits."""
    if "error" in out:
        return [out["error"] + ": no real run."]
    a = out["agreement"]
    return [f"{out['backend']}, {out['seconds']:.1f} s in all. Pull on real engines vs its model-free replay: "
            f"{a['same_replica']}/{a['requests']} requests on the same replica, {a['same_cached_tokens']}/{a['requests']} "
            "with the same cached tokens: " + ("they agree." if a["all_agree"] else "they DISAGREE (a bug)."),
            "Every policy's replies are " + ("the same tokens: fetched K/V changes no output." if out["same_tokens"]
                                              else "NOT the same tokens across policies (a bug).")]


def fig_policies(df: pd.DataFrame):
    """Served rate (pool hits + fetched) and TTFT p99 per policy, one panel per workload, bars per replica count."""
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(df.workload))
    fig, axes = plt.subplots(1, 2 * len(wls), figsize=(5.2 * len(wls) * 2 / 1.6, 3.6), squeeze=False)
    for i, wl in enumerate(wls):
        d = df[df.workload == wl]
        order = list(dict.fromkeys(d.policy))
        d.pivot(index="policy", columns="replicas", values="hit_rate").reindex(order).plot.bar(ax=axes[0][2 * i], rot=15)
        axes[0][2 * i].set_ylabel("served without compute (share)")
        axes[0][2 * i].set_title(f"{wl}: hit + fetched")
        (1000 * d.pivot(index="policy", columns="replicas", values="ttft_p99").reindex(order)).plot.bar(
            ax=axes[0][2 * i + 1], rot=15)
        axes[0][2 * i + 1].set_ylabel("TTFT p99 (ms, modelled clock)")
        axes[0][2 * i + 1].set_title(f"{wl}: TTFT p99")
        for ax in axes[0][2 * i: 2 * i + 2]:
            ax.legend(title="replicas", fontsize=7)
            ax.set_xlabel("")
    fig.tight_layout()
    return fig


def policy_sentences(df: pd.DataFrame) -> list[str]:
    """Pull against route-to-cache and round robin, per workload and replica count."""
    out = []
    for (wl, n), d in df.groupby(["workload", "replicas"], sort=False):
        d = d.set_index("policy")
        if not {"pull", "kv_aware", "round_robin"} <= set(d.index):
            continue
        p, k, r = d.loc["pull"], d.loc["kv_aware"], d.loc["round_robin"]
        top = d.hit_rate.max()
        best = " = ".join(q for q in d.index if d.hit_rate[q] > top - 1e-9)
        out.append(f"{wl}, {n} replicas: served {pct(p.hit_rate)} with pull (of which fetched {pct(p.restored_rate)}), "
                   f"{pct(k.hit_rate)} with kv_aware, {pct(r.hit_rate)} round robin ({best} highest); TTFT p99 "
                   f"{ms(p.ttft_p99)} / {ms(k.ttft_p99)} / {ms(r.ttft_p99)}; imbalance {p.imbalance:.2f} / "
                   f"{k.imbalance:.2f} / {r.imbalance:.2f}"
                   + (" (pull balances better than kv_aware)." if p.imbalance < k.imbalance else "."))
    return out


# --- failures -----------------------------------------------------------------------------------------------
def failure_demo(model: str | None = None, seed: int = 0, **engine_kw: Any) -> list[str]:
    """A fetch from a live holder, then one whose holder died first: restored tokens and outputs, as sentences."""
    rng = random.Random(f"nb11-fail:{seed}")
    store = LocalObjectStore()
    a, b = (EngineReplica(model, num_blocks=32, block_size=BS, tier_blocks=32, object_store=store, **engine_kw)
            for _ in range(2))
    prompt = _rand(150, rng)
    fp = a.info()["model_fingerprint"]
    hashes = prompt_block_hashes(prompt[: (len(prompt) - 1) // BS * BS], BS, fp)

    def run(rep, rid, fetch=None):
        rep.add(rid, prompt, 8, None, fetch)
        while True:
            for fin in rep.step().finished:
                if fin["request_id"] == rid:
                    return fin

    home = run(a, "home")
    ok = run(b, "fetched", [a.export(hashes)])
    b.fail()
    ref = a.export(hashes)
    a.fail()  # the holder dies after exporting, before the fetch: its objects are lost
    lost = run(b, "holder-died", [ref])
    same = home["output_ids"] == ok["output_ids"] == lost["output_ids"]
    return [f"Live holder: the fetcher restored {ok['restored_tokens']} of {len(prompt)} prompt tokens.",
            f"Holder died before the fetch: {lost['restored_tokens']} restored, {b.fetch_failures} failed fetch, the "
            "request recomputed its prompt.",
            f"Outputs of the holder, the fetcher and the fallback are {'identical' if same else 'DIFFERENT (a bug)'}."]


# --- 4 · prefill/decode split ------------------------------------------------------------------------------
def pd_workload(smoke: bool, seed: int = 0, vocab: int = 500):
    """One-turn requests with long prompts and longer replies (so decode steps and prefills collide)."""
    rng = random.Random(f"nb11-pd:{seed}")
    n = 12 if smoke else 32
    prompts = [_rand(rng.randint(200, 480), rng) for _ in range(n)]
    return from_prompts(prompts, 24, rate=30.0, name=f"pd{n}", vocab=vocab, seed=seed)


def pd_run(workload, *, num_blocks: int = 160, model: str | None = None, **engine_kw: Any) -> dict:
    """Co-located (2 replicas, least loaded) vs split (1 prefill + 1 decode), real engines, measured clock."""
    store = LocalObjectStore()
    handles = [LocalHandle(EngineReplica(model, num_blocks=num_blocks, block_size=BS, tier_blocks=num_blocks,
                                         object_store=store, **engine_kw)) for _ in range(2)]
    co = run_fleet(workload, handles, "least_loaded", clock="measured")
    co_recs = [{**r, "output_tokens": len(co.replies[r["request_id"]])} for r in co.records]
    split = run_pd(workload, handles[0], handles[1])
    same = all(co.replies[r["request_id"]] == r["output_ids"] for r in split)
    df = pd.DataFrame([pd_summary(co_recs, "co-located (2 replicas)"), pd_summary(split, "P/D split (1 + 1)")])
    return {"rows": df, "same_tokens": same, "moved_tokens": sum(r["restored_tokens"] for r in split)}


def pd_sentences(out: dict) -> list[str]:
    """TTFT and inter-token latency, split against co-located, from the measured rows."""
    co, sp = out["rows"].iloc[0], out["rows"].iloc[1]
    return [f"TTFT p50 {ms(co.ttft_p50)} co-located vs {ms(sp.ttft_p50)} split; p99 {ms(co.ttft_p99)} vs {ms(sp.ttft_p99)}.",
            f"Inter-token latency p50 {ms(co.itl_p50)} vs {ms(sp.itl_p50)}; p99 {ms(co.itl_p99)} vs {ms(sp.itl_p99)} "
            f"({'steadier' if sp.itl_p99 < co.itl_p99 else 'not steadier'} when split).",
            f"The decode replica restored {out['moved_tokens']} prompt tokens shipped from the prefill replica; its "
            f"outputs {'equal' if out['same_tokens'] else 'DIFFER from'} the co-located outputs token for token."]


# --- exercise ------------------------------------------------------------------------------------------------
def worth_pulling_reference(prefix_tokens: int, recompute_per_token: float, copy_per_token: float,
                            fixed: float) -> bool:
    """The rule the checker holds an answer to: pull when the fixed cost plus the copy beats recomputing."""
    return fixed + copy_per_token * prefix_tokens < recompute_per_token * prefix_tokens


def check_worth_pulling(fn: Callable | None) -> Verdict:
    """Exercise: ``fn(prefix_tokens, recompute_per_token, copy_per_token, fixed) -> bool``: should a replica pull?"""
    hint = ("compare what each path costs for this prefix: recomputing costs recompute_per_token per token; pulling "
            "costs a fixed amount per transfer plus copy_per_token per token. Pull only when that is strictly less.")
    rng = random.Random(11)
    cases = [(rng.choice([0, 16, 64, 256, 1024, 4096]), rng.uniform(1e-6, 1e-4), rng.uniform(1e-8, 2e-4),
              rng.choice([0.0, 1e-4, 1e-3, 1e-2])) for _ in range(200)]
    wrong = 0
    for c in cases:
        got, bad = call_answer(fn, *c, hint=hint, name="worth_pulling")
        if bad is not None:
            return bad
        wrong += bool(got) != worth_pulling_reference(*c)
    return verdict(wrong == 0, f"all {len(cases)} cases decided right",
                   f"{wrong} of {len(cases)} cases decided wrong. " + hint)
