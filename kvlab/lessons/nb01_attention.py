"""Notebook 01's checkers, figures and the build exercise's reference; the mechanism is written in its cells.

Notebook 01 writes attention, ``repeat_kv``, ``KVCache``, ``SelfAttention``/``TinyDecoder``, the decode loops,
the FLOP count and the timing harness in ``#| export`` cells: import them from ``kvlab.built.nb01``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from kvlab.built.nb01 import TinyDecoder, attention, decode_with_step, repeat_kv
from kvlab.lessons.common import GIB, Verdict, as_number, call_answer, label, unanswered, verdict

DecodeStep = Callable[[dict, int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference_decode_step(cache: dict, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                          ) -> torch.Tensor:
    """kvlab's decode step: append k, v to ``cache[layer]`` (a (K, V) pair), attend q over all of it.

    q: (B, H, 1, D), this token's queries; k, v: (B, KVH, 1, D), its keys and values -> (B, H, 1, D).
    """
    if layer in cache:
        past_k, past_v = cache[layer]
        k, v = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)  # (B, KVH, T_past + 1, D)
    cache[layer] = (k, v)
    n_rep = q.shape[1] // k.shape[1]
    out, _ = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))  # one query: every cached key is visible
    return out


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _step_shapes(fn: DecodeStep) -> Verdict | None:
    """Two steps on an empty cache: a "not yet" about the first wrong shape, or None when the shapes are right."""
    torch.manual_seed(2)
    b, h, kvh, d = 2, 4, 2, 8
    cache: dict = {}
    for t in (1, 2):
        q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kvh, 1, d), torch.randn(b, kvh, 1, d)
        out, failed = call_answer(fn, cache, 0, q, k, v, name="my_decode_step",
                                  hint="append k, v to cache[layer], then attend q over the cached K, V")
        if failed is not None:
            return failed
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            return verdict(False, hint=f"step {t}: expected an output shaped like q, (batch, heads, 1, head_dim) = "
                                       f"{tuple(q.shape)}, got {_shape(out)}; with fewer KV heads than query heads, "
                                       "give each query head its group's K and V (repeat_kv)")
        pair = cache.get(0)
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            return verdict(False, hint=f"after step {t} cache[0] should be a (K, V) pair, got {type(pair).__name__}: "
                                       "store what you concatenated back into cache[layer]")
        want = (b, kvh, t, d)
        if any(not isinstance(x, torch.Tensor) or tuple(x.shape) != want for x in pair):
            return verdict(False, hint=f"after step {t} cache[0]'s K and V should be (batch, kv_heads, seq, head_dim) "
                                       f"= {want}, got {_shape(pair[0])} and {_shape(pair[1])}; concatenate along the "
                                       "sequence axis (dim=-2), and cache K and V before repeat_kv")
    return None


def check_decode_step(fn: DecodeStep | None, seq: int = 10) -> Verdict:
    """Build exercise 01.B: ``fn(cache, layer, q, k, v)`` decodes a 2-layer GQA TinyDecoder like one full pass.

    Checks the shapes of two steps first (with a hint on the first wrong one), then decodes ``seq`` tokens with
    ``fn`` in every layer and compares the logits with one causal pass. Returns a Verdict, never raises.
    """
    hint = ("append this step's k, v to cache[layer] along the sequence axis (dim=-2), then attend q over "
            "every cached key and value: softmax(q K^T / sqrt(head_dim)) V, K and V repeated for the query heads")
    if fn is None:
        return unanswered(hint)
    wrong = _step_shapes(fn)
    if wrong is not None:
        return wrong
    torch.manual_seed(3)
    model = TinyDecoder(64, 32, n_layers=2, n_heads=4, n_kv_heads=2).eval()
    ids = torch.randint(0, 64, (2, seq))
    with torch.no_grad():
        full = model(ids)  # (B, T, vocab)
    try:
        got = decode_with_step(model, ids, fn)
    except Exception as err:  # the reader's code may fail in any way
        return verdict(False, hint=f"my_decode_step raised {type(err).__name__}: {err}")
    diff = (got - full).abs().amax(dim=(0, 2))  # per position
    worst = float(diff.max())
    if worst <= 1e-5:
        return verdict(True, f"{seq} tokens through 2 layers equal one full pass to {worst:.1e} (float rounding)")
    first = int((diff > 1e-5).nonzero()[0])
    where = ("already at the first token: check the scaling and the softmax axis" if first == 0 else
             f"from token {first} on (the first is right): does each step see every earlier K and V, and are the "
             "layers kept apart in the cache?")
    return verdict(False, hint=f"the logits differ from one full pass by up to {worst:.3g}, {where}")


def check_gqa_attention(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None) -> Verdict:
    """Exercise 01.1: ``fn(q, k, v)`` with fewer KV heads than query heads, causal, without ``repeat_kv``.

    q: (B, H, T, D); k, v: (B, KVH, T, D) -> (B, H, T, D). Returns a Verdict, never raises.
    """
    hint = "query head h reads KV head h // (H // KVH); group the query heads, and mind the causal mask"
    torch.manual_seed(1)
    q = torch.randn(2, 6, 5, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    want, _ = attention(q, repeat_kv(k, 3), repeat_kv(v, 3))
    got, failed = call_answer(fn, q, k, v, hint="define my_gqa_attention(q, k, v) and pass it in; " + hint,
                              name="my_gqa_attention")
    if failed is not None:
        return failed
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return verdict(False, hint=f"expected a tensor of shape {tuple(want.shape)}, got "
                                   f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    diff = float((got - want).abs().max())
    return verdict(diff <= 1e-5, f"max abs difference {diff:.1e}", f"max abs difference {diff:.3g}; {hint}")


def check_kv_bytes(config_name: str, dtype: str, answer: int | None) -> Verdict:
    """Exercise 01.2: KV-cache bytes per token of a shipped public config, computed by hand."""
    from kvlab.engine.models import kv_bytes_per_token, load_public_config

    hint = ("2 (K and V) x layers x kv_heads (the KV heads, not the query heads) x head_dim x bytes per element, "
            "all read from the config")
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of bytes, not {answer!r}")
    want = kv_bytes_per_token(load_public_config(config_name), dtype)
    return verdict(value == want, f"{want:,} bytes per token",
                   f"{value:,} is too {'small' if value < want else 'large'}: {hint}")


def max_context_tokens(config: Any, dtype: str, budget_gib: float, batch: int = 1) -> int:
    """How many tokens of context per sequence fit in ``budget_gib`` of KV cache for ``batch`` sequences."""
    from kvlab.engine.models import kv_bytes_per_token

    return int(budget_gib * 2**30 // (kv_bytes_per_token(config, dtype) * batch))


def check_max_context(config_name: str, dtype: str, budget_gib: float, batch: int, answer: int | None) -> Verdict:
    """Exercise 01.3: the longest context that fits a KV budget (within 1%)."""
    from kvlab.engine.models import load_public_config

    hint = "divide the budget in bytes (1 GiB = 2**30 bytes) by (KV bytes per token x batch)"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of tokens, not {answer!r}")
    want = max_context_tokens(load_public_config(config_name), dtype, budget_gib, batch)
    return verdict(abs(value - want) <= 0.01 * want, f"about {want:,} tokens per sequence",
                   f"{value:,} tokens is too {'few' if value < want else 'many'}: {hint}")


def fig_attention_weights(weights: Any, labels: Sequence[str] | None = None,
                          title: str = "causal attention weights") -> Figure:
    """Heatmap of one head's (q_len, k_len) attention weights; masked (future) cells are 0."""
    w = np.asarray(weights, dtype=float)
    fig, ax = plt.subplots(figsize=(4.8, 3.8))
    im = ax.imshow(w, cmap="viridis", vmin=0, vmax=max(float(w.max()), 1e-9))
    ax.set_xlabel("key position (what is attended to)")
    ax.set_ylabel("query position (who attends)")
    if labels is not None:
        ax.set_xticks(range(w.shape[1]), [label(t) for t in labels[-w.shape[1]:]], rotation=90, fontsize=7)
        ax.set_yticks(range(w.shape[0]), [label(t) for t in labels[-w.shape[0]:]], fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="weight")
    fig.tight_layout()
    return fig


def fig_step_cost(rows: Sequence[Mapping[str, float]], title: str = "one decode step of one attention layer"
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


def fig_kv_memory(per_token_bytes: Mapping[str, int], context: int, batch_sizes: Sequence[int] = (1, 8, 32),
                  budget_gib: float | None = None, title: str = "") -> Figure:
    """KV-cache GiB vs context (up to ``context``) per model (``{name: kv_bytes_per_token}``), a style per batch."""
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


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) of each layer of a transformers cache (or a kvlab PrefixKV), each (kv_heads, seq, head_dim)."""
    cache = getattr(cache, "cache", cache)  # a PrefixKV holds the transformers cache
    return [(layer.keys[0].detach().float().cpu(), layer.values[0].detach().float().cpu()) for layer in cache.layers]


def fig_kv_cache(cache: Any, tokens: Sequence[str] | None = None) -> Figure:
    """What a KV cache holds: one K and one V panel per layer x KV head, rows = positions, columns = head dims."""
    kv = cache_tensors(cache)
    heads, seq, dim = kv[0][0].shape
    fig, axes = plt.subplots(len(kv), 2 * heads, figsize=(1.9 * 2 * heads + 1, 1.6 * len(kv) + 1.4),
                             squeeze=False, sharey=True)
    for layer, (k, v) in enumerate(kv):
        for h in range(heads):
            for col, (name, t) in enumerate((("K", k), ("V", v))):
                ax = axes[layer, 2 * h + col]
                lim = float(t[h].abs().max()) or 1.0
                ax.imshow(t[h].numpy(), aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
                ax.set_title(f"layer {layer} · {name} head {h}", fontsize=8)
                ax.set_xticks([0, dim - 1])
                ax.tick_params(labelsize=7)
                if layer == len(kv) - 1:
                    ax.set_xlabel("head dim", fontsize=7)
        axes[layer, 0].set_ylabel("position", fontsize=7)
    if tokens is not None and seq <= 16:
        axes[0, 0].set_yticks(range(seq), [label(t) for t in tokens], fontsize=6)
    fig.suptitle(f"the cache: {len(kv)} layers x {heads} KV heads x (K and V) x {seq} positions x {dim} dims\n"
                 "no Q: a query is used once, by its own token's step, and never read again", fontsize=10)
    fig.tight_layout()
    return fig
