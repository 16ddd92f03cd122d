"""Notebook 04b (radix tree vs hash blocks): the figures (``fig_*``) and the exercise checkers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.radix import RadixCache
from kvlab.lessons.common import Verdict, call_answer, verdict

__all__ = ["check_gain", "check_radix_cached", "fig_hit_rate", "fig_pressure", "fig_ttft"]


# --- figures --------------------------------------------------------------------------------------
def _grouped(ax, rows: list[dict], value: Callable[[dict], float], caches: list[str],
             workloads: list[str]) -> None:
    width = 0.8 / len(caches)
    by = {(r["workload"], r["cache"]): r for r in rows}
    for k, c in enumerate(caches):
        xs = [i + (k - (len(caches) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, [value(by[(w, c)]) for w in workloads], width, label=c, color=f"C{k}")
    ax.set_xticks(range(len(workloads)), workloads, rotation=25, ha="right")
    ax.grid(axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _names(rows: list[dict]) -> tuple[list[str], list[str]]:
    return (list(dict.fromkeys(r["cache"] for r in rows)),
            list(dict.fromkeys(r["workload"] for r in rows)))


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
    """Under a pool too small for the workload: hit rate and evicted tokens; and peak memory held
    (ample pool)."""
    caches, workloads = _names(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _grouped(axes[0], rows, lambda r: 100 * r["hit rate (small pool)"], caches, workloads)
    axes[0].set(ylabel="hit rate (%)", title="hit rate, small pool")
    _grouped(axes[1], rows, lambda r: r["evicted tokens (small pool)"], caches, workloads)
    axes[1].set(ylabel="tokens evicted", title="evictions, small pool")
    _grouped(axes[2], rows, lambda r: r["peak memory (tokens)"], caches, workloads)
    axes[2].set(ylabel="K/V slots held by running requests (peak)",
                title="memory held (ample pool)")
    axes[0].legend(fontsize=8)
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
        ax.set_xticks(range(0, len(labels), step), list(labels)[::step], rotation=30, ha="right",
                      fontsize=8)
        ax.set_xlabel("request, in arrival order")
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    a.set(ylabel="TTFT (ms, median of runs)", title="time to first token")
    b.set(ylabel="prompt tokens from the cache", title="cached tokens")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- exercises ------------------------------------------------------------------------------------
def check_radix_cached(predict: Callable[[int, int], int] | None) -> Verdict:
    """Exercise 04b.1: ``predict(n, page_size)`` = tokens the radix tree serves when an identical
    n-token prompt repeats."""
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
                return verdict(False,
                               hint=f"for n={n}, page_size={size} you predicted {guess!r}; {hint}")
    return verdict(True, "right for every n and page size tried")


def check_gain(gain: Callable[[int, int, int], int] | None) -> Verdict:
    """Exercise 04b.2: ``gain(shared, n, block_size)`` = extra tokens radix page 1 serves the second
    of two n-token prompts that share their first ``shared`` tokens, against hash blocks of
    ``block_size``."""
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
                    return verdict(False,
                                   hint=f"for shared={shared}, n={n}, block_size={bs} you said "
                                        f"{guess!r}; {hint}")
    return verdict(True, "right for every prefix length, prompt length and block size tried")
