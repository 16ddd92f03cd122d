"""Notebook 10: is this endpoint sharing its cache? Its keys and system prompt, figures and exercise
checkers."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from kvlab.audit import AuditResult
from kvlab.audit.prompts import letters_for, random_letters
from kvlab.lessons.common import Verdict, check_number


def public_system_prompt(tokens: int, tokens_per_letter: float = 1.0, seed: int = 0) -> str:
    """The operator's public system prompt: about ``tokens`` tokens of spaced letters and a
    newline."""
    rng = random.Random(f"kvlab-nb10-system:{seed}")
    return "System: " + " ".join(random_letters(rng, letters_for(tokens, tokens_per_letter))) + "\n"


def fig_ecdf(table: Sequence[dict], results: Sequence[AuditResult], cols: int = 3) -> Any:
    """One panel per audit: the empirical CDFs of hit and miss TTFTs (the KS statistic is their
    largest gap)."""
    import matplotlib.pyplot as plt

    n = len(results)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), squeeze=False)
    for ax, row, res in zip(axes.flat, table, results):
        for name, xs in (("hit procedure", res.hit), ("miss procedure", res.miss)):
            s = sorted(1e3 * x for x in xs)
            ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=name)
        ax.set_title(f"{row['isolation']}\n{row['sharing level']}: p={res.pvalue:.2g}", fontsize=8)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of probes")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def fig_dictionary(by_k: Sequence[dict]) -> Any:
    """Accuracy vs k: unsalted, salted, and chance."""
    import matplotlib.pyplot as plt

    fig, a = plt.subplots(figsize=(5.5, 4.0))
    for salts in sorted({r["salts"] for r in by_k}):
        rs = [r for r in by_k if r["salts"] == salts]
        a.plot([r["k"] for r in rs], [r["accuracy"] for r in rs], "o-", label=f"salts: {salts}")
    ks = sorted({r["k"] for r in by_k})
    a.plot(ks, [1 / k for k in ks], "k:", label="chance (1/k)")
    a.set_xscale("log", base=2)
    a.set(xlabel="candidates k", ylabel="accuracy (fastest = secret)",
          title="over the wire (kvlab serve)", ylim=(0, 1.05))
    # the legend below the axes: inside, it covered the chance line at small accuracies
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False)
    fig.tight_layout()
    return fig


def fig_power(grid: Sequence[dict]) -> Any:
    """Samples per procedure needed to detect (power 0.9) vs prompt length, one line per prefix
    fraction."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    top = max(r["samples"] for r in grid)
    for f in sorted({r["prefix fraction"] for r in grid}):
        rs = [r for r in grid if r["prefix fraction"] == f]
        ax.plot([r["prompt tokens"] for r in rs], [r["samples to detect"] or top + 1 for r in rs],
                "o-",
                label=f"prefix fraction {f}")
    ax.axhline(top + 1, color="k", ls=":", lw=1, label=f"not detected with {top}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("samples per procedure to detect")
    ax.set_title("detection power (subsampled, power 0.9)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def check_min_samples(answer: int | None, alpha: float = 1e-3) -> Verdict:
    """Exercise 10.1: the fewest samples per procedure for which an exact two-sided KS p-value can
    fall below alpha."""
    n = 1
    while 2 / math.comb(2 * n, n) >= alpha:
        n += 1
    return check_number(answer, n,
                        f"{n} samples per procedure: 2 / C({2 * n}, {n}) = "
                        f"{2 / math.comb(2 * n, n):.2g} < {alpha}",
                        "the smallest p-value comes from D = 1 (no overlap at all): with n per "
                        "side its exact two-sided p is 2 / C(2n, n); find the first n where that "
                        "is below alpha", int)


def check_right_guess_gain(answer: int | None, before: int, secret: int, after: int,
                           block_size: int) -> Verdict:
    """Exercise 10.2: cached tokens a right guess gains over a wrong one (whole blocks only)."""
    want = (before + secret + after) // block_size * block_size - before // block_size * block_size
    return check_number(answer, want,
                        f"{want} tokens: whole blocks through the known text, minus those before "
                        "the secret",
                        "a wrong guess hits the whole blocks before the secret starts; a right one "
                        "hits every whole block up to the end of the known text after it (and "
                        "never the prompt's last token)", int)
