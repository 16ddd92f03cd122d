"""Figures for the attention and prefix-reuse lessons (notebooks 01 and 02).

Every function takes plain data (lists, dicts, tensors, configs) and returns a matplotlib
``Figure``; nothing here runs a model. Notebooks wrap them in widgets with
``ipywidgets.interactive_output``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

GIB = 2**30
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
             "SimHei", "Microsoft YaHei", "PingFang SC", "Heiti SC", "Arial Unicode MS")


def _find_cjk_font() -> str | None:
    """The first installed font that can draw Chinese, added as a fallback after the default font."""
    from matplotlib import font_manager, rcParams

    installed = {f.name for f in font_manager.fontManager.ttflist}
    found = next((name for name in CJK_FONTS if name in installed), None)
    if found and found not in rcParams["font.sans-serif"]:
        rcParams["font.sans-serif"] = [rcParams["font.sans-serif"][0], found, *rcParams["font.sans-serif"][1:]]
    return found


CJK_FONT = _find_cjk_font()


def label(text: str) -> str:
    """Text safe to draw: CJK characters become ``\\uXXXX`` escapes when no CJK font is installed."""
    if CJK_FONT:
        return text
    return "".join(c if ord(c) < 0x2E80 else f"\\u{ord(c):04x}" for c in text)


def attention_weights_figure(weights: Any, labels: Sequence[str] | None = None,
                             title: str = "causal attention weights") -> Figure:
    """Heatmap of one head's (q_len, k_len) attention weights; masked (future) cells are 0."""
    w = np.asarray(weights, dtype=float)
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    im = ax.imshow(w, cmap="viridis", vmin=0, vmax=max(float(w.max()), 1e-9))
    ax.set_xlabel("key position (what is attended to)")
    ax.set_ylabel("query position (who attends)")
    if labels is not None:
        ax.set_xticks(range(w.shape[1]), [label(t) for t in labels[-w.shape[1]:]], rotation=90, fontsize=7)
        ax.set_yticks(range(w.shape[0]), [label(t) for t in labels[-w.shape[0]:]], fontsize=7)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="weight")
    fig.tight_layout()
    return fig


def step_cost_figure(rows: Sequence[Mapping[str, float]], title: str = "one decode step of one attention layer"
                     ) -> Figure:
    """Measured ms (left) and counted FLOPs (right) of a decode step vs context length, cached or not."""
    n = np.array([r["n"] for r in rows], dtype=float)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.loglog(n, [1e3 * r["recompute_s"] for r in rows], "o-", label="no cache: recompute all n tokens")
    ax1.loglog(n, [1e3 * r["cached_s"] for r in rows], "s-", label="KV cache: 1 new token")
    ax1.set_xlabel("context length n (tokens)")
    ax1.set_ylabel("time per step (ms, median)")
    ax1.set_title("measured")
    ax2.loglog(n, [r["recompute_flops"] for r in rows], "o-", label="no cache")
    ax2.loglog(n, [r["cached_flops"] for r in rows], "s-", label="KV cache")
    ref = rows[-1]["recompute_flops"] * (n / n[-1]) ** 2
    ax2.loglog(n, ref, ":", color="gray", label="slope 2 (n²)")
    ax2.loglog(n, rows[-1]["cached_flops"] * (n / n[-1]), "--", color="gray", label="slope 1 (n)")
    ax2.set_xlabel("context length n (tokens)")
    ax2.set_ylabel("FLOPs per step")
    ax2.set_title("counted")
    for ax in (ax1, ax2):
        ax.set_xticks(n, [f"{int(v)}" for v in n])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def kv_memory_figure(per_token_bytes: Mapping[str, int], context: int, batch_sizes: Sequence[int] = (1, 8, 32),
                     budget_gib: float | None = None, title: str = "") -> Figure:
    """KV-cache GiB vs context length (up to ``context``) for each model, one line style per batch size.

    ``per_token_bytes`` maps a model name to ``kv_bytes_per_token(config, dtype)``.
    """
    x = np.linspace(context / 200, context, 200)  # from > 0: the y axis is logarithmic
    fig, ax = plt.subplots(figsize=(8, 4.2))
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, bpt) in enumerate(per_token_bytes.items()):
        for j, b in enumerate(batch_sizes):
            ax.plot(x, x * bpt * b / GIB, styles[j % len(styles)], color=colors[i % len(colors)],
                    label=f"{name}, batch {b}")
    if budget_gib is not None:
        ax.axhline(budget_gib, color="black", lw=1)
        ax.annotate(f"{budget_gib:g} GiB", (0, budget_gib), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("KV cache (GiB)")
    ax.set_yscale("log")
    ax.set_title(title or f"KV cache size at up to {context:,} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def prefill_ratio_figure(rows: Sequence[Mapping[str, Any]], title: str = "prefill with a cached prefix") -> Figure:
    """Bars: measured cached/full prefill time ratio beside the ideal (uncached share of tokens)."""
    names = [r["setting"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.8 * len(rows)), 3.8))
    ax.bar(x - 0.2, [r["ratio"] for r in rows], 0.4, label="measured: cached / full")
    ax.bar(x + 0.2, [r["ideal"] for r in rows], 0.4, label="ideal: uncached tokens / all tokens")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ratio']:.3f}", (i - 0.2, r["ratio"]), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{r['ideal']:.3f}", (i + 0.2, r["ideal"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("time to first logits, relative to full prefill")
    ax.set_ylim(0, max(1.05, max(r["ratio"] for r in rows) * 1.15))
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def token_boundary_figure(prefix_pieces: Sequence[str], full_pieces: Sequence[str], first_diff: int | None,
                          title: str = "") -> Figure:
    """Two rows of token boxes: the prefix tokenized alone and the full text; the first difference in red."""
    fig, ax = plt.subplots(figsize=(10, 1.8))
    for row, (row_name, pieces) in enumerate((("prefix alone", prefix_pieces), ("full text", full_pieces))):
        y = 1 - row
        ax.text(-0.2, y, row_name, ha="right", va="center", fontsize=9)
        for i, piece in enumerate(pieces):
            bad = first_diff is not None and i >= first_diff
            ax.add_patch(plt.Rectangle((i, y - 0.35), 0.95, 0.7, facecolor="#fcbba1" if bad else "#c6dbef",
                                       edgecolor="gray"))
            ax.text(i + 0.475, y, label(repr(piece)[1:-1])[:8], ha="center", va="center", fontsize=7)
    ax.set_xlim(-3, max(len(prefix_pieces), len(full_pieces)) + 0.5)
    ax.set_ylim(-0.6, 1.6)
    ax.axis("off")
    ax.set_title(title or "tokens (red: from the first difference on)", fontsize=10)
    fig.tight_layout()
    return fig
