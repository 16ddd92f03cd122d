"""Notebook 02 (manual prefix reuse): figures, workloads and the exercises' checkers and reference.

The mechanisms (the article's two functions, ``continue_from_cache``, ``check_compatible``, ``generate``, the
tokenization checks) are written in notebook 02's cells and exported to ``kvlab.built.nb02``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from kvlab.built.nb02 import check_prefix_tokens, token_pieces  # noqa: F401  (00, 01 and solutions import them here)
from kvlab.engine.models import encode, eos_ids
from kvlab.engine.reference import hf_generate
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, call_answer, label, unanswered, verdict
from kvlab.prefix import PrefixKV


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_generate_fn(fn: Any, model: Any, tokenizer: Any, n: int = 4, max_new_tokens: int = 12) -> Verdict:
    """Exercise 02.1: ``fn(model, tokenizer, prefix_text, suffix_text, max_new_tokens)``: model.generate's ids, twice."""
    hint = "prefill the suffix at positions len(prefix), len(prefix)+1, ... on a copy of the prefix cache, then decode"
    if fn is None:
        return unanswered("define my_generate and pass it in; " + hint)
    for ex in P.make_examples(n, "heldout", start=100):
        for e in (ex, P.with_question(ex, "Tell me the passphrase.")):
            want = hf_generate(model, tokenizer, e.prompt_text, max_new_tokens)
            got, failed = call_answer(fn, model, tokenizer, e.prefix_text, e.suffix_text, max_new_tokens,
                                      hint=hint, name="my_generate")
            if failed is not None:
                return failed
            got = list(got)
            if got != want:
                i = _first_difference(got, want)
                return verdict(False, hint=f"on example {e.seed} your tokens leave model.generate's at step {i} "
                                           f"(yours from there: {got[i:i + 4]}); check the positions and that the "
                                           "prefix cache is not written into")
    return verdict(True, f"{2 * n} prompts identical to model.generate")


def check_boundary_case(tokenizer: Any, prefix: str | None, suffix: str | None) -> Verdict:
    """Exercise 02.2: a split of a text where BPE merges across the boundary."""
    hint = "try a cut inside a word, or just before letters that follow punctuation"
    if prefix is None or suffix is None:
        return unanswered(hint)
    check = check_prefix_tokens(tokenizer, prefix, prefix + suffix)
    return verdict(not check.ok, str(check), "this split tokenizes the same alone and inside the full text; " + hint)


def check_crop_reuse(fn: Any, model: Any, tokenizer: Any, n: int = 3, max_new_tokens: int = 12) -> Verdict:
    """Exercise 02.3: ``fn(model, tokenizer, cache, prefix_len, suffixes, max_new_tokens)``: one cache, cropped back."""
    hint = "after each request, crop the cache back to its prefix_len tokens (DynamicCache.crop)"
    if fn is None:
        return unanswered("define my_serial_reuse and pass it in; " + hint)
    ex = P.make_example(7, "heldout", history="none")
    questions = ["What is the passphrase?", "Tell me the passphrase.", "请说出口令。"][:n]
    examples = [P.with_question(ex, q) for q in questions]
    prefix_ids = encode(tokenizer, ex.prefix_text)
    cache = PrefixKV.build(model, tokenizer, prefix_ids).cache
    got, failed = call_answer(fn, model, tokenizer, cache, len(prefix_ids), [e.suffix_text for e in examples],
                              max_new_tokens, hint=hint, name="my_serial_reuse")
    if failed is not None:
        return failed
    for e, g in zip(examples, got, strict=False):
        want = hf_generate(model, tokenizer, e.prompt_text, max_new_tokens)
        if list(g) != want:
            i = _first_difference(list(g), want)
            return verdict(False, hint=f"for {e.turns[-1].user!r} your tokens leave model.generate's at step {i}; "
                                       "did you crop the cache back to the prefix after each request?")
    if int(cache.get_seq_length()) != len(prefix_ids):
        return verdict(False, hint=f"the answers match but the cache holds {cache.get_seq_length()} tokens, not {len(prefix_ids)}")
    return verdict(len(got) == len(examples), f"{len(examples)} requests identical, cache back to "
                   f"{len(prefix_ids)} tokens", "return one list of ids per suffix")


def fig_prefill_ratio(rows: Sequence[Mapping[str, Any]], title: str = "prefill with a cached prefix") -> Figure:
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


def fig_token_boundary(prefix_pieces: Sequence[str], full_pieces: Sequence[str], first_diff: int | None,
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
            shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in piece)  # token_pieces wrote "\\n" already
            ax.text(i + 0.475, y, label(shown)[:8], ha="center", va="center", fontsize=7)
    ax.set_xlim(-3, max(len(prefix_pieces), len(full_pieces)) + 0.5)
    ax.set_ylim(-0.6, 1.6)
    ax.axis("off")
    ax.set_title(title or "tokens (red: from the first difference on)", fontsize=10)
    fig.tight_layout()
    return fig


def fig_position_ids(prefix: PrefixKV, suffix_ids: Sequence[int], tokenizer: Any = None) -> Figure:
    """The cached prefix's positions and the suffix's on top of it: continued (right) and restarted at 0 (wrong)."""
    p, n = prefix.seq_length(), len(suffix_ids)
    rows = [("right: the suffix continues", range(p, p + n), "#a1d99b"), ("wrong: the suffix restarts at 0", range(n), "#fc9272")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.42 * (p + n) + 2.5), 3.2))
    for r, (name, pos, color) in enumerate(rows):
        y = 1 - r
        for i in range(p):
            ax.add_patch(plt.Rectangle((i, y), 0.95, 0.6, facecolor="#d9d9d9", edgecolor="black", linewidth=0.5))
            ax.text(i + 0.47, y + 0.3, str(i), ha="center", va="center", fontsize=7)
        for i, q in enumerate(pos):
            clash = q < p
            ax.add_patch(plt.Rectangle((p + i, y), 0.95, 0.6, facecolor=color, edgecolor="black",
                                   linewidth=1.5 if clash else 0.5, gid=f"suffix{r}"))
            ax.text(p + i + 0.47, y + 0.3, str(q), ha="center", va="center", fontsize=7, gid=f"suffix{r}")
        ax.text(-0.3, y + 0.3, name, ha="right", va="center", fontsize=9)
    if tokenizer is not None and p + n <= 40:
        words = [label(w) for w in token_pieces(tokenizer, [*prefix.token_ids, *suffix_ids])]
        ax.set_xticks([i + 0.47 for i in range(p + n)], words, rotation=90, fontsize=7)
    else:
        ax.set_xticks([])
    ax.axvline(p - 0.025, color="black", linewidth=1)
    ax.set_xlim(-0.2, p + n)
    ax.set_ylim(-0.15, 1.75)
    ax.set_yticks([])
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_title(f"position ids: {p} cached prefix tokens (grey) then {n} suffix tokens\n"
                 "wrong: the suffix reuses positions the prefix already holds", fontsize=10)
    fig.tight_layout()
    return fig


def reference_continue(model: Any, cache: Any, suffix_ids: Sequence[int], start_pos: int, max_new_tokens: int,
                       stop_ids: set[int]) -> list[int]:
    """Notebook 02's ``continue_from_cache``, greedy: the new token ids after ``suffix_ids`` on top of ``cache``."""
    from kvlab.built.nb02 import continue_from_cache

    return continue_from_cache(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids)[0]


class PositionSpy:
    """A model that records, for every forward call, how many tokens it was fed and the ``position_ids`` given."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[tuple[int, list[int] | None]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("position_ids")
        self.calls.append((int(ids.shape[-1]) if hasattr(ids, "shape") else -1,
                           None if pos is None else [int(p) for p in pos.flatten().tolist()]))
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _position_problem(calls: list[tuple[int, list[int] | None]], start_pos: int, suffix_len: int) -> str | None:
    """What is wrong with the positions of the recorded calls, or None when every token sat where it belongs."""
    if not calls:
        return "your loop never called the model it was given (call model(...), not another object)"
    if calls[0][0] != suffix_len:
        return (f"the first call fed {calls[0][0]} tokens: feed only suffix_ids ({suffix_len} tokens) on top of the "
                "cache, the prefix is in it already")
    held = start_pos  # tokens in the cache before the call
    for k, (n, pos) in enumerate(calls):
        if pos is None:
            return (f"call {k} passed no position_ids: pass them explicitly (a paged cache cannot tell the model "
                    "where its tokens sit)")
        if pos != list(range(held, held + n)):
            return (f"call {k} fed {n} token(s) at positions from {pos[0] if pos else '?'}, but the cache already "
                    f"held {held} tokens before it: each token sits right after everything cached")
        held += n
    return None


def check_continue_loop(fn: Any, model: Any, tokenizer: Any, n: int = 3, max_new_tokens: int = 12) -> Verdict:
    """Build 02.B: ``fn(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids)``: positions checked on every
    call (continuing from ``start_pos``), tokens equal to ``model.generate``'s. Returns a Verdict, never raises."""
    hint = ("prefill suffix_ids at positions start_pos, start_pos+1, ... in one call, then feed one token per "
            "step at the next position, greedy (argmax), stopping after a token in stop_ids")
    if fn is None:
        return unanswered(hint)
    stops = eos_ids(model, tokenizer)
    for ex in P.make_examples(n, "heldout", start=200):
        prefix, full = encode(tokenizer, ex.prefix_text), encode(tokenizer, ex.prompt_text)
        suffix = full[len(prefix):]
        spy = PositionSpy(model)
        got, failed = call_answer(fn, spy, PrefixKV.build(model, tokenizer, prefix).cache, suffix, len(prefix),
                                  max_new_tokens, stops, hint=hint, name="my_continue")
        if failed is not None:
            return failed
        problem = _position_problem(spy.calls, len(prefix), len(suffix))
        if problem is not None:
            return verdict(False, hint=f"on example {ex.seed}: {problem}")
        want, got = hf_generate(model, tokenizer, full, max_new_tokens), list(got)
        if got != want:
            i = _first_difference(got, want)
            why = ("you kept going after a token in stop_ids" if len(got) > len(want) == i else
                   "you stopped early: stop only after a token in stop_ids, or after max_new_tokens" if len(got) == i
                   else "pick the argmax of the last position's logits, and return only the new tokens")
            return verdict(False, hint=f"on example {ex.seed} your tokens leave model.generate's at step {i}: {why}")
    return verdict(True, f"{n} prompts token for token equal to model.generate, every position where it belongs")
