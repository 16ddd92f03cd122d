"""Notebook 02's checkers, runners (equality, pollution, tokenization) and figures; its cells write
the article's code (``kvlab.built.nb02``), the reader the continue loop; the checked, forking loop
is ``kvlab.prefix``'s."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from tokenizers.processors import TemplateProcessing

from kvlab.built.nb02 import generate_with_prefix_cache, get_prefix_cache
from kvlab.engine.models import encode, eos_ids
from kvlab.engine.reference import hf_generate
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, call_answer, label, unanswered, verdict
from kvlab.prefix import PrefixKV, compare_with_hf

# ----------------------------------------------------------------------------- tokens as text


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed: the character a token string uses -> the byte it
    stands for."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs + extra, bs + [256 + i for i in range(len(extra))])}


_BYTES = _byte_decoder()


def _utf8_length(lead: int) -> int:
    return (1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14
            else 4 if lead >> 3 == 30 else 1)


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token as the text it stands for ("\\n" for a newline); a partial CJK character shows
    whole, "…" on the side it continues ("翻…" then "…译"); only bytes that decode to nothing
    show as hex ("<e4>")."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    spans: list[tuple[int, int] | None] = []
    stream = b""
    for t in map(int, ids):
        raw = tokenizer.convert_ids_to_tokens(t)
        if t in special or not raw or not all(ch in _BYTES for ch in raw):
            # a special token, or not a byte-level vocabulary: decoded alone below
            spans.append(None)
            continue
        data = bytes(_BYTES[ch] for ch in raw)
        spans.append((len(stream), len(stream) + len(data)))
        stream += data
    chars, i = [], 0  # (first byte, end byte, text) of each character of the stream
    while i < len(stream):
        n = _utf8_length(stream[i])
        try:
            text = stream[i:i + n].decode("utf-8")
        except UnicodeDecodeError:
            # a character the ids stop inside of continues past them ("…"); other bad bytes show as
            # hex
            cut = i + n > len(stream)
            text, n = ("…", len(stream) - i) if cut else (f"<{stream[i]:02x}>", 1)
        chars.append((i, i + n, text))
        i += n
    pieces = []
    for t, span in zip(map(int, ids), spans):
        if span is None:
            text = tokenizer.decode([t])
        else:
            inside = [c for c in chars if c[0] < span[1] and c[1] > span[0]]
            text = ("…" * (bool(inside) and inside[0][0] < span[0]) + "".join(c[2] for c in inside)
                    + "…" * (bool(inside) and inside[-1][1] > span[1]))
        pieces.append(text.replace("\n", "\\n"))
    return pieces


@dataclass
class TokenCheck:
    """Is a prefix, tokenized alone, the start of the full text's tokens? Where do they part?"""

    ok: bool
    prefix_ids: list
    full_ids: list
    first_diff: int | None  # the first token index where they differ (None when ok)
    prefix_around: list  # the tokens around first_diff, the prefix tokenized alone
    full_around: list  # the same positions, the full text tokenized

    def __str__(self) -> str:
        if self.ok:
            return (f"ok: the prefix's {len(self.prefix_ids)} tokens are the first tokens of the "
                    "full text")
        return (f"mismatch at token {self.first_diff} of {len(self.prefix_ids)}: "
                f"prefix alone {self.prefix_around} vs inside the full text {self.full_around}")


def check_prefix_tokens(tokenizer: Any, prefix: Any, full: Any, context: int = 2) -> TokenCheck:
    """Compare ``prefix`` tokenized alone with the start of ``full`` (texts or ids)."""
    p, f = encode(tokenizer, prefix), encode(tokenizer, full)
    first = next((i for i, (a, b) in enumerate(zip(p, f)) if a != b),
                 len(f) if len(p) > len(f) else None)
    if first is None:
        return TokenCheck(True, p, f, None, [], [])
    lo, hi = max(0, first - context), first + context + 1
    return TokenCheck(False, p, f, first, token_pieces(tokenizer, p)[lo:hi],
                      token_pieces(tokenizer, f)[lo:hi])


def boundary_merge_cases(tokenizer: Any, texts: Sequence[str],
                         limit: int = 10) -> list[tuple[str, str, TokenCheck]]:
    """Up to ``limit`` (prefix, suffix, check) cuts of ``texts`` where BPE merges across the cut
    (distinct merges)."""
    cases, seen = [], set()
    specials = set(tokenizer.all_special_tokens) | {t.content for t in
                                                    tokenizer.added_tokens_decoder.values()}
    for text in texts:
        full_ids = encode(tokenizer, text)
        inside = {i for s in specials for j in range(len(text)) if text.startswith(s, j)
                  for i in range(j + 1, j + len(s))}
        for cut in range(1, len(text)):
            if cut in inside:  # never halve a special token
                continue
            check = check_prefix_tokens(tokenizer, text[:cut], full_ids)
            if not check.ok and tuple(check.full_around) not in seen:
                seen.add(tuple(check.full_around))
                cases.append((text[:cut], text[cut:], check))
                if len(cases) >= limit:
                    return cases
    return cases


def with_bos_tokenizer(tokenizer: Any, bos: str = "<|endoftext|>") -> Any:
    """A copy of a fast tokenizer that, like Llama's, prepends ``bos`` when
    add_special_tokens=True."""
    tok = copy.deepcopy(tokenizer)
    bos_id = tok.convert_tokens_to_ids(bos)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A",
                                                              pair=f"{bos} $A $B",
                                                              special_tokens=[(bos, bos_id)])
    return tok


# ----------------------------------------------------------------------------- experiment runners


def loop_equals_generate(model: Any, tokenizer: Any, n_greedy: int, n_sampled: int = 0,
                         seed: int = 0,
                         max_new_tokens: int = 16, chat: bool = False,
                         start: int = 0) -> pd.DataFrame:
    """``kvlab.prefix.generate`` on a cached system prompt against ``model.generate`` (greedy, then
    seeded sampling): ``compare_with_hf``'s rows; ``chat``: the model's own chat template
    (SmolLM2)."""
    examples = P.make_examples(max(n_greedy, n_sampled), "heldout", start=start)
    if chat:
        prompts = [P.real_model_prompt(tokenizer, e, P.REAL_QUESTIONS[i % len(P.REAL_QUESTIONS)])
                   for i, e in enumerate(examples)]
        prefixes = [tokenizer.apply_chat_template(P.real_model_messages(e)[:1], tokenize=False)
                    for e in examples]
    else:
        prompts, prefixes = [e.prompt_text for e in examples], [e.prefix_text for e in examples]
    frames = []
    for name, n, sampling in (("greedy", n_greedy, {}),
                              ("seeded sampling", n_sampled,
                               dict(do_sample=True, temperature=0.8, top_p=0.9,
                                                                  top_k=50, seed=seed))):
        if n:
            rows = compare_with_hf(model, tokenizer, prompts[:n], prefixes[:n], max_new_tokens,
                                   **sampling)
            frames.append(pd.DataFrame(rows).assign(decoding=name))
    return pd.concat(frames, ignore_index=True)


def equality_sentence(name: str, rows: pd.DataFrame) -> str:
    """One printed line on ``loop_equals_generate``'s rows: identical answers (empty ones apart),
    logit difference."""
    said = rows[rows.hf.str.strip() != ""]  # an empty answer compares one end-of-turn token only
    worst = rows.max_abs_logit_diff.max()
    return (f"{name}: {int(said.identical.sum())}/{len(said)} non-empty answers token-identical to "
            f"model.generate ({len(rows) - len(said)} empty on both sides, not counted; "
            f"{int(rows.new_tokens.sum())} new tokens compared), {rows.cached_tokens.mean():.0f} "
            f"of {rows.prompt_tokens.mean():.0f} prompt tokens cached on average, largest logit "
            f"difference {worst:.1e} "
            + ("(float32 rounding)" if worst < 1e-3
               else "(more than float32 rounding: look at the rows)"))


def pollution_pairs(model: Any, tokenizer: Any, n: int, start: int = 0,
                    max_new_tokens: int = 16) -> pd.DataFrame:
    """Request A (its history changes the passphrase) then B on ONE cache through the article's
    code; B also isolated. One row per pair: the answers, what each expected, and the cache's length
    after each request."""
    rows = []
    for seed in range(start, start + n):
        a = P.make_example(seed, "heldout", history="update")
        b = P.with_question(P.make_example(seed, "heldout", history="none"),
                            "What is the passphrase?")
        cache, plen = get_prefix_cache(model, tokenizer, a.prefix_text)
        a_ids = generate_with_prefix_cache(model, tokenizer, cache, plen, a.suffix_text,
                                           max_new_tokens)
        after_a = int(cache.get_seq_length())
        b_ids = generate_with_prefix_cache(model, tokenizer, cache, plen, b.suffix_text,
                                           max_new_tokens)
        answer = lambda ids: P.normalize_answer(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
        rows.append({"prefix tokens": plen, "cache after A": after_a,
                     "cache after B": int(cache.get_seq_length()),
                     "A answered": answer(a_ids), "A expected": a.answer, "B expected": b.answer,
                     "B on A's cache": answer(b_ids),
                     "B isolated": answer(hf_generate(model, tokenizer, b.prompt_text,
                                                      max_new_tokens))})
    return pd.DataFrame(rows)


def pollution_sentence(pairs: pd.DataFrame) -> str:
    """One printed line on ``pollution_pairs``: how often B kept its own passphrase, gave A's, or
    changed."""
    own = np.mean([P.recalled(x, e) for x, e in zip(pairs["B on A's cache"], pairs["B expected"])])
    alone = np.mean([P.recalled(x, e) for x, e in zip(pairs["B isolated"], pairs["B expected"])])
    took = np.mean([P.recalled(x, e) for x, e in zip(pairs["B on A's cache"], pairs["A expected"])])
    changed = (pairs["B on A's cache"] != pairs["B isolated"]).mean()
    grew = (pairs["cache after B"] - pairs["prefix tokens"]).mean()
    return (f"{len(pairs)} pairs on one shared cache: B's answer changed in {changed:.0%}; B gave "
            f"its own passphrase {own:.0%} of the time (isolated: {alone:.0%}) and A's new one "
            f"{took:.0%}; the cache grew by {grew:.0f} tokens on average")


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_boundary_case(tokenizer: Any, prefix: str | None, suffix: str | None) -> Verdict:
    """Exercise 02.2: a split of a text where BPE merges across the boundary."""
    hint = "try a cut inside a word, or just before letters that follow punctuation"
    if prefix is None or suffix is None:
        return unanswered(hint)
    check = check_prefix_tokens(tokenizer, prefix, prefix + suffix)
    return verdict(not check.ok, str(check),
                   "this split tokenizes the same alone and inside the full text; " + hint)


def fig_token_boundary(prefix_pieces: Sequence[str], full_pieces: Sequence[str],
                       first_diff: int | None,
                       title: str = "") -> Figure:
    """Two rows of token boxes: the prefix tokenized alone and the full text; the first difference
    in red."""
    fig, ax = plt.subplots(figsize=(10, 1.8))
    for row, (row_name, pieces) in enumerate((("prefix alone", prefix_pieces),
                                              ("full text", full_pieces))):
        y = 1 - row
        ax.text(-0.2, y, row_name, ha="right", va="center", fontsize=9)
        for i, piece in enumerate(pieces):
            bad = first_diff is not None and i >= first_diff
            ax.add_patch(plt.Rectangle((i, y - 0.35), 0.95, 0.7,
                                       facecolor="#fcbba1" if bad else "#c6dbef",
                                       edgecolor="gray"))
            # token_pieces wrote "\\n" already
            shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in piece)
            ax.text(i + 0.475, y, label(shown)[:8], ha="center", va="center", fontsize=7)
    ax.set_xlim(-3, max(len(prefix_pieces), len(full_pieces)) + 0.5)
    ax.set_ylim(-0.6, 1.6)
    ax.axis("off")
    ax.set_title(title or "tokens (red: from the first difference on)", fontsize=10)
    fig.tight_layout()
    return fig


def fig_position_ids(prefix: PrefixKV, suffix_ids: Sequence[int], tokenizer: Any = None) -> Figure:
    """The cached prefix's positions and the suffix's on top of it: continued (right) and restarted
    at 0 (wrong)."""
    p, n = prefix.seq_length(), len(suffix_ids)
    rows = [("right: the suffix continues", range(p, p + n), "#a1d99b"),
            ("wrong: the suffix restarts at 0", range(n), "#fc9272")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.42 * (p + n) + 2.5), 3.4))
    for r, (name, pos, color) in enumerate(rows):
        y = 1 - r
        for i in range(p):
            ax.add_patch(plt.Rectangle((i, y), 0.95, 0.6, facecolor="#d9d9d9", edgecolor="black",
                                       linewidth=0.5))
            ax.text(i + 0.47, y + 0.3, str(i), ha="center", va="center", fontsize=7)
        for i, q in enumerate(pos):
            clash = q < p
            ax.add_patch(plt.Rectangle((p + i, y), 0.95, 0.6, facecolor=color, edgecolor="black",
                                   linewidth=1.5 if clash else 0.5, gid=f"suffix{r}"))
            ax.text(p + i + 0.47, y + 0.3, str(q), ha="center", va="center", fontsize=7,
                    gid=f"suffix{r}")
        ax.text(-0.3, y + 0.3, name, ha="right", va="center", fontsize=9)
    # each box's token, decoded (a split character shows as "翻…", "…译")
    if tokenizer is not None and p + n <= 40:
        for i, w in enumerate(token_pieces(tokenizer, [*prefix.token_ids, *suffix_ids])):
            ax.text(i + 0.47, 1.75 + 0.15 * (i % 2), label(w), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([])
    ax.axvline(p - 0.025, color="black", linewidth=1)
    ax.set_xlim(-0.2, p + n)
    ax.set_ylim(-0.15, 2.2)
    ax.set_yticks([])
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_title(f"position ids: {p} cached prefix tokens (grey) then {n} suffix tokens\n"
                 "wrong: the suffix reuses positions the prefix already holds", fontsize=10)
    fig.tight_layout()
    return fig


class PositionSpy:
    """A model that records, for every forward call, how many tokens it was fed and the
    ``position_ids`` given."""

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


def _position_problem(calls: list[tuple[int, list[int] | None]], start_pos: int,
                      suffix_len: int) -> str | None:
    """What is wrong with the positions of the recorded calls, or None when every token sat where it
    belongs."""
    if not calls:
        return "your loop never called the model it was given (call model(...), not another object)"
    if calls[0][0] != suffix_len:
        return (f"the first call fed {calls[0][0]} tokens: feed only suffix_ids ({suffix_len} "
                "tokens) on top of the cache, the prefix is in it already")
    held = start_pos  # tokens in the cache before the call
    for k, (n, pos) in enumerate(calls):
        if pos is None:
            return (f"call {k} passed no position_ids: pass them explicitly (a paged cache cannot "
                    "tell the model where its tokens sit)")
        if pos != list(range(held, held + n)):
            return (f"call {k} fed {n} token(s) at positions from {pos[0] if pos else '?'}, but "
                    f"the cache already held {held} tokens before it: each token sits right after "
                    "everything cached")
        held += n
    return None


def check_continue_loop(fn: Any, model: Any, tokenizer: Any, n: int = 3,
                        max_new_tokens: int = 12) -> Verdict:
    """Build 02.B: ``fn(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids)``: positions
    checked on every call (continuing from ``start_pos``), tokens equal to ``model.generate``'s.
    Returns a Verdict, never raises."""
    hint = ("prefill suffix_ids at positions start_pos, start_pos+1, ... in one call, then feed "
            "one token per step at the next position, greedy (argmax), stopping after a token in "
            "stop_ids")
    if fn is None:
        return unanswered(hint)
    stops = eos_ids(model, tokenizer)
    for ex in P.make_examples(n, "heldout", start=200):
        prefix, full = encode(tokenizer, ex.prefix_text), encode(tokenizer, ex.prompt_text)
        suffix = full[len(prefix):]
        spy = PositionSpy(model)
        got, failed = call_answer(fn, spy, PrefixKV.build(model, tokenizer, prefix).cache, suffix,
                                  len(prefix),
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
                   "you stopped early: stop only after a token in stop_ids, or after max_new_tokens"
                   if len(got) == i
                   else "pick the argmax of the last position's logits, and return only the new "
                        "tokens")
            return verdict(False,
                           hint=f"on example {ex.seed} your tokens leave model.generate's at step "
                                f"{i}: {why}")
    return verdict(True,
                   f"{n} prompts token for token equal to model.generate, every position where it "
                   "belongs")
