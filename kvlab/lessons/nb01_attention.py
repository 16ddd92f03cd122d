"""Notebook 01's toy decoder, checkers, decode-step timing and figures; its cells write the
mechanism (``kvlab.built.nb01``) and the reader the cached decode step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from torch import nn
from transformers import DynamicCache

from kvlab.built.nb01 import attention, decode_step_flops, repeat_kv
from kvlab.engine.models import (
    kv_bytes_per_token,
    load_public_config,
    model_device_dtype,
    synchronize,
)
from kvlab.lessons.common import Verdict, as_number, call_answer, label, unanswered, verdict
from kvlab.lessons.timing import curve_verdict, loglog_slope, ratio_verdict, time_interleaved

DecodeStep = Callable[[dict, int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyDecoder(nn.Module):
    """A random toy decoder (no positions) on notebook 01's ``attention``: ``model(ids)`` is one
    causal pass; ``model(ids, step, cache)`` hands each layer's q, k, v to ``step(cache, layer, q,
    k, v)`` (a decode step)."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int | None = None):
        super().__init__()
        self.h, self.kvh, self.d = n_heads, n_kv_heads or n_heads, d_model // n_heads
        if self.h % self.kvh:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        width = (self.h + 2 * self.kvh) * self.d  # Q, K and V projected together
        self.embed = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.qkv = nn.ModuleList(nn.Linear(d_model, width, bias=False) for _ in range(n_layers))
        self.out = nn.ModuleList(nn.Linear(self.h * self.d, d_model, bias=False)
                                 for _ in range(n_layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.LayerNorm(d_model),
                                                nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                nn.Linear(4 * d_model, d_model))
                                  for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor, step: DecodeStep | None = None,
                cache: dict | None = None) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, vocab)."""
        x = self.embed(ids)
        b, t, _ = x.shape
        for i, (norm, qkv, out, mlp) in enumerate(zip(self.norms, self.qkv, self.out, self.mlps)):
            heads = qkv(norm(x)).view(b, t, -1, self.d).transpose(1, 2)  # (B, H + 2 KVH, T, D)
            q, k, v = heads.split([self.h, self.kvh, self.kvh], dim=1)
            if step is None:
                o, _ = attention(q, repeat_kv(k, self.h // self.kvh),
                                 repeat_kv(v, self.h // self.kvh))
            else:
                o = step(cache, i, q, k, v)  # (B, H, T, D)
            x = x + out(o.transpose(1, 2).reshape(b, t, -1))
            x = x + mlp(x)
        return self.head(x)


@torch.no_grad()
def decode_with_step(model: TinyDecoder, ids: torch.Tensor, step: DecodeStep) -> torch.Tensor:
    """The logits of every position, fed one token at a time through ``step``: (B, T) -> (B, T,
    vocab)."""
    cache: dict = {}
    return torch.cat([model(ids[:, t:t + 1], step, cache) for t in range(ids.shape[1])], dim=1)


@torch.no_grad()
def cached_vs_recompute(step: DecodeStep, seq: int = 12, seed: int = 0) -> pd.DataFrame:
    """Decode ``seq`` tokens of a random TinyDecoder with ``step``, in four attention layouts, and
    compare every position's logits with one full causal pass (largest |difference|)."""
    rows = []
    for name, heads, kv_heads in [("single head", 1, 1), ("multi-head", 4, 4),
                                  ("grouped-query", 4, 2),
                                  ("multi-query", 8, 1)]:
        torch.manual_seed(seed)
        model = TinyDecoder(64, 32, 2, heads, kv_heads).eval()
        ids = torch.randint(0, 64, (2, seq))
        diff = float((decode_with_step(model, ids, step) - model(ids)).abs().max())
        rows.append({"attention": name, "heads": heads, "kv_heads": kv_heads, "tokens": seq,
                     "max |step by step - one pass|": diff})
    return pd.DataFrame(rows)


@torch.no_grad()
def stepwise_vs_one_pass(model: Any, ids: Sequence[int]) -> dict[str, float]:
    """A transformers model fed ``ids`` one token at a time, with its cache and with a fresh cache
    each step (the cache forgotten), each against one pass: largest |logit difference| and the
    argmax agreement."""

    device, _ = model_device_dtype(model)
    full = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0].float()  # (T, vocab)
    found = {}
    for name in ("with the cache", "forgetting the cache"):
        cache, rows = DynamicCache(config=model.config), []
        for t, tok in enumerate(ids):
            step_cache = cache if name == "with the cache" else DynamicCache(config=model.config)
            rows.append(model(input_ids=torch.tensor([[tok]], device=device), cache=step_cache,
                              use_cache=True, position_ids=torch.tensor([[t]], device=device)
                              ).logits[0, -1].float())
        got = torch.stack(rows)
        found[name] = float((got - full).abs().max())
        found[f"{name}: argmax agrees"] = float((got.argmax(-1) == full.argmax(-1)).float().mean())
    return found


# --------------------------------------------------------------- build 01.B: the cached decode step

def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _step_shapes(fn: DecodeStep) -> Verdict | None:
    """Two steps on an empty cache: a "not yet" about the first wrong shape, or None when the shapes
    are right."""
    torch.manual_seed(2)
    b, h, kvh, d = 2, 4, 2, 8
    cache: dict = {}
    for t in (1, 2):
        q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kvh, 1, d), torch.randn(b, kvh, 1, d)
        out, failed = call_answer(fn, cache, 0, q, k, v, name="my_decode_step",
                                  hint="append k, v to cache[layer], then attend q over the cached "
                                       "K, V")
        if failed is not None:
            return failed
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            return verdict(False,
                           hint=f"step {t}: expected an output shaped like q, (batch, heads, 1, "
                                f"head_dim) = {tuple(q.shape)}, got {_shape(out)}; with fewer KV "
                                "heads than query heads, give each query head its group's K and V "
                                "(repeat_kv)")
        pair = cache.get(0)
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            return verdict(False,
                           hint=f"after step {t} cache[0] should be a (K, V) pair, got "
                                f"{type(pair).__name__}: store what you concatenated back into "
                                "cache[layer]")
        want = (b, kvh, t, d)
        if any(not isinstance(x, torch.Tensor) or tuple(x.shape) != want for x in pair):
            return verdict(False,
                           hint=f"after step {t} cache[0]'s K and V should be (batch, kv_heads, "
                                f"seq, head_dim) = {want}, got {_shape(pair[0])} and "
                                f"{_shape(pair[1])}; concatenate along the sequence axis (dim=-2), "
                                "and cache K and V before repeat_kv")
    return None


def check_decode_step(fn: DecodeStep | None, seq: int = 10) -> Verdict:
    """Build 01.B: ``fn(cache, layer, q, k, v)`` decodes a 2-layer GQA TinyDecoder like one full
    pass (the shapes of two steps checked first, with a hint on the first wrong one). Returns a
    Verdict, never raises."""
    hint = ("append this step's k, v to cache[layer] along the sequence axis (dim=-2), then attend "
            "q over every cached key and value: softmax(q K^T / sqrt(head_dim)) V, K and V "
            "repeated for the query heads")
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
        return verdict(True,
                       f"{seq} tokens through 2 layers equal one full pass to {worst:.1e} (float "
                       "rounding)")
    first = int((diff > 1e-5).nonzero()[0])
    where = ("already at the first token: check the scaling and the softmax axis" if first == 0 else
             f"from token {first} on (the first is right): does each step see every earlier K and "
             "V, and are the layers kept apart in the cache?")
    return verdict(False,
                   hint=f"the logits differ from one full pass by up to {worst:.3g}, {where}")


# ----------------------------------------------------------------------------- exercises 01.1-01.3

def check_gqa_attention(fn: Callable[[torch.Tensor, torch.Tensor,
                                      torch.Tensor], torch.Tensor] | None) -> Verdict:
    """Exercise 01.1: ``fn(q, k, v)`` with fewer KV heads than query heads, causal, without
    ``repeat_kv``."""
    hint = ("query head h reads KV head h // (H // KVH); group the query heads, and mind the "
            "causal mask")
    torch.manual_seed(1)
    q = torch.randn(2, 6, 5, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    want, _ = attention(q, repeat_kv(k, 3), repeat_kv(v, 3))
    got, failed = call_answer(fn, q, k, v,
                              hint="define my_gqa_attention(q, k, v) and pass it in; " + hint,
                              name="my_gqa_attention")
    if failed is not None:
        return failed
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return verdict(False,
                       hint=f"expected a tensor of shape {tuple(want.shape)}, got {_shape(got)}")
    diff = float((got - want).abs().max())
    return verdict(diff <= 1e-5, f"max abs difference {diff:.1e}",
                   f"max abs difference {diff:.3g}; {hint}")


def check_kv_bytes(config_name: str, dtype: str, answer: int | None) -> Verdict:
    """Exercise 01.2: KV-cache bytes per token of a shipped public config, computed by hand."""
    hint = ("2 (K and V) x layers x kv_heads (the KV heads, not the query heads) x head_dim x "
            "bytes per element, all read from the config")
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of bytes, not {answer!r}")
    want = kv_bytes_per_token(load_public_config(config_name), dtype)
    return verdict(value == want, f"{want:,} bytes per token",
                   f"{value:,} is too {'small' if value < want else 'large'}: {hint}")


# ------------------------------------------------------------------------- what a decode step costs

@torch.no_grad()
def decode_step_cost(lengths: Sequence[int], d_model: int = 896, n_heads: int = 14,
                     n_kv_heads: int = 2,
                     repeats: int = 5, seed: int = 0,
                     device: str | torch.device = "cpu") -> pd.DataFrame:
    """One decode step of one random attention layer (Qwen2.5-0.5B's shape) at each context length
    n, with the K/V cache and recomputing, interleaved: median seconds, ``decode_step_flops`` and
    the ``Timing``s, one row per n."""
    torch.manual_seed(seed)
    hd, rep = d_model // n_heads, n_heads // n_kv_heads
    qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * hd, bias=False).to(device)
    out = nn.Linear(n_heads * hd, d_model, bias=False).to(device)

    def layer(x: torch.Tensor, past: tuple | None = None) -> torch.Tensor:  # x: (1, T, d_model)
        q, k, v = qkv(x).view(1, x.shape[1], -1, hd).transpose(1, 2).split(
            [n_heads, n_kv_heads, n_kv_heads], 1)
        if past is not None:  # the cached K, V of the n - 1 earlier tokens
            k, v = torch.cat([past[0], k], -2), torch.cat([past[1], v], -2)
        o, _ = attention(q, repeat_kv(k, rep), repeat_kv(v, rep))
        return out(o.transpose(1, 2).reshape(1, x.shape[1], -1))

    rows = []
    for n in lengths:
        x = torch.randn(1, n, d_model, device=device)
        past = qkv(x[:, :-1]).view(1, n - 1, -1, hd).transpose(1, 2).split(
            [n_heads, n_kv_heads, n_kv_heads], 1)[1:]
        t = time_interleaved({"cached": lambda x=x, past=past: layer(x[:, -1:], past),
                              "recompute": lambda x=x: layer(x)},
                             repeats=repeats, sync=lambda: synchronize(torch.device(device)))
        rows.append({"n": n, "cached_s": t["cached"].median, "recompute_s": t["recompute"].median,
                     "cached_flops": decode_step_flops(n, d_model, n_heads, n_kv_heads,
                                                       use_cache=True),
                     "recompute_flops": decode_step_flops(n, d_model, n_heads, n_kv_heads,
                                                          use_cache=False),
                     "timings": t})
    return pd.DataFrame(rows)


def quadratic_crossover(d_model: int = 896, n_heads: int = 14, n_kv_heads: int = 2) -> float:
    """Context length at which recomputation's n x n attention costs as many FLOPs as its n
    projections."""
    return 2 * d_model * (2 * n_heads + 2 * n_kv_heads) / (4 * n_heads)


def step_cost_verdicts(cost: pd.DataFrame, crossover: float, tolerance: float = 0.1) -> list[str]:
    """``decode_step_cost`` in sentences: the speed-up at the longest context, then per range of n
    (split at ``crossover``) each curve's slope d log(time) / d log(n) beside its FLOP count's."""
    last = cost.iloc[-1]
    speed = ratio_verdict(last.timings["recompute"], last.timings["cached"], at=f"at n = {last.n}")
    lines = [f"n = {last.n}: "
             + speed.says(f"the cached step is x{speed.value:.1f} faster than recomputing "
                          f"(x{speed.lo:.1f}–x{speed.hi:.1f} over the interleaved repeats)")]
    for name, col in (("no cache", "recompute"), ("with cache", "cached")):
        curve = curve_verdict(cost.n, [t[col] for t in cost.timings], expected=cost[f"{col}_flops"])
        if not curve:
            lines.append(f"{name}: {curve.text}; no slopes read from this curve")
            continue
        for part, mask in (("n <= crossover", cost.n <= crossover),
                           ("n >= crossover", cost.n >= crossover)):
            if mask.sum() < 2:
                lines.append(f"{name}, {part}: fewer than two measured lengths, no slope")
                continue
            n, t, f = cost.n[mask], cost[f"{col}_s"][mask], cost[f"{col}_flops"][mask]
            ms, cs = loglog_slope(n, t), loglog_slope(n, f)
            how = ("grew as counted" if abs(ms - cs) <= tolerance else
                   "grew MORE than counted" if ms > cs else "grew LESS than counted")
            lines.append(f"{name}, {part} (n = {', '.join(map(str, n))}): time "
                         f"x{t.iloc[-1] / t.iloc[0]:.1f} (slope {ms:.2f}) where the FLOP count "
                         f"says x{f.iloc[-1] / f.iloc[0]:.1f} (slope {cs:.2f}): {how}")
    return lines


# ----------------------------------------------------------------------------- figures

def fig_attention_weights(weights: Any, labels: Sequence[str] | None = None,
                          title: str = "causal attention weights") -> Figure:
    """Heatmap of one head's (q_len, k_len) attention weights; masked (future) cells are 0."""
    w = np.asarray(weights, dtype=float)
    fig, ax = plt.subplots(figsize=(4.8, 3.8))
    im = ax.imshow(w, cmap="viridis", vmin=0, vmax=max(float(w.max()), 1e-9))
    ax.set_xlabel("key position (what is attended to)")
    ax.set_ylabel("query position (who attends)")
    if labels is not None:
        ax.set_xticks(range(w.shape[1]), [label(t) for t in labels[-w.shape[1]:]], rotation=90,
                      fontsize=7)
        ax.set_yticks(range(w.shape[0]), [label(t) for t in labels[-w.shape[0]:]], fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="weight")
    fig.tight_layout()
    return fig


def fig_step_cost(cost: pd.DataFrame,
                  title: str = "one decode step of one attention layer") -> Figure:
    """Measured ms per step (median, min–max whiskers; left) and counted FLOPs (right) against the
    context length, with the cache and without: ``decode_step_cost``'s table."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for col, style, name in (("recompute", "o-", "no cache"), ("cached", "s-", "KV cache")):
        med = 1e3 * cost[f"{col}_s"].to_numpy()
        lo, hi = (1e3 * np.array([getattr(t[col], end) for t in cost.timings])
                  for end in ("lo", "hi"))
        axes[0].errorbar(cost.n, med, yerr=[med - lo, hi - med], fmt=style, capsize=3, label=name)
        axes[1].plot(cost.n, cost[f"{col}_flops"], style, label=name)
    for ax, ylabel, name in ((axes[0], "time per step (ms)", "measured (median, min–max)"),
                             (axes[1], "FLOPs per step", "counted")):
        ax.set(xscale="log", yscale="log", xlabel="context length n (tokens)", ylabel=ylabel,
               title=name)
        ax.set_xticks(cost.n, [str(n) for n in cost.n])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) of each layer of a transformers cache (or a kvlab PrefixKV), each (kv_heads, seq,
    head_dim)."""
    cache = getattr(cache, "cache", cache)  # a PrefixKV holds the transformers cache
    return [(layer.keys[0].detach().float().cpu(), layer.values[0].detach().float().cpu())
            for layer in cache.layers]


def fig_kv_cache(cache: Any, tokens: Sequence[str] | None = None) -> Figure:
    """What a KV cache holds: one K and one V panel per layer x KV head, rows = positions, columns =
    head dims; the K panels (left) share one colour scale and the V panels (right) another, each
    with its colour bar."""
    kv = cache_tensors(cache)
    heads, seq, dim = kv[0][0].shape
    fig, axes = plt.subplots(len(kv), 2 * heads,
                             figsize=(1.9 * 2 * heads + 2.4, 1.6 * len(kv) + 1.4),
                             squeeze=False, sharey=True, layout="constrained")
    for j, (name, cmap) in enumerate((("K", "RdBu_r"), ("V", "PuOr_r"))):
        lim = max(float(layer[j].abs().max()) for layer in kv) or 1.0
        for layer, pair in enumerate(kv):
            for h in range(heads):
                ax = axes[layer, j * heads + h]
                im = ax.imshow(pair[j][h].numpy(), aspect="auto", cmap=cmap, vmin=-lim, vmax=lim,
                               interpolation="nearest")
                ax.set_title(f"layer {layer} · {name} head {h}", fontsize=8)
                ax.set_xticks([0, dim - 1])
                ax.tick_params(labelsize=7)
                if layer == len(kv) - 1:
                    ax.set_xlabel("head dim", fontsize=7)
        fig.colorbar(im, ax=axes[:, j * heads:(j + 1) * heads], label=f"{name} value", shrink=0.8)
    for layer in range(len(kv)):
        axes[layer, 0].set_ylabel("position", fontsize=7)
    if tokens is not None and seq <= 16:
        axes[0, 0].set_yticks(range(seq), [label(t) for t in tokens], fontsize=6)
    fig.suptitle(f"the cache: {len(kv)} layers x {heads} KV heads x (K and V) x {seq} positions x "
                 f"{dim} dims\nno Q: a query is used once, by its own token's step, and never read "
                 "again",
                 fontsize=10)
    return fig
