"""What notebook 04b_radix_vs_blocks.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.cache.block_manager import BlockManager, TenantScope
from kvlab.cache.radix import RadixCache
from kvlab.lessons.timing import Timing
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


# --- 04b_radix_vs_blocks.ipynb, cell 5 ---
def article_requests(page_size: int = 1, block_size: int = DEFAULT_BLOCK_SIZE, lang: str = "zh"
                     ) -> tuple[list[dict], RadixCache, Callable[[int], str]]:
    """The article's three translation requests through a radix tree and through hash blocks."""
    system = SYSTEM_PROMPTS[lang]
    texts = [system + q for q in ARTICLE_QUESTIONS[lang]]
    pieces = [p for t in texts for p in re.findall(r"[\u4e00-\u9fff]|\w+|[^\w\s]", t)]
    words = {toy_tokenize(p)[0]: p for p in pieces}   # token id -> its text
    radix, blocks = RadixCache(256, page_size), BlockManager(256 // block_size, block_size)
    rows = []
    for name, text in zip("ABC", texts):
        ids = toy_tokenize(text)
        rows.append({"request": name, "prompt tokens": len(ids),
                     "system prompt tokens": len(toy_tokenize(system)),
                     f"radix page {page_size}": radix.allocate(name, ids),
                     f"blocks {block_size}": blocks.allocate(name, ids)})
    return rows, radix, lambda t: words.get(t, "?")


# --- 04b_radix_vs_blocks.ipynb, cell 9 ---
def walk(root, tokens: list[int]) -> int:
    """Leading tokens the tree under ``root`` holds (page 1): follow the child starting with the
    next token, compare its edge, stop inside an edge or where no child starts with that token."""
    node, pos = root, 0
    while pos < len(tokens) and tokens[pos] in node.children:
        child = node.children[tokens[pos]]
        m = 0
        while m < len(child.key) and pos + m < len(tokens) and child.key[m] == tokens[pos + m]:
            m += 1
        pos += m
        if m < len(child.key):  # the match ends inside this edge: match_prefix would split it here
            break
        node = child
    return pos


# --- 04b_radix_vs_blocks.ipynb, cell 12 ---
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


def workload_trace(workload: Workload, seed: int = 0) -> list[Request]:
    """A named workload (e.g. a group from ``workloads.seed_groups``) as a trace, random outputs."""
    rng = random.Random(seed)
    return [Request(f"{workload.name}-{i}", list(prompt), _ids(rng, workload.max_tokens),
                    tags=dict(meta))
            for i, (prompt, meta) in enumerate(zip(workload.prompts, workload.meta))]


def chat_trace(num_conversations: int, turns: int = 4, seed: int = 0) -> list[Request]:
    """Multi-turn chat: each turn re-sends the system prompt and the whole history (append-only)."""
    return multiturn_trace(num_conversations, turns=turns, system_len=300, history="full",
                           seed=seed)


def fewshot_trace(num_requests: int, pool: int = 8, shots: int = 4, header_len: int = 45,
                  example_len: tuple[int, int] = (30, 60), query_len: tuple[int, int] = (10, 30),
                  seed: int = 0) -> list[Request]:
    """Few-shot prompts: one instruction header, ``shots`` examples drawn from a shared pool in
    varying order, a query."""
    rng = random.Random(seed)
    header = _ids(rng, header_len)
    examples = [_ids(rng, rng.randint(*example_len)) for _ in range(pool)]
    out = []
    for i in range(num_requests):
        chosen = rng.sample(range(pool), shots)
        prompt = header + [t for k in chosen for t in examples[k]]
        prompt += _ids(rng, rng.randint(*query_len))
        output = _ids(rng, rng.randint(8, 24))
        out.append(Request(f"f{i}", prompt, output, tags={"order": tuple(chosen)}))
    return out


def short_prefix_trace(num_requests: int, seed: int = 0) -> list[Request]:
    """Prefixes shorter than a 16-token block (6, 10 or 14 tokens) before a unique question."""
    return shared_prefix_trace(num_requests, prefix_lens=(6, 10, 14), suffix_len=(8, 40),
                               output_len=(4, 16), seed=seed)


# --- 04b_radix_vs_blocks.ipynb, cell 15 ---
def _round_up(n: int, m: int = 32) -> int:
    return cdiv(n, m) * m


def compare(traces: dict[str, list[Request]], caches: Iterable[str] = tuple(CACHES),
            max_running: int = 8, pressure: float = 0.3) -> list[dict]:
    """One row per (workload, cache): cached tokens, hit rate, memory, evictions in a small pool."""
    rows = []
    caches = list(caches)
    for wname, reqs in traces.items():
        longest = max(len(r.prompt) + len(r.output) for r in reqs)
        ample = _round_up(sum(len(r.prompt) + len(r.output) for r in reqs) + 32 * max_running)
        for cname in caches:
            a = replay(make_cache(cname, ample), reqs, max_running)
            rows.append({"workload": wname, "cache": cname, "requests": a["requests"],
                         "prompt tokens": a["query_tokens"], "cached tokens": a["hit_tokens"],
                         "hit rate": a["hit_rate"],
                         "cached per request": a["hit_tokens"] / a["requests"],
                         "peak memory (tokens)": a["peak_blocks_used"] * a["block_size"],
                         "resident (tokens)": a["num_cached_blocks"] * a["block_size"],
                         "wasted slots (mean)": a["wasted_slots_mean"],
                         "miss short": a["miss_short"], "ample pool (tokens)": ample,
                         "nodes or blocks": a.get("tree_nodes", a["num_cached_blocks"]),
                         "splits": a.get("splits", 0)})
        mine = rows[-len(caches):]   # this workload's rows
        distinct = next((r["resident (tokens)"] for r in mine if r["cache"] == "radix page 1"),
                        ample)
        finite = _round_up(max(int(pressure * distinct), 2 * longest))
        for row in mine:
            p = replay(make_cache(row["cache"], finite), reqs, max_running)
            evicted = p.get("evicted_tokens", p["evictions"] * p["block_size"])
            row.update({"small pool (tokens)": finite,
                        "cached tokens (small pool)": p["hit_tokens"],
                        "hit rate (small pool)": p["hit_rate"],
                        "evicted tokens (small pool)": evicted,
                        "miss evicted (small pool)": p["miss_evicted"]})
    return rows


# --- 04b_radix_vs_blocks.ipynb, cell 17 ---
def summary(rows: list[dict], token: str = "radix page 1", block: str = "blocks 16",
            paged: str = "radix page 16") -> list[str]:
    """Sentences comparing the token-granular tree with hash blocks, every number from ``rows``."""
    by = {(r["workload"], r["cache"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    gains = []
    for w in workloads:
        t, b, p = by[(w, token)], by[(w, block)], by[(w, paged)]
        extra = t["cached tokens"] - b["cached tokens"]
        gains.append((extra / t["requests"], w))
        share = extra / max(t["prompt tokens"], 1)
        lines = [f"{w}: {token} caches {t['cached tokens']} of {t['prompt tokens']} prompt tokens "
                 f"({100 * t['hit rate']:.1f}%), {block} {b['cached tokens']} "
                 f"({100 * b['hit rate']:.1f}%): {extra / t['requests']:+.1f} tokens per request, "
                 f"{100 * share:+.1f} points of the prompt."]
        more = p["cached tokens"] - b["cached tokens"]
        lines.append(f"   {paged} caches {p['cached tokens']}: "
                     + ("exactly what the blocks of the same size cache -- the gain comes from "
                        "the granularity, not from the tree." if more == 0 else
                        f"{more:+d} against the blocks of the same size."))
        lines.append(f"   small pool ({t['small pool (tokens)']} tokens): {token} "
                     f"{100 * t['hit rate (small pool)']:.1f}% with "
                     f"{t['evicted tokens (small pool)']} tokens evicted, {block} "
                     f"{100 * b['hit rate (small pool)']:.1f}% with "
                     f"{b['evicted tokens (small pool)']} evicted.")
        gains[-1] = (*gains[-1], lines)
    out = [line for *_, lines in gains for line in lines]
    best, worst = max(gains), min(gains)
    out.append(f"Token granularity wins most on '{best[1]}' ({best[0]:+.1f} cached tokens per "
               f"request against {block}) and least on '{worst[1]}' ({worst[0]:+.1f}).")
    return out


# --- 04b_radix_vs_blocks.ipynb, cell 23 ---
def tenant_sharing(num_tenants: int = 4, requests_per_tenant: int = 4, system_len: int = 200,
                   seed: int = 0) -> list[dict]:
    """Tenants under one operator system prompt: public-prefix hash blocks vs salted radix roots."""
    rng = random.Random(seed)
    system = _ids(rng, system_len)
    reqs = [(f"tenant-{t}", system + _ids(rng, rng.randint(10, 30)))
            for _ in range(requests_per_tenant) for t in range(num_tenants)]
    total = sum(len(p) for _, p in reqs)
    capacity = _round_up(total + 64)
    rows = []
    setups = (("blocks 16, salt after the public prefix", BlockManager(capacity // 16, 16), True),
              ("blocks 16, salt from block 0", BlockManager(capacity // 16, 16), False),
              ("radix page 1, a root per salt", RadixCache(capacity, 1), False))
    for name, cache, public in setups:
        shared = system_len if public else 0
        cached = sum(cache.allocate(i, p, TenantScope(cache_salt=t, public_tokens=shared))
                     for i, (t, p) in enumerate(reqs))
        rows.append({"cache": name, "requests": len(reqs), "prompt tokens": total,
                     "cached tokens": cached, "cross-tenant hits": cache.metrics.cross_tenant_hits,
                     "public hits (blocks)": cache.metrics.public_hits})
    return rows


# --- 04b_radix_vs_blocks.ipynb, cell 26 ---
def engine_ttft(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]],
                caches: dict[str, dict], max_tokens: int = 4, num_tokens: int = 16384,
                block_size: int = DEFAULT_BLOCK_SIZE, repeats: int = 3) -> dict[str, dict]:
    """Per cache (name -> Engine cache arguments): ``prompts`` through a fresh engine one by one,
    the runs of every cache interleaved (their order reversed every other run)."""
    from kvlab.engine import Engine, SamplingParams

    sp, names = SamplingParams(max_tokens=max_tokens), list(caches)
    runs: dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            engine = Engine(model, tokenizer, num_blocks=num_tokens // block_size,
                            block_size=block_size, **caches[name])
            runs[name].append([engine.generate([p], sp)[0] for p in prompts])
    return {name: {"cache": name, "ttft": [statistics.median(o.ttft for o in c) for c in zip(*rs)],
                   "cached": [o.num_cached_tokens for o in rs[-1]],
                   "outputs": [o.output_ids for o in rs[-1]],
                   "timing": Timing(name, tuple(sum(o.ttft for o in run) for run in rs))}
            for name, rs in runs.items()}
