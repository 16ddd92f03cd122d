"""Notebook 09 · Beyond one replica: its workloads, figures and the exercise checker."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from kvlab.cluster import ALL_POLICIES, FleetResult, chat, from_prompts, simulate
from kvlab.lessons.common import Verdict, call_answer, pct, verdict


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


def _layout(children: dict, max_roots: int) -> dict:
    """(depth, row) of every node of a forest given as parent -> children (None = the roots): leaves
    in rows."""
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
    """Each replica's cached blocks as the index knows them: trees by parent link, coloured by
    tenant prefix."""
    import matplotlib.pyplot as plt

    index = result.router.index
    reps = sorted(index.blocks)
    fig, axes = plt.subplots(1, max(1, len(reps)), figsize=(3.2 * max(1, len(reps)), 3.2),
                             squeeze=False)
    for ax, r in zip(axes[0], reps):
        held = set(index.blocks[r])
        children: dict = {}
        for h in held:
            children.setdefault(index.parent.get(h) if index.parent.get(h) in held else None,
                                []).append(h)
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


def fig_policies(df: pd.DataFrame, title: str = "", ttft: str = "ttft_p99"):
    """Hit rate and TTFT (``ttft``: the column, p99 or mean) per policy, one bar per replica
    count."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    piv = df.pivot(index="policy", columns="replicas",
                   values="hit_rate").reindex([p for p in ALL_POLICIES if p in set(df.policy)])
    piv.plot.bar(ax=a, rot=20)
    a.set_ylabel("fleet hit rate (cached / prompt tokens)")
    a.set_title("hit rate")
    name = {"ttft_p99": "TTFT p99", "ttft_mean": "mean TTFT", "ttft_p50": "TTFT p50"}[ttft]
    piv = df.pivot(index="policy", columns="replicas", values=ttft).reindex(piv.index)
    (piv * 1000).plot.bar(ax=b, rot=20)
    b.set_ylabel(f"{name} (ms, modelled clock)")
    b.set_title(name)
    a.get_legend().remove()
    # beside the bars, never over them
    b.legend(title="replicas", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in (a, b):
        ax.set_xlabel("")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def fig_weight(df: pd.DataFrame):
    """Hit rate against load imbalance as the weight grows."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(df.imbalance, df.hit_rate, "o-")
    for _, r in df.iterrows():
        ax.annotate(f"w={r.weight:g}", (r.imbalance, r.hit_rate), textcoords="offset points",
                    xytext=(5, -10))
    ax.set_xlabel("load imbalance (max / mean requests per replica)")
    ax.set_ylabel("fleet hit rate")
    ax.set_title("kv_aware: weight x blocks to prefill + active blocks")
    fig.tight_layout()
    return fig


def check_policy(my_policy: Callable | None, smoke: bool = True) -> Verdict:
    """Exercise: ``my_policy(router, request) -> replica`` routes by cache overlap and load, using
    the index only."""
    hint = ("router.hashes(request) gives the prompt's block hashes; router.index.overlap(r, "
            "hashes) how many leading blocks replica r holds; router.active_blocks(r) the blocks "
            "of its requests in flight. Prefer the largest overlap, but do not pile everything on "
            "one replica: subtract something for load.")
    wl = chat(num_sessions=16 if smoke else 32, num_tenants=4, system_tokens=192, rate=6.0, seed=1)
    res, bad = call_answer((lambda: simulate(wl, 4, my_policy, num_blocks=96))
                           if my_policy is not None else None,
                           hint=hint, name="my_policy")
    if bad is not None:
        return bad
    s = res.summary()
    ref = simulate(wl, 4, "round_robin", num_blocks=96).summary()
    ok = s["hit_rate"] >= ref["hit_rate"] + 0.10 and s["imbalance"] <= 2.0
    return verdict(ok,
                   f"hit rate {pct(s['hit_rate'])} (round robin {pct(ref['hit_rate'])}), imbalance "
                       f"{s['imbalance']:.2f}",
                   f"hit rate {pct(s['hit_rate'])} vs round robin's {pct(ref['hit_rate'])} (needs "
                   f"10 points more), imbalance {s['imbalance']:.2f} (needs <= 2). " + hint)


