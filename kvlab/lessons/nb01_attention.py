"""Notebook 01's helpers around the attention and KV cache it writes in its cells.

Notebook 01 writes the mechanism itself in ``#| export`` cells, exported to ``kvlab.built.nb01``
(scripts/export_notebooks.py) and re-exported here: ``causal_mask`` and ``attention`` (softmax(Q K^T / sqrt(d)) V
under a causal mask), ``repeat_kv`` (grouped-query attention), ``KVCache`` (per-layer K and V, appended one step
at a time; Q is never stored), ``decode_logits`` (token-by-token decoding, cached or recomputed),
``decode_step_flops`` (the count of one decode step) and the timing harness (``time_interleaved``,
``ratio_verdict``, ``curve_verdict``). Kept here:

* ``SelfAttention`` projects x to Q, K, V with any number of query heads and of key/value heads
  (multi-head when they are equal, grouped-query attention when there are fewer KV heads).
* ``TinyDecoder`` stacks a few such layers so that "cached decode == recompute" is checked through
  several layers, as in a real model.
* ``decode_step_cost`` times one decode step with and without the cache through the harness.
* the build exercise's reference and checker, the exercise checkers and the figures.

No position encoding here on purpose (notebook 03 is about RoPE): causality alone orders tokens.

References: Vaswani et al. 2017 (attention); Ainslie et al. 2023 (GQA); nanoGPT's ``model.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from torch import nn

from kvlab.engine.models import model_device_dtype, synchronize
from kvlab.built.nb01 import (  # noqa: F401 (re-exported: written in notebook 01's cells)
    KVCache,
    attention,
    causal_mask,
    curve_verdict,
    decode_logits,
    decode_step_flops,
    ratio_verdict,
    repeat_kv,
    time_interleaved,
)
from kvlab.lessons.common import GIB, Verdict, as_number, call_answer, label, unanswered, verdict

# ----------------------------------------------------------------------------- attention itself

def last_row_ignores_past_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Perturb past Q, then past K and V, and report how much the last position's output moves.

    The last row depends on Q only through its own query, but on every earlier K and V: that is
    why a decode step keeps K and V of the past and throws Q away. Shapes as in ``attention``.
    """
    base, _ = attention(q, k, v)
    noise = lambda t: t + torch.randn_like(t)  # noqa: E731
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[..., :-1, :] = noise(q[..., :-1, :])
    k2[..., :-1, :] = noise(k[..., :-1, :])
    v2[..., :-1, :] = noise(v[..., :-1, :])
    last = lambda out: out[..., -1, :]  # noqa: E731
    return {
        "past Q changed": float((last(attention(q2, k, v)[0]) - last(base)).abs().max()),
        "past K changed": float((last(attention(q, k2, v)[0]) - last(base)).abs().max()),
        "past V changed": float((last(attention(q, k, v2)[0]) - last(base)).abs().max()),
    }


# ----------------------------------------------------------------------------- layers and a tiny model

class SelfAttention(nn.Module):
    """Causal self-attention with ``n_heads`` query heads and ``n_kv_heads`` key/value heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim or d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # (B, heads, T, D)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        """x: (batch, new_tokens, d_model) -> (batch, new_tokens, d_model); appends K, V to ``cache``."""
        q = self._split(self.q_proj(x), self.n_heads)  # (B, H, T_new, D)
        k = self._split(self.k_proj(x), self.n_kv_heads)  # (B, KVH, T_new, D)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, KVH, T_past + T_new, D)
        n_rep = self.n_heads // self.n_kv_heads
        out, _ = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))  # (B, H, T_new, D)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class TinyDecoder(nn.Module):
    """Embedding -> n x (pre-norm attention + MLP, residuals) -> logits. No position encoding."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
                 n_kv_heads: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.norms1 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.attns = nn.ModuleList(SelfAttention(d_model, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norms2 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
            for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """ids: (batch, new_tokens) -> logits (batch, new_tokens, vocab)."""
        x = self.embed(ids)  # (B, T, d_model)
        for i, (n1, attn, n2, mlp) in enumerate(zip(self.norms1, self.attns, self.norms2, self.mlps)):
            x = x + attn(n1(x), cache, layer=i)
            x = x + mlp(n2(x))
        return self.head(x)


# ----------------------------------------------------------------------------- build exercise 01.B: the decode step

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


@torch.no_grad()
def decode_with_step(model: TinyDecoder, ids: torch.Tensor, step: DecodeStep) -> torch.Tensor:
    """TinyDecoder's logits computed one token at a time, each layer's attention done by ``step``.

    ids: (batch, T) -> (batch, T, vocab); the cache is a dict ``{layer: (K, V)}`` that ``step`` fills.
    """
    cache: dict = {}
    rows = []
    for t in range(ids.shape[1]):
        x = model.embed(ids[:, t:t + 1])  # (B, 1, d_model)
        for i, (n1, attn, n2, mlp) in enumerate(zip(model.norms1, model.attns, model.norms2, model.mlps)):
            h = n1(x)
            q, k, v = (attn._split(proj(h), heads) for proj, heads in
                       ((attn.q_proj, attn.n_heads), (attn.k_proj, attn.n_kv_heads), (attn.v_proj, attn.n_kv_heads)))
            out = step(cache, i, q, k, v)  # (B, H, 1, D)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(x.shape[0], 1, attn.n_heads * attn.head_dim))
            x = x + mlp(n2(x))
        rows.append(model.head(x)[:, -1])
    return torch.stack(rows, dim=1)


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


@torch.no_grad()
def cached_vs_recompute(n_heads: int, n_kv_heads: int, d_model: int = 32, n_layers: int = 2, seq: int = 12,
                        batch: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", step: DecodeStep | None = None) -> float:
    """Max abs difference between cached decoding and full recomputation on a random TinyDecoder.

    ``step``: a decode step (``reference_decode_step``'s signature) to decode with instead of ``KVCache``.
    """
    torch.manual_seed(seed)
    model = TinyDecoder(64, d_model, n_layers, n_heads, n_kv_heads).to(device, dtype).eval()
    ids = torch.randint(0, 64, (batch, seq), device=device)
    full = model(ids)  # (B, T, vocab): one causal pass over everything, the reference
    cached = decode_logits(model, ids, use_cache=True) if step is None else decode_with_step(model, ids, step)
    recomputed = decode_logits(model, ids, use_cache=False)
    return float(max((cached - full).abs().max(), (recomputed - full).abs().max()))


# ----------------------------------------------------------------------------- cost of one decode step

def quadratic_crossover(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int | None = None) -> float:
    """Context length at which recomputation's n x n attention costs as much as its n projections.

    Below it a no-cache decode step grows roughly linearly with n; above it, quadratically.
    """
    head_dim = head_dim or d_model // n_heads
    proj_per_token = 2 * d_model * head_dim * (2 * n_heads + 2 * n_kv_heads)
    return proj_per_token / (4 * n_heads * head_dim)


@torch.no_grad()
def decode_step_cost(lengths: list[int], d_model: int = 896, n_heads: int = 14, n_kv_heads: int = 2,
                     repeats: int = 5, seed: int = 0, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    """Median seconds of one decode step of one attention layer, with and without the KV cache.

    Defaults are one layer of Qwen2.5-0.5B (896 wide, 14 query heads, 2 KV heads). The two steps are timed
    against each other by ``time_interleaved`` (warm-up, alternating order). Returns one row per length:
    ``n``, ``cached_s``, ``recompute_s`` (medians), the FLOPs of each, and ``timings``
    (``{"cached": Timing, "recompute": Timing}``, with min and max, for the guard).
    """
    torch.manual_seed(seed)
    device = torch.device(device)
    layer = SelfAttention(d_model, n_heads, n_kv_heads).to(device, dtype).eval()
    rows = []
    for n in lengths:
        x = torch.randn(1, n, d_model, device=device, dtype=dtype)  # (1, n, d_model)
        cache = KVCache()
        layer(x[:, :-1], cache)  # K, V of the first n-1 tokens

        def cached_step(x=x, cache=cache, n=n):
            layer(x[:, -1:], cache)  # 1 new token against n-1 cached ones
            cache.crop(n - 1)  # undo the append so every repeat measures the same step

        def recompute_step(x=x):
            layer(x)  # all n tokens again

        t = time_interleaved({"cached": cached_step, "recompute": recompute_step}, repeats=repeats, warmup=1,
                             sync=lambda: synchronize(device))
        rows.append({
            "n": n,
            "cached_s": t["cached"].median,
            "recompute_s": t["recompute"].median,
            "cached_flops": decode_step_flops(n, d_model, n_heads, n_kv_heads, use_cache=True),
            "recompute_flops": decode_step_flops(n, d_model, n_heads, n_kv_heads, use_cache=False),
            "timings": t,
        })
    return rows


# ----------------------------------------------------------------------------- exercise checkers

def slope_report(cost: Any, crossover: float, tolerance: float = 0.1) -> list[str]:
    """Measured vs counted growth of a decode step, per range of n: log-log slopes and a verdict for each.

    ``cost`` is ``decode_step_cost``'s table (a DataFrame with n, recompute_s/_flops, cached_s/_flops).
    A slope is d log(y) / d log(n): 1 is linear, 2 quadratic. Two slopes "agree" within ``tolerance``
    (0.1: over a 32-fold range of n, growth factors within 32 ** 0.1 = 1.4x of each other). Each curve goes
    through the harness's guard first (``curve_verdict`` against its FLOP count): a flagged range prints
    "outlier — re-run" instead of a slope and a cause.
    """
    lines = ["slope = k in cost ~ n^k, fitted per range (1 linear, 2 quadratic); growth = cost at the largest n / "
             f"at the smallest; slopes within {tolerance} count as agreeing"]

    def slope(col: str, mask: Any) -> float:
        return float(np.polyfit(np.log(cost.n[mask]), np.log(cost[col][mask]), 1)[0])

    for part, mask in (("n <= crossover", cost.n <= crossover), ("n >= crossover", cost.n >= crossover)):
        if mask.sum() < 2:
            lines.append(f"{part}: fewer than two measured lengths, no slope")
            continue
        lines.append(f"{part} (n = {', '.join(str(n) for n in cost.n[mask])}):")
        for name, col in (("no cache", "recompute"), ("with cache", "cached")):
            guard = curve_verdict(cost.n[mask], cost[f"{col}_s"][mask], expected=cost[f"{col}_flops"][mask])
            if not guard:
                lines.append(f"   {name}: {guard.text}")
                continue
            ms, cs = slope(f"{col}_s", mask), slope(f"{col}_flops", mask)
            t, f = cost[f"{col}_s"][mask], cost[f"{col}_flops"][mask]
            head = (f"   {name}: time slope {ms:.2f} (growth x{t.iloc[-1] / t.iloc[0]:.1f}), counted-FLOP slope {cs:.2f} "
                    f"(growth x{f.iloc[-1] / f.iloc[0]:.1f}) -> ")
            if abs(ms - cs) <= tolerance:
                lines.append(head + "the time grows as the FLOP count says")
            elif ms > cs:
                lines.append(head + "the time grows FASTER than the counted FLOPs; the count leaves out memory traffic "
                             + ("(the n x n score matrix, its mask and softmax)" if col == "recompute"
                                else "(reading the n cached keys and values each step)"))
            else:
                lines.append(head + "the time grows SLOWER than the counted FLOPs: fixed per-call costs still weigh "
                             "at these lengths")
    return lines


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


@torch.no_grad()
def stepwise_logits(model: Any, ids: Sequence[int], use_cache: bool = True) -> torch.Tensor:
    """(T, vocab) logits of an HF model fed one token at a time: with its cache, or forgetting it each step."""
    from transformers import DynamicCache

    device, _ = model_device_dtype(model)
    cache = DynamicCache(config=model.config)
    rows = []
    for t, tok in enumerate(ids):
        step_cache = cache if use_cache else DynamicCache(config=model.config)  # a fresh one = no memory
        out = model(input_ids=torch.tensor([[tok]], device=device), position_ids=torch.tensor([[t]], device=device),
                    cache=step_cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


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
