"""Notebook 11 · Beyond one pool: its workload, figures and the exercise checker."""

from __future__ import annotations

import random
from collections.abc import Callable

import pandas as pd

from kvlab.built.nb11 import random_tokens
from kvlab.cluster import from_prompts
from kvlab.lessons.common import Verdict, call_answer, verdict


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


def pd_workload(smoke: bool, seed: int = 0, vocab: int = 500):
    """One-turn requests with long prompts and longer replies (so decode steps and prefills
    collide)."""
    rng = random.Random(f"nb11-pd:{seed}")
    n = 12 if smoke else 32
    prompts = [random_tokens(rng.randint(200, 480), rng) for _ in range(n)]
    return from_prompts(prompts, 24, rate=30.0, name=f"pd{n}", vocab=vocab, seed=seed)


def worth_pulling_reference(prefix_tokens: int, recompute_per_token: float, copy_per_token: float,
                            fixed: float) -> bool:
    """The rule the checker holds an answer to: pull when the fixed cost plus the copy beats
    recomputing."""
    return fixed + copy_per_token * prefix_tokens < recompute_per_token * prefix_tokens


def check_worth_pulling(fn: Callable | None) -> Verdict:
    """Exercise: ``fn(prefix_tokens, recompute_per_token, copy_per_token, fixed) -> bool``: should a
    replica pull?"""
    hint = ("compare what each path costs for this prefix: recomputing costs recompute_per_token "
            "per token; pulling costs a fixed amount per transfer plus copy_per_token per token. "
            "Pull only when that is strictly less.")
    rng = random.Random(11)
    cases = [(rng.choice([0, 16, 64, 256, 1024, 4096]), rng.uniform(1e-6, 1e-4),
              rng.uniform(1e-8, 2e-4),
              rng.choice([0.0, 1e-4, 1e-3, 1e-2])) for _ in range(200)]
    wrong = 0
    for c in cases:
        got, bad = call_answer(fn, *c, hint=hint, name="worth_pulling")
        if bad is not None:
            return bad
        wrong += bool(got) != worth_pulling_reference(*c)
    return verdict(wrong == 0, f"all {len(cases)} cases decided right",
                   f"{wrong} of {len(cases)} cases decided wrong. " + hint)
