"""Notebook 03b (reusing the middle): the figures (``fig_*``) and the key re-rotation checker."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlab.blend import rerotate_keys
from kvlab.lessons.common import Verdict, call_answer, verdict


def answer_span(tokenizer: Any, ids: Sequence[int], answer: str,
                longest: int = 16) -> tuple[int, int]:
    """The shortest run of prompt positions [lo, hi) whose text contains ``answer``; (0, 0) when
    none does."""
    best = (0, 0)
    for lo in range(len(ids)):
        hi = next((j for j in range(lo + 1, min(len(ids), lo + longest) + 1)
                   if answer in tokenizer.decode(ids[lo:j])), None)
        if hi is not None and (best == (0, 0) or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    return best


def spans(request: Any) -> list[tuple[int, int, bool]]:
    """(start, end, reused) of each piece in prompt positions."""
    out, pos = [], 0
    for ids, reuse in request.pieces:
        out.append((pos, pos + len(ids), reuse))
        pos += len(ids)
    return out


def fig_quality_ttft(quality_summary: Any, ttft_summary: Any, title: str):
    """Left: agreement with a full prefill vs r; right: median TTFT vs r with the two baselines (a
    Figure)."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [100 * r for r in quality_summary.index]
    ax0.plot(x, quality_summary["identical"], "o-", label="token-identical to full prefill")
    ax0.plot(x, quality_summary["recalled"], "s--", label="passphrase recalled")
    ax0.plot(x, quality_summary["agreement"], "^:", label="token agreement")
    ax0.set(xlabel="recomputed share r of reused tokens (%)", ylabel="fraction of requests",
            ylim=(-0.03, 1.03),
            title="answers vs r")
    ax0.legend(fontsize=8, loc="lower right")
    blend = ttft_summary[ttft_summary.index.str.startswith("blend")]
    xr = [float(name.split("=")[1].rstrip("%")) for name in blend.index]
    ax1.plot(xr, blend["median TTFT ms"], "o-", label="blend (prefix + chunk cache)")
    for name, style in (("full prefill", "k--"), ("prefix cache only", "g:")):
        ax1.axhline(ttft_summary.loc[name, "median TTFT ms"], color=style[0], ls=style[1:],
                    label=name)
    ax1.set(xlabel="recomputed share r of reused tokens (%)",
            ylabel="median time to first token (ms)",
            title="TTFT vs r", ylim=(0, None))
    ax1.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def fig_picked(b: Any, request: Any, tokenizer: Any, title: str):
    """The K/V deviation of each reused token at the selection layer, picked tokens marked, passages
    shaded."""
    import matplotlib.pyplot as plt

    if b.deviation is None:
        raise ValueError("this blend measured no deviation: use 0 < r < 1")
    fig, ax = plt.subplots(figsize=(11, 3.4))
    for lo, hi, reuse in spans(request):
        ax.axvspan(lo - 0.5, hi - 0.5, color="tab:blue" if reuse else "lightgrey",
                   alpha=0.12 if reuse else 0.35,
                   lw=0)
        ax.axvline(lo - 0.5, color="grey", lw=0.8)  # where each piece starts
    dev = b.deviation.cpu().numpy()
    ax.bar(b.reused, dev, width=1.0, color="tab:blue", label="reused, kept")
    picked = set(b.recomputed)
    xs = [p for p in b.reused if p in picked]
    ax.bar(xs, [dev[b.reused.index(p)] for p in xs], width=1.0, color="tab:red",
           label="reused, recomputed")
    ids = b.prompt_ids
    lo, hi = answer_span(tokenizer, ids, request.answer)
    if hi > lo:
        ax.axvspan(lo - 0.5, hi - 0.5, color="gold", alpha=0.6, lw=0, label="the passphrase")
    ax.set(xlabel="prompt position (grey: computed, blue: reused passages, lines: piece starts)",
           ylabel="K/V deviation (L2)",
           title=title, xlim=(-1, len(ids)))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def check_rerotate(fn: Callable[[torch.Tensor, int, float], torch.Tensor] | None) -> Verdict:
    """Exercise 03b.1: ``fn(keys, delta, theta)`` moves RoPE'd keys (batch, heads, seq, head_dim) by
    ``delta``."""
    hint = ("pair dimension i with i + head_dim/2 and turn each pair by delta * inv_freq[i] "
            "(rope.inverse_frequencies, rope.rotate_half): k * cos + rotate_half(k) * sin")
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 5, 16, generator=g)
    for delta, theta in ((7, 10000.0), (-3, 10000.0), (300, 100000.0), (0, 10000.0)):
        out, failed = call_answer(fn, keys, delta, theta, hint=hint, name="my_rerotate")
        if failed is not None:
            return failed
        out = torch.as_tensor(out)
        if out.shape != keys.shape:
            return verdict(False,
                           hint=f"return keys of the same shape {tuple(keys.shape)}, not "
                                f"{tuple(out.shape)}")
        want = rerotate_keys(keys, delta, theta)
        if not torch.allclose(out.float(), want, atol=1e-4):
            err = float((out.float() - want).abs().max())
            return verdict(False,
                           hint=f"for delta {delta}, theta {theta:g} your keys are off by up to "
                                f"{err:.3g}; {hint}")
    return verdict(True,
                   "rotating by delta moves every key to p + delta (exact up to float rounding)")
