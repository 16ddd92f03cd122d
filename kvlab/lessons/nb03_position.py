"""Notebook 03 (position encoding): figures, exercise checkers and solutions.

The experiments (the shift sweep, the restart, group 2's overlap and re-rotation, group 3, left padding, the
per-bug table) and RoPE are written in notebook 03's cells: import them from ``kvlab.built.nb03``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import torch

from kvlab.built import nb03
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict

# exercise 03.3's reference
from kvlab.lessons.solutions import ex03_3_positions_from_mask as positions_from_mask


def fig_shift_sweep(sweep: Any):
    """Recall and token agreement vs shift, for a shifted prefix and for everything shifted (a Figure)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    restart = sweep[sweep["kind"] == nb03.SWEEP_KINDS[3]]
    for ax, metric, label in ((axes[0], "agreement", "token agreement with isolated"),
                              (axes[1], "recalled", "passphrase recall")):
        for kind, style in zip(nb03.SWEEP_KINDS[:3], ("o-", "^-", "s--")):
            d = sweep[sweep["kind"] == kind].groupby("shift")[metric].mean()
            ax.plot([max(s, 0.5) for s in d.index], d.values, style, label=kind)
        ax.axhline(restart[metric].mean(), color="grey", ls=":", label="suffix restarts at 0")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position error s (tokens; 0 drawn at 0.5)")
        ax.set_ylabel(label)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(label)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("A cached prefix and its suffix at wrong distances (s) or all moved by s")
    fig.tight_layout()
    return fig


def fig_shift_explorer(key_errors: dict, shift: int, layer: int):
    """The widget's view: per prefix token, the key error at ``layer`` for a prefix computed at ``shift``.. (a Figure)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(key_errors[shift]["as is"][layer], label=f"keys computed at s={shift}, as is")
    ax.plot(key_errors[shift]["re-rotated"][layer], label=f"re-rotated by -{shift}")
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.set(xlabel="prefix token", ylabel="relative error of the key", title=f"layer {layer}: keys vs positions 0..")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_layer_errors(errors: dict[str, Any]):
    """Per-layer relative error of the reused segment's K and V, one panel per model (a Figure)."""
    fig, axes = plt.subplots(1, len(errors), figsize=(5 * len(errors), 3.6), squeeze=False)
    for ax, (name, df) in zip(axes[0], errors.items()):
        m = df.groupby(["treatment", "tensor", "layer"])["relative error"].mean()
        for (treatment, tensor), style, label in (
                (("A's K/V as is", "K"), "o-", "K as is"), (("A's K/V re-rotated", "K"), "s-", "K re-rotated by Δ"),
                (("A's K/V as is", "V"), "^--", "V (no rotation to undo)")):
            d = m.loc[(treatment, tensor)]
            ax.plot(d.index, d.values.clip(1e-9), style, label=label)
        ax.set_yscale("log")
        ax.set(xlabel="layer", ylabel="relative error vs recomputed\n(0 drawn at 1e-9)", title=name)
        layers = sorted(df["layer"].unique())
        ax.set_xticks(layers[::-(-len(layers) // 15)])  # at most 15 ticks: 30 layers would overlap
        ax.legend(fontsize=8)
    fig.suptitle("Group 2: a segment's K/V taken from a request that started differently")
    fig.tight_layout()
    return fig


def fig_outcomes(summary: Any, title: str):
    """Horizontal bars of token-identical and recall fractions per way (a Figure)."""
    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.6 * len(summary)))
    y = range(len(summary))
    for dy, col, name in ((0.2, "identical", "token-identical to isolated"), (-0.2, "recalled", "recall")):
        bars = ax.barh([i + dy for i in y], summary[col], height=0.4, label=name)
        ax.bar_label(bars, labels=[f"{v:.0%}" for v in summary[col]], padding=2, fontsize=8)  # a 0 bar still shows "0%"
    labels = [" | ".join(map(str, i)) if isinstance(i, tuple) else str(i) for i in summary.index]
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1.12), xlabel="fraction of requests")
    ax.set_title(title, pad=26)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)  # above the bars
    fig.tight_layout()
    return fig


def rotation_pairs(key: torch.Tensor, shift: int, theta: float = 10000.0,
                   pairs: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Some (i, i + head_dim/2) pairs of a RoPE'd ``key`` (head_dim,) before and after ``rerotate`` by ``shift``."""
    key = key.detach().float().cpu().reshape(-1)
    half = key.numel() // 2
    moved = nb03.rerotate(key.reshape(1, 1, 1, -1), shift, theta).reshape(-1)
    inv = nb03.inverse_frequencies(key.numel(), theta)
    pairs = [0, half // 2, half - 1] if pairs is None else list(pairs)
    return [{"pair": i, "before": (float(key[i]), float(key[i + half])),
             "after": (float(moved[i]), float(moved[i + half])), "angle": float(shift * inv[i])} for i in pairs]


def fig_rope_rotation(key: torch.Tensor, position: int, shift: int, theta: float = 10000.0,
                      pairs: Sequence[int] | None = None) -> Any:
    """RoPE as a rotation: a cached key at ``position`` moved to ``position + shift``, one panel per pair."""
    rows = rotation_pairs(key, shift, theta, pairs)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.6), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        lim = 1.15 * max(math.hypot(*r["before"]), 1e-6)
        for (x, y), color, gid in ((r["before"], "C0", "before"), (r["after"], "C3", "after")):
            ax.annotate("", xy=(x, y), xytext=(0, 0), arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2})
            ax.plot([x], [y], "o", color=color, markersize=3, gid=gid)
        turned = math.degrees(r["angle"]) % 360
        ax.set_title(f"pair {r['pair']}: turned {turned:.1f}°", fontsize=9)
        ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.set_xlabel(f"dim {r['pair']}", fontsize=8)
        ax.set_ylabel(f"dim {r['pair'] + key.numel() // 2}", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"one cached key moved from position {position} (blue) to {position + shift} (red): "
                 "each pair turns by shift x its frequency; the length stays", fontsize=10)
    fig.tight_layout()
    return fig


def _int_list(answer: Any) -> list[int] | None:
    try:
        return [int(x) for x in answer]
    except (TypeError, ValueError):
        return None


def check_suffix_positions(answer: Sequence[int] | None, prefix_len: int, suffix_len: int) -> Verdict:
    """Exercise 03.1: the position ids of a suffix prefilled after a cached prefix of ``prefix_len`` tokens."""
    hint = ("the cache holds positions 0 .. prefix_len - 1, so the suffix continues where the prefix ended, "
            "one position per suffix token")
    if answer is None:
        return unanswered(hint)
    got = _int_list(answer)
    if got is None:
        return verdict(False, hint=f"give a list of position ids, not {answer!r}")
    if len(got) != suffix_len:
        return verdict(False, hint=f"one position id per suffix token: {len(got)} ids for {suffix_len} tokens")
    expected = list(range(prefix_len, prefix_len + suffix_len))
    return verdict(got == expected, f"the suffix continues at position {prefix_len}", hint)


def check_rerotation_delta(answer: int | None, start_in_a: int, start_in_b: int) -> Verdict:
    """Exercise 03.2: by how much must keys cached at ``start_in_a`` .. be rotated to serve at ``start_in_b`` ..?"""
    hint = "rotate from the position the keys were computed at to the position they are needed at; the sign matters"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of positions, not {answer!r}")
    return verdict(value == start_in_b - start_in_a, f"delta {value}: new start - old start", hint)


def check_positions_from_mask(fn: Callable[[torch.Tensor], torch.Tensor] | None) -> Verdict:
    """Exercise 03.3: ``fn(mask)`` must give each real token its index among the real tokens of its row."""
    hint = "in each row, real tokens (mask 1) count 0, 1, 2, ... and pads (mask 0) are skipped; try cumsum"
    masks = [torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), torch.tensor([[1, 1, 0, 0, 1, 1]])]
    for m in masks:
        out, failed = call_answer(fn, m, hint=hint, name="my_positions")
        if failed is not None:
            return failed
        got, want = torch.as_tensor(out), positions_from_mask(m)
        if got.shape != m.shape:
            return verdict(False, hint=f"for a mask of shape {tuple(m.shape)} return the same shape, not {tuple(got.shape)}")
        if not torch.equal(got[m.bool()].long(), want[m.bool()]):
            return verdict(False, hint=f"for mask {m.tolist()} your positions of the real tokens are "
                                       f"{got[m.bool()].tolist()}; {hint}")
    return verdict(True, "positions of real tokens count only real tokens")


def check_exact_layers(answer: Sequence[int] | None, errors: Any, tol: float = 2e-2) -> Verdict:
    """Exercise 03.4: which layers' keys are exact after re-rotation? Exact: relative error below ``tol`` (float32
    rounding ~1e-6 and 16-bit ~1e-2 pass; a key that encodes another context, ~1e-1 and more, does not)."""
    hint = ("read the re-rotated K rows of the error table: a layer is exact when its relative error is float "
            f"rounding, orders of magnitude below the other layers' (the checker's cut-off, {tol}, also lets "
            "16-bit dtypes through)")
    if answer is None:
        return unanswered(hint)
    got = _int_list(answer)
    if got is None:
        return verdict(False, hint=f"give a list of layer indices, not {answer!r}")
    d = errors[(errors["treatment"] == "A's K/V re-rotated") & (errors["tensor"] == "K")]
    worst = d.groupby("layer")["relative error"].max()
    expected = sorted(int(i) for i in worst.index if worst[i] < tol)
    return verdict(sorted(got) == expected, f"layers {expected}", hint)


# ----------------------------------------------------------------------------- build 03: RoPE for a suffix

@torch.no_grad()
def keys_before_rope(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """Layer 0's keys of ``ids`` before RoPE, (1, kv_heads, T, head_dim): at layer 0 a key depends on its token only."""
    m, device = model.model, next(model.parameters()).device
    x = m.layers[0].input_layernorm(m.embed_tokens(torch.tensor([list(ids)], device=device)))
    return m.layers[0].self_attn.k_proj(x).view(1, len(ids), -1, nb03.head_dim_of(model.config)).transpose(1, 2)


def solution_rope_suffix(k: torch.Tensor, prefix_len: int, theta: float = 10000.0) -> torch.Tensor:
    """Build 03: pair (i, i + D/2) is the complex number a + ib; turning it by φ multiplies it by e^(iφ)."""
    half, t = k.shape[-1] // 2, k.shape[-2]
    pos = torch.arange(prefix_len, prefix_len + t, dtype=torch.float64, device=k.device)  # after the cached prefix
    angle = pos[:, None] * theta ** (-2 * torch.arange(half, dtype=torch.float64, device=k.device) / k.shape[-1])
    z = torch.complex(k[..., :half].double(), k[..., half:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], -1).to(k.dtype)


def check_rope_suffix(fn: Callable[..., torch.Tensor] | None, model: Any, tokenizer: Any, n: int = 2) -> Verdict:
    """Build 03: ``fn(k, prefix_len, theta)`` must turn a suffix's layer-0 keys into the ones the model caches."""
    hint = ("the suffix continues at positions prefix_len, prefix_len + 1, ...; turn pair (i, i + head_dim/2) of a key "
            "at position p by p * theta ** (-2i / head_dim): (a, b) -> (a cos - b sin, b cos + a sin)")
    if fn is None:
        return unanswered(hint)
    theta = nb03.rope_theta(model.config)
    for ex in P.make_examples(n, "heldout", start=300, history="none"):
        ids, p = nb03.prompt_ids(tokenizer, ex)
        k = keys_before_rope(model, ids[p:])
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids], device=k.device), use_cache=True).cache.layers[0].keys[:, :, p:]
        got, failed = call_answer(fn, k.clone(), p, theta, hint=hint, name="my_rope_suffix")
        if failed is not None:
            return failed
        got = torch.as_tensor(got)
        if got.shape != want.shape:
            return verdict(False, hint=f"return the keys' shape {tuple(want.shape)}, not {tuple(got.shape)}")
        if not torch.allclose(got.to(want.dtype), want, atol=1e-4, rtol=1e-4):
            at0 = torch.allclose(got.to(want.dtype), nb03.apply_rope(k, torch.arange(len(ids) - p, device=k.device), theta),
                                 atol=1e-4, rtol=1e-4)
            return verdict(False, hint=("your keys sit at positions 0, 1, ...: the prefix already holds those; "
                                        if at0 else f"on example {ex.seed} your keys differ from the model's by up to "
                                        f"{(got - want).abs().max():.2e}; ") + hint)
    return verdict(True, f"{n} suffixes: your keys equal the ones the model caches at positions prefix_len, prefix_len + 1, ...")
