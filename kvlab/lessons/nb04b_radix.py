"""Notebook 04b (radix tree vs hash blocks): the workloads, the comparison, the figures (``fig_*``), the checkers.

The same request traces run through four caches with the same K/V capacity in tokens: SGLang's radix
tree at page 1 (token granular) and page 16 (its paged mode), and vLLM's chained hash blocks of 16 and
32 tokens (``kvlab.cache.block_manager``). ``compare`` replays each trace twice per cache -- once with
room for everything, once in a pool too small for it -- and times the prefix lookup of every prompt
against the warm cache. Pure Python and matplotlib, except ``engine_ttft`` (torch, imported when called).
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.cache.block_manager import BlockManager, TenantScope
from kvlab.cache.radix import RadixCache
from kvlab.lessons.common import Verdict, call_answer, verdict
from kvlab.lessons.traces import (
    ARTICLE_QUESTIONS,
    SYSTEM_PROMPTS,
    VOCAB,
    Request,
    multiturn_trace,
    replay,
    shared_prefix_trace,
    toy_tokenize,
)
from kvlab.lessons.workloads import Workload

__all__ = ["CACHES", "branching_trace", "chat_trace", "check_gain", "check_radix_cached", "compare", "engine_ttft",
           "fewshot_trace", "fig_hit_rate", "fig_lookup", "fig_pressure", "fig_ttft", "make_cache", "short_prefix_trace",
           "summary", "tenant_sharing", "workload_trace", "article_requests"]

# name -> (kind, tokens per page or block); every cache of a comparison gets the same capacity in tokens
CACHES: dict[str, tuple[str, int]] = {
    "radix page 1": ("radix", 1),
    "radix page 16": ("radix", 16),
    "blocks 16": ("blocks", 16),
    "blocks 32": ("blocks", 32),
}


def make_cache(name: str, capacity_tokens: int, **kw: Any) -> RadixCache | BlockManager:
    """One of ``CACHES`` holding ``capacity_tokens`` tokens of K/V."""
    kind, size = CACHES[name]
    cls = RadixCache if kind == "radix" else BlockManager
    return cls(capacity_tokens // size, size, **kw)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# --- workloads ----------------------------------------------------------------------------------------------
def workload_trace(workload: Workload, seed: int = 0) -> list[Request]:
    """A named workload (e.g. one of the article's groups from ``workloads.seed_groups``) as a trace, random outputs."""
    rng = random.Random(seed)
    return [Request(f"{workload.name}-{i}", list(prompt), _ids(rng, workload.max_tokens), tags=dict(meta))
            for i, (prompt, meta) in enumerate(zip(workload.prompts, workload.meta))]


def article_requests(page_size: int = 1, block_size: int = DEFAULT_BLOCK_SIZE, lang: str = "zh"
                     ) -> tuple[list[dict], RadixCache, Callable[[int], str]]:
    """The article's three translation requests through a radix tree and through hash blocks.

    Returns one row per request (prompt tokens, tokens each cache served), the radix cache (to ``dump``)
    and a function that shows a token id as its text.
    """
    system = SYSTEM_PROMPTS[lang]
    texts = [system + q for q in ARTICLE_QUESTIONS[lang]]
    words = {toy_tokenize(piece)[0]: piece for t in texts for piece in re.findall(r"[\u4e00-\u9fff]|\w+|[^\w\s]", t)}
    radix, blocks = RadixCache(256, page_size), BlockManager(256 // block_size, block_size)
    rows = []
    for name, text in zip("ABC", texts):
        ids = toy_tokenize(text)
        rows.append({"request": name, "prompt tokens": len(ids), "system prompt tokens": len(toy_tokenize(system)),
                     f"radix page {page_size}": radix.allocate(name, ids), f"blocks {block_size}": blocks.allocate(name, ids)})
    return rows, radix, lambda t: words.get(t, "?")


def chat_trace(num_conversations: int, turns: int = 4, seed: int = 0) -> list[Request]:
    """Multi-turn chat: each turn re-sends the system prompt and the whole history (append-only)."""
    return multiturn_trace(num_conversations, turns=turns, system_len=300, history="full", seed=seed)


def fewshot_trace(num_requests: int, pool: int = 8, shots: int = 4, header_len: int = 45,
                  example_len: tuple[int, int] = (30, 60), query_len: tuple[int, int] = (10, 30),
                  seed: int = 0) -> list[Request]:
    """Few-shot prompts: one instruction header, ``shots`` examples drawn from a shared pool in varying order, a query."""
    rng = random.Random(seed)
    header = _ids(rng, header_len)
    examples = [_ids(rng, rng.randint(*example_len)) for _ in range(pool)]
    out = []
    for i in range(num_requests):
        chosen = rng.sample(range(pool), shots)
        prompt = header + [t for k in chosen for t in examples[k]] + _ids(rng, rng.randint(*query_len))
        out.append(Request(f"f{i}", prompt, _ids(rng, rng.randint(8, 24)), tags={"order": tuple(chosen)}))
    return out


def branching_trace(num_trees: int, branches: int = 4, sub_branches: int = 2, system_len: int = 200,
                    seed: int = 0) -> list[Request]:
    """Several continuations of one conversation: a base turn, ``branches`` follow-ups, each with ``sub_branches``."""
    rng = random.Random(seed)
    system = _ids(rng, system_len)
    out = []
    for t in range(num_trees):
        base = Request(f"b{t}", system + _ids(rng, rng.randint(20, 60)), _ids(rng, rng.randint(20, 40)),
                       tags={"tree": t, "level": 0})
        out.append(base)
        for i in range(branches):
            branch = Request(f"b{t}.{i}", base.prompt + base.output + _ids(rng, rng.randint(10, 30)),
                             _ids(rng, rng.randint(16, 32)), after=base.req_id, tags={"tree": t, "level": 1})
            out.append(branch)
            for j in range(sub_branches):
                out.append(Request(f"b{t}.{i}.{j}", branch.prompt + branch.output + _ids(rng, rng.randint(5, 20)),
                                   _ids(rng, rng.randint(8, 16)), after=branch.req_id, tags={"tree": t, "level": 2}))
    return out


def short_prefix_trace(num_requests: int, seed: int = 0) -> list[Request]:
    """Prefixes shorter than a 16-token block (6, 10 or 14 tokens) before a unique question."""
    return shared_prefix_trace(num_requests, prefix_lens=(6, 10, 14), suffix_len=(8, 40), output_len=(4, 16), seed=seed)


# --- the comparison -------------------------------------------------------------------------------------------
def _round_up(n: int, m: int = 32) -> int:
    return cdiv(n, m) * m


def _lookup_us(caches: dict[str, RadixCache | BlockManager], requests: Sequence[Request], repeats: int
               ) -> dict[str, float]:
    """Mean µs of one ``can_allocate`` (the prefix lookup) per cache: the fastest of ``repeats`` passes.

    The caches take turns pass by pass, so a burst of load from other processes hits them alike; the
    minimum is the pass least disturbed by it.
    """
    scopes = [TenantScope(salt=r.salt) for r in requests]
    best = dict.fromkeys(caches, float("inf"))
    for _ in range(repeats):
        for name, cache in caches.items():
            t0 = time.perf_counter_ns()
            for r, scope in zip(requests, scopes):
                cache.can_allocate(r.prompt, scope)
            best[name] = min(best[name], (time.perf_counter_ns() - t0) / 1000 / len(requests))
    return best


def compare(traces: dict[str, list[Request]], caches: Iterable[str] = tuple(CACHES), max_running: int = 8,
            pressure: float = 0.3, repeats: int = 5) -> list[dict]:
    """One row per (workload, cache): cached tokens, hit rate, memory, evictions under a finite pool, lookup µs.

    Every cache of a workload gets the same capacity in tokens: room for everything (the ``ample`` run),
    then ``pressure`` x the tokens the token-granular tree held at the end of the ample run (at least two
    of the longest request), rounded up to 32. Lookup: ``can_allocate`` of every prompt against the cache
    the ample run left warm, fastest of ``repeats`` passes.
    """
    rows = []
    caches = list(caches)
    for wname, reqs in traces.items():
        longest = max(len(r.prompt) + len(r.output) for r in reqs)
        ample = _round_up(sum(len(r.prompt) + len(r.output) for r in reqs) + 32 * max_running)
        warm = {}
        for cname in caches:
            cache = warm[cname] = make_cache(cname, ample)
            a = replay(cache, reqs, max_running)
            rows.append({"workload": wname, "cache": cname, "requests": a["requests"], "prompt tokens": a["query_tokens"],
                         "cached tokens": a["hit_tokens"], "hit rate": a["hit_rate"],
                         "cached per request": a["hit_tokens"] / a["requests"],
                         "peak memory (tokens)": a["peak_blocks_used"] * a["block_size"],
                         "resident (tokens)": a["num_cached_blocks"] * a["block_size"],
                         "wasted slots (mean)": a["wasted_slots_mean"],
                         "miss short": a["miss_short"], "ample pool (tokens)": ample,
                         "nodes or blocks": a.get("tree_nodes", a["num_cached_blocks"]), "splits": a.get("splits", 0)})
        for row, us in zip(rows[-len(caches):], _lookup_us(warm, reqs, repeats).values()):
            row["lookup µs"] = us
        distinct = next((r["resident (tokens)"] for r in rows[-len(caches):] if r["cache"] == "radix page 1"), ample)
        finite = _round_up(max(int(pressure * distinct), 2 * longest))
        for row in rows[-len(caches):]:
            p = replay(make_cache(row["cache"], finite), reqs, max_running)
            evicted = p.get("evicted_tokens", p["evictions"] * p["block_size"])
            row.update({"small pool (tokens)": finite, "cached tokens (small pool)": p["hit_tokens"],
                        "hit rate (small pool)": p["hit_rate"], "evicted tokens (small pool)": evicted,
                        "miss evicted (small pool)": p["miss_evicted"]})
    return rows


def summary(rows: list[dict], token: str = "radix page 1", block: str = "blocks 16",
            paged: str = "radix page 16") -> list[str]:
    """Sentences comparing the token-granular tree with hash blocks, every number taken from ``rows``."""
    by = {(r["workload"], r["cache"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    gains = []
    for w in workloads:
        t, b, p = by[(w, token)], by[(w, block)], by[(w, paged)]
        extra = t["cached tokens"] - b["cached tokens"]
        gains.append((extra / t["requests"], w))
        share = extra / max(t["prompt tokens"], 1)
        lines = [f"{w}: {token} caches {t['cached tokens']} of {t['prompt tokens']} prompt tokens "
                 f"({100 * t['hit rate']:.1f}%), {block} {b['cached tokens']} ({100 * b['hit rate']:.1f}%): "
                 f"{extra / t['requests']:+.1f} tokens per request, {100 * share:+.1f} points of the prompt."]
        same = p["cached tokens"] == b["cached tokens"]
        lines.append(f"   {paged} caches {p['cached tokens']}: "
                     + ("exactly what the blocks of the same size cache -- the gain comes from the granularity, "
                        "not from the tree." if same else
                        f"{p['cached tokens'] - b['cached tokens']:+d} against the blocks of the same size."))
        lines.append(f"   small pool ({t['small pool (tokens)']} tokens): {token} {100 * t['hit rate (small pool)']:.1f}% "
                     f"with {t['evicted tokens (small pool)']} tokens evicted, {block} "
                     f"{100 * b['hit rate (small pool)']:.1f}% with {b['evicted tokens (small pool)']} evicted; "
                     f"lookup {t['lookup µs']:.1f} µs vs {b['lookup µs']:.1f} µs per request.")
        gains[-1] = (*gains[-1], lines)
    out = [line for *_, lines in gains for line in lines]
    best, worst = max(gains), min(gains)
    out.append(f"Token granularity wins most on '{best[1]}' ({best[0]:+.1f} cached tokens per request against "
               f"{block}) and least on '{worst[1]}' ({worst[0]:+.1f}).")
    return out


def tenant_sharing(num_tenants: int = 4, requests_per_tenant: int = 4, system_len: int = 200,
                   seed: int = 0) -> list[dict]:
    """Tenants behind one operator system prompt: hash blocks with a public prefix vs the radix tree's salted roots."""
    rng = random.Random(seed)
    system = _ids(rng, system_len)
    reqs = [(f"tenant-{t}", system + _ids(rng, rng.randint(10, 30))) for _ in range(requests_per_tenant)
            for t in range(num_tenants)]
    capacity = _round_up(sum(len(p) for _, p in reqs) + 64)
    rows = []
    for name, cache, public in (("blocks 16, salt after the public prefix", BlockManager(capacity // 16, 16), True),
                                ("blocks 16, salt from block 0", BlockManager(capacity // 16, 16), False),
                                ("radix page 1, a root per salt", RadixCache(capacity, 1), False)):
        cached = sum(cache.allocate(i, p, TenantScope(salt=t, public_tokens=system_len if public else 0))
                     for i, (t, p) in enumerate(reqs))
        rows.append({"cache": name, "requests": len(reqs), "prompt tokens": sum(len(p) for _, p in reqs),
                     "cached tokens": cached, "cross-tenant hits": cache.metrics.cross_tenant_hits,
                     "public hits (blocks)": cache.metrics.public_hits})
    return rows


# --- the engine (phase 2) ----------------------------------------------------------------------------------
def engine_ttft(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], cache: str, max_tokens: int = 4,
                num_tokens: int = 16384, block_size: int = DEFAULT_BLOCK_SIZE, page_size: int = 1, repeats: int = 3,
                **engine_kw: Any) -> dict:
    """Median TTFT and outputs of ``prompts`` through a fresh ``Engine(..., cache=cache)``, one request after another.

    Each prompt waits for the previous one, so every request finds the cache the earlier ones left:
    TTFT is then its own prefill of the uncached part (plus one forward), not queueing.
    """
    from kvlab.engine import Engine, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens)
    runs = []
    for _ in range(repeats):
        kw = {"cache": cache, "page_size": page_size} if cache == "radix" else {}
        engine = Engine(model, tokenizer, num_blocks=num_tokens // block_size, block_size=block_size, **kw, **engine_kw)
        outs = [engine.generate([p], sp)[0] for p in prompts]
        runs.append(outs)
    ttfts = [statistics.median(run[i].ttft for run in runs) for i in range(len(prompts))]
    outs = runs[-1]
    return {"cache": f"radix page {page_size}" if cache == "radix" else f"blocks {block_size}", "ttft": ttfts,
            "cached": [o.num_cached_tokens for o in outs], "outputs": [o.output_ids for o in outs],
            "stats": engine.stats()}


# --- figures -----------------------------------------------------------------------------------------------
def _grouped(ax, rows: list[dict], value: Callable[[dict], float], caches: list[str], workloads: list[str]) -> None:
    width = 0.8 / len(caches)
    by = {(r["workload"], r["cache"]): r for r in rows}
    for k, c in enumerate(caches):
        xs = [i + (k - (len(caches) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, [value(by[(w, c)]) for w in workloads], width, label=c, color=f"C{k}")
    ax.set_xticks(range(len(workloads)), workloads, rotation=25, ha="right")
    ax.grid(axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _names(rows: list[dict]) -> tuple[list[str], list[str]]:
    return list(dict.fromkeys(r["cache"] for r in rows)), list(dict.fromkeys(r["workload"] for r in rows))


def fig_hit_rate(rows: list[dict]) -> Figure:
    """Hit rate and cached tokens per request, per workload and cache, with room for everything."""
    caches, workloads = _names(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    _grouped(a, rows, lambda r: 100 * r["hit rate"], caches, workloads)
    a.set(ylabel="prompt tokens served from the cache (%)", title="hit rate (ample pool)")
    _grouped(b, rows, lambda r: r["cached per request"], caches, workloads)
    b.set(ylabel="cached tokens per request", title="cached tokens per request")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_pressure(rows: list[dict]) -> Figure:
    """Under a pool too small for the workload: hit rate and evicted tokens; and peak memory held (ample pool)."""
    caches, workloads = _names(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _grouped(axes[0], rows, lambda r: 100 * r["hit rate (small pool)"], caches, workloads)
    axes[0].set(ylabel="hit rate (%)", title="hit rate, small pool")
    _grouped(axes[1], rows, lambda r: r["evicted tokens (small pool)"], caches, workloads)
    axes[1].set(ylabel="tokens evicted", title="evictions, small pool")
    _grouped(axes[2], rows, lambda r: r["peak memory (tokens)"], caches, workloads)
    axes[2].set(ylabel="K/V slots held by running requests (peak)", title="memory held (ample pool)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_lookup(rows: list[dict]) -> Figure:
    """Prefix-lookup cost per request (pure Python ``can_allocate`` on a warm cache)."""
    caches, workloads = _names(rows)
    fig, ax = plt.subplots(figsize=(8, 4))
    _grouped(ax, rows, lambda r: r["lookup µs"], caches, workloads)
    ax.set(ylabel="µs per request (fastest pass)", title="prefix lookup cost, pure Python")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_ttft(results: list[dict], labels: Sequence[str]) -> Figure:
    """TTFT per request and cached prompt tokens, one line per engine cache."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for k, res in enumerate(results):
        a.plot([1000 * t for t in res["ttft"]], "o-", color=f"C{k}", label=res["cache"])
        b.plot(res["cached"], "s-", color=f"C{k}", label=res["cache"])
    step = -(-len(labels) // 12)  # at most 12 tick labels, so none overlap
    for ax in (a, b):
        ax.set_xticks(range(0, len(labels), step), list(labels)[::step], rotation=30, ha="right", fontsize=8)
        ax.set_xlabel("request, in arrival order")
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    a.set(ylabel="TTFT (ms, median of runs)", title="time to first token")
    b.set(ylabel="prompt tokens from the cache", title="cached tokens")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- exercises ---------------------------------------------------------------------------------------------
def check_radix_cached(predict: Callable[[int, int], int] | None) -> Verdict:
    """Exercise 04b.1: ``predict(n, page_size)`` = tokens the radix tree serves when an identical n-token prompt repeats."""
    hint = "the last prompt token is always computed, and in paged mode only whole pages match"
    for size in (1, 2, 4, 16):
        for n in range(1, 3 * size + 3):
            c = RadixCache(4 * n + 8, size)
            c.allocate("first", list(range(n)))
            truth = c.allocate("again", list(range(n)))
            guess, failed = call_answer(predict, n, size, hint=hint, name="predict")
            if failed is not None:
                return failed
            if guess != truth:
                return verdict(False, hint=f"for n={n}, page_size={size} you predicted {guess!r}; {hint}")
    return verdict(True, "right for every n and page size tried")


def check_gain(gain: Callable[[int, int, int], int] | None) -> Verdict:
    """Exercise 04b.2: ``gain(shared, n, block_size)`` = extra tokens radix page 1 serves the second of two
    n-token prompts that share their first ``shared`` tokens, against hash blocks of ``block_size``."""
    hint = "both stop at the shared prefix and at n - 1; the blocks round down to a whole block"
    for bs in (4, 16, 32):
        for n in range(1, 2 * bs + 3):
            for shared in range(0, n + 1):
                a = list(range(n))
                b = a[:shared] + [10_000 + i for i in range(n - shared)]
                radix, blocks = RadixCache(2 * n + 4, 1), BlockManager(2 * (n // bs + 2), bs)
                radix.allocate("a", a)
                blocks.allocate("a", a)
                truth = radix.allocate("b", b) - blocks.allocate("b", b)
                guess, failed = call_answer(gain, shared, n, bs, hint=hint, name="gain")
                if failed is not None:
                    return failed
                if guess != truth:
                    return verdict(False, hint=f"for shared={shared}, n={n}, block_size={bs} you said {guess!r}; {hint}")
    return verdict(True, "right for every prefix length, prompt length and block size tried")
