"""What notebook 11_tiers_and_transfer.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from kvlab.built.nb09 import sweep
from kvlab.cache.hashing import prompt_block_hashes
from kvlab.cache.host_tier import collect_blocks
from kvlab.cluster import CostModel, EngineReplica, LocalHandle, pd_summary, run_fleet, run_pd
from kvlab.cluster.object_store import LocalObjectStore, PickleObjectStore
from kvlab.lessons.common import ms, pct
from kvlab.lessons.timing import Timing, ratio_verdict

# --- 11_tiers_and_transfer.ipynb, cell 3 ---
BS = 16  # the block size of every engine in this notebook


def random_tokens(n: int, rng: random.Random) -> list[int]:
    """``n`` random token ids (above the bundled model's special tokens)."""
    return [rng.randrange(3, 500) for _ in range(n)]


# --- 11_tiers_and_transfer.ipynb, cell 6 ---
def crossover(model: Any, tokenizer: Any, lengths: Sequence[int] = (16, 64, 128, 256, 512, 768),
              repeats: int = 3, seed: int = 0, torch_threads: int | None = 1) -> pd.DataFrame:
    """TTFT of a prompt whose first ``L`` tokens are recomputed, restored from the host tier, or
    fetched from a peer."""
    import torch

    before = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        return _crossover(model, tokenizer, lengths, repeats, seed)
    finally:
        torch.set_num_threads(before)


def _crossover(model: Any, tokenizer: Any, lengths: Sequence[int], repeats: int,
               seed: int) -> pd.DataFrame:
    from kvlab.engine import Engine, SamplingParams

    rng = random.Random(f"nb11-crossover:{seed}")
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    nb = max(lengths) // BS + 2  # room for the longest prompt; evicting the pool empties it whole
    cold = Engine(model, tokenizer, num_blocks=nb + 2)
    tiered = Engine(model, tokenizer, num_blocks=nb, host_tier_bytes=64 << 20)
    peer = Engine(model, tokenizer, num_blocks=nb + 2, host_tier_bytes=64 << 20)
    fp = tiered.block_manager.model_fingerprint
    for eng in (cold, tiered, peer):
        eng.generate([random_tokens(max(lengths) + 1, rng)], sp)  # warm-up
    rows = []
    for L in lengths:
        rec, tie, tra, copy = [], [], [], []
        for _ in range(repeats):
            p = random_tokens(L + 1, rng)  # L tokens of prefix (L // 16 blocks) + 1 to compute
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
            store = PickleObjectStore()  # ``cold`` ran p: its pool holds the prefix
            hashes = prompt_block_hashes(p[: L // BS * BS], BS, fp)
            t0 = time.perf_counter()
            entries = collect_blocks(cold.block_manager, None, hashes, _reader(cold))
            peer.host_tier.stage(store.get(store.put(entries)))
            got = peer.generate([p], sp)[0]
            tra.append(time.perf_counter() - t0)
            assert got.num_restored_tokens == L // BS * BS
            peer.reset_prefix_cache()
        rows.append({"prefix_tokens": L // BS * BS, "recompute_s": min(rec), "tier_s": min(tie),
                     "transfer_s": min(tra), "copy_s": min(copy),
                     "bytes": L // BS * tiered.store.bytes_per_block,
                     "recompute_all": tuple(rec), "tier_all": tuple(tie),
                     "transfer_all": tuple(tra)})
    df = pd.DataFrame(rows)
    for k in ("recompute", "tier", "transfer"):
        df[f"{k}_us_per_token"] = 1e6 * df[f"{k}_s"] / df.prefix_tokens
    return df


def _evict_everything(engine: Any) -> None:
    """Evict every cached block of an idle engine (into its host tier) without running the model."""
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


# --- 11_tiers_and_transfer.ipynb, cell 8 ---
def per_token_costs(df: pd.DataFrame) -> dict[str, float]:
    """Seconds per prefix token at the longest prefix (where fixed costs weigh least), per path."""
    big = df.iloc[-1]
    n = float(big.prefix_tokens)
    return {k: float(big[f"{k}_s"]) / n for k in ("recompute", "tier", "transfer")}


def crossover_sentences(df: pd.DataFrame) -> list[str]:
    """Where moving K/V beats recomputing it, per prefix length, judged by the timing helper."""
    out = []
    for k, name in (("tier", "Restoring from the host tier"), ("transfer", "Fetching from a peer")):
        parts, wins, loses = [], [], []
        for _, r in df.iterrows():
            v = ratio_verdict(Timing(k, r[f"{k}_all"]), Timing("recompute", r.recompute_all))
            parts.append(f"{int(r.prefix_tokens)}: " + v.says(f"{v.value:.2f}x"))
            if v.ok:
                (wins if v.value < 1 else loses).append(int(r.prefix_tokens))
        if len(wins) == len(df):
            word = "faster at every prefix length measured: no crossover in this range"
        elif len(loses) == len(df):
            word = "never faster here"
        elif len(wins) + len(loses) == len(df) and max(loses) < min(wins):
            word = (f"faster from {min(wins)} prefix tokens on (the crossover lies between "
                    f"{max(loses)} and {min(wins)})")
        else:
            unclear = [int(x) for x in df.prefix_tokens if int(x) not in wins + loses]
            found = (("faster", wins), ("slower", loses), ("not told apart", unclear))
            word = "; ".join(f"{w} at {', '.join(map(str, xs))} tokens" for w, xs in found if xs)
            word += ": no clean crossover in this range"
        out.append(f"{name} against recomputing, median time ratio per prefix length "
                   f"({'; '.join(parts)}): {word}.")
    big = df.iloc[-1]
    out.append(f"At {int(big.prefix_tokens)} tokens ({big.bytes / 1024:.0f} KiB of K/V): "
               f"recompute {ms(big.recompute_s)}, tier {ms(big.tier_s)} (of which the copy back "
               f"{ms(big.copy_s)}), transfer {ms(big.transfer_s)}.")
    return out


# --- 11_tiers_and_transfer.ipynb, cell 13 ---
def tier_under_pressure(workload, num_blocks: int = 48, tier_blocks: Sequence[int] = (0, 64, 256),
                        *, model: str | None = None, **engine_kw: Any) -> pd.DataFrame:
    """A real engine replica, a pool too small for the workload, host tiers of several sizes;
    measured clock."""
    rows = []
    for tb in tier_blocks:
        rep = EngineReplica(model, num_blocks=num_blocks, block_size=BS, tier_blocks=tb or None,
                            offload=True, **engine_kw)
        res = run_fleet(workload, [LocalHandle(rep)], "round_robin", clock="measured")
        st = rep.stats()
        s = res.summary()
        rows.append({"tier_blocks": tb, "pool_hit_rate": s["hit_rate"] - s["restored_rate"],
                     "restored_rate": s["restored_rate"], "served_rate": s["hit_rate"],
                     "ttft_p50": s["ttft_p50"], "ttft_p99": s["ttft_p99"],
                     "evictions": st["evictions"], "bytes_to_host": st.get("bytes_to_host", 0),
                     "bytes_from_host": st.get("bytes_from_host", 0),
                     "copy_s": st.get("seconds_to_host", 0.0) + st.get("seconds_from_host", 0.0)})
    return pd.DataFrame(rows)


def tier_sentences(df: pd.DataFrame) -> list[str]:
    """What the tier did to hits and TTFT, from the measured rows."""
    base, best = df.iloc[0], df.iloc[-1]
    gain = best.served_rate > base.served_rate
    out = [f"Without a tier {pct(base.served_rate)} of prompt tokens were served from the pool; "
           f"with {int(best.tier_blocks)} tier blocks {pct(best.served_rate)} "
           f"({pct(best.pool_hit_rate)} pool hits + {pct(best.restored_rate)} restored): "
           + ("the tier turned evictions into hits." if gain else "no gain here.")]
    out.append(f"TTFT p50 {ms(base.ttft_p50)} -> {ms(best.ttft_p50)}, "
               f"p99 {ms(base.ttft_p99)} -> {ms(best.ttft_p99)} (one run per tier size, no "
               "spread: not a ranking; a p99 is its slowest request or two); the tier moved "
               f"{best.bytes_to_host / 2**20:.1f} MiB out and "
               f"{best.bytes_from_host / 2**20:.1f} MiB back in "
               f"{ms(best.copy_s)} of copying.")
    return out


# --- 11_tiers_and_transfer.ipynb, cell 16 ---
def policy_table(workloads: Sequence, replicas: Sequence[int] = (2, 4),
                 policies: Sequence[str] = ("round_robin", "kv_aware", "pull"), *,
                 num_blocks: int = 96, cost: CostModel | None = None) -> pd.DataFrame:
    """Notebook 09's ``sweep`` (modelled clock) per workload, with pull among the policies."""
    df = pd.concat([sweep(wl, replicas, policies, num_blocks=num_blocks, cost=cost)
                    for wl in workloads])
    return df[["workload", "replicas", "policy", "hit_rate", "restored_rate", "ttft_p50",
               "ttft_mean", "ttft_p99", "imbalance", "preemptions", "slowest_cold"]]


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
        out.append(f"{wl}, {n} replicas: served {pct(p.hit_rate)} with pull (of which fetched "
                   f"{pct(p.restored_rate)}), {pct(k.hit_rate)} with kv_aware, {pct(r.hit_rate)} "
                   f"round robin ({best} highest); TTFT mean {ms(p.ttft_mean)} / "
                   f"{ms(k.ttft_mean)} / {ms(r.ttft_mean)}, p99 {ms(p.ttft_p99)} / "
                   f"{ms(k.ttft_p99)} / {ms(r.ttft_p99)}; imbalance {p.imbalance:.2f} / "
                   f"{k.imbalance:.2f} / {r.imbalance:.2f}"
                   + (" (pull balances better than kv_aware)." if p.imbalance < k.imbalance
                      else "."))
    return out


# --- 11_tiers_and_transfer.ipynb, cell 19 ---
def failure_demo(model: str | None = None, seed: int = 0, **engine_kw: Any) -> list[str]:
    """A fetch from a live holder, then one whose holder died first: restored tokens and outputs,
    as sentences."""
    rng = random.Random(f"nb11-fail:{seed}")
    store = LocalObjectStore()
    a, b = (EngineReplica(model, num_blocks=32, block_size=BS, tier_blocks=32, object_store=store,
                          **engine_kw) for _ in range(2))
    prompt = random_tokens(150, rng)
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
    return [f"Live holder: the fetcher restored {ok['restored_tokens']} of {len(prompt)} prompt "
            "tokens.",
            f"Holder died before the fetch: {lost['restored_tokens']} restored, {b.fetch_failures} "
            "failed fetch, the request recomputed its prompt.",
            "Outputs of the holder, the fetcher and the fallback are "
            f"{'identical' if same else 'DIFFERENT (a bug)'}."]


# --- 11_tiers_and_transfer.ipynb, cell 22 ---
def pd_run(workload, *, num_blocks: int = 160, model: str | None = None, **engine_kw: Any) -> dict:
    """Co-located (2 replicas, least loaded) vs split (1 prefill + 1 decode), real engines, measured
    clock."""
    store = LocalObjectStore()
    handles = [LocalHandle(EngineReplica(model, num_blocks=num_blocks, block_size=BS,
                                         tier_blocks=num_blocks, object_store=store, **engine_kw))
               for _ in range(2)]
    co = run_fleet(workload, handles, "least_loaded", clock="measured")
    co_recs = [{**r, "output_tokens": len(co.replies[r["request_id"]])} for r in co.records]
    split = run_pd(workload, handles[0], handles[1])
    same = all(co.replies[r["request_id"]] == r["output_ids"] for r in split)
    df = pd.DataFrame([pd_summary(co_recs, "co-located (2 replicas)"),
                       pd_summary(split, "P/D split (1 + 1)")])
    moved = sum(r["restored_tokens"] for r in split)
    return {"rows": df, "same_tokens": same, "moved_tokens": moved}


def pd_sentences(out: dict) -> list[str]:
    """TTFT and inter-token latency, split against co-located, from the measured rows (one run
    each: printed, not ranked)."""
    co, sp = out["rows"].iloc[0], out["rows"].iloc[1]
    return [f"TTFT p50 {ms(co.ttft_p50)} co-located vs {ms(sp.ttft_p50)} split; "
            f"p99 {ms(co.ttft_p99)} vs {ms(sp.ttft_p99)}.",
            f"Inter-token latency p50 {ms(co.itl_p50)} vs {ms(sp.itl_p50)}; "
            f"p99 {ms(co.itl_p99)} vs {ms(sp.itl_p99)} (one run each, no spread: not a ranking).",
            f"The decode replica restored {out['moved_tokens']} prompt tokens shipped from the "
            f"prefill replica; its outputs {'equal' if out['same_tokens'] else 'DIFFER from'} "
            "the co-located outputs token for token."]
