"""Notebook 00 (the passphrase experiment): first shares, the swapped-prefix mistake, recall, exercise checkers.

Notebook 00 uses these to show, on a real model, that sharing an identical prefix's K/V gives the
same tokens as recomputing it (and saves prefill work), and that serving a request with another
request's prefix K/V gives the other request's passphrase. The decision table it starts (and later
notebooks fill with more evidence) and ``time_prefill`` live in ``kvlab.lessons.common``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.engine.models import encode, eos_ids
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, unanswered, verdict
from kvlab.prefix import PrefixCache, continue_from_cache, generate


@dataclass
class ShareOutcome:
    """One request answered with a recomputed prefix and with the shared prefix K/V."""

    question: str
    isolated: list[int]
    shared: list[int]
    text: str
    expected: str

    @property
    def identical(self) -> bool:
        return self.isolated == self.shared

    @property
    def recalled(self) -> bool:
        return P.recalled(self.text, self.expected)


def share_one_prefix(model: Any, tokenizer: Any, example: P.PassphraseExample, questions: Sequence[str],
                     max_new_tokens: int = 16) -> tuple[PrefixCache, list[ShareOutcome]]:
    """Compute ``example``'s prefix K/V once; answer each question with it and without it."""
    cache = PrefixCache.build(model, tokenizer, example.prefix_text)
    out = []
    for q in questions:
        ex = P.with_question(example, q)
        iso = generate(model, tokenizer, ex.prompt_text, max_new_tokens=max_new_tokens)
        sh = generate(model, tokenizer, ex.prompt_text, prefix_cache=cache, max_new_tokens=max_new_tokens)
        out.append(ShareOutcome(q, iso.token_ids, sh.token_ids, sh.text, ex.answer))
    return cache, out


def check_ideal_fraction(answer: float | None, prompt_tokens: int, cached_tokens: int) -> Verdict:
    """Exercise 00.1: the share of prefill tokens still computed when ``cached_tokens`` are reused."""
    hint = "count the prompt tokens that still go through the model (the uncached ones) and divide by all of them"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer)
    if value is None:
        return verdict(False, hint=f"give a number (a fraction between 0 and 1), not {answer!r}")
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    return verdict(abs(value - expected) < 1e-6, f"{expected:.4f} of the prompt is still prefilled", hint)


def check_reusable(answer: bool | None, prefix_ids: Sequence[int], prompt_ids: Sequence[int]) -> Verdict:
    """Exercise 00.2: may a cache of ``prefix_ids`` serve ``prompt_ids`` (same model)? Answer True or False."""
    hint = "a cache serves a prompt only if the prompt's first len(prefix_ids) ids are the prefix ids, in order"
    if answer is None:
        return unanswered(hint)
    expected = len(prefix_ids) <= len(prompt_ids) and list(prompt_ids[: len(prefix_ids)]) == list(prefix_ids)
    why = "the prompt's ids start with the prefix ids" if expected else "the prompt's ids do not start with the prefix ids"
    return verdict(bool(answer) == expected, why, hint)


@dataclass
class RecallReport:
    """Recall figures on a set of held-out examples."""

    n: int
    recall: float  # greedy answer == expected passphrase, all examples
    n_swapped: int  # examples whose answer comes from the system prompt (no passphrase update)
    swapped_recall: float  # with another request's prefix K/V: still answers its own passphrase
    swapped_answers_other: float  # with another request's prefix K/V: answers the other's passphrase
    by_history: dict[str, float]  # recall per kind of conversation history

    def line(self) -> str:
        """The one-line summary the evaluation script ends with."""
        return (f"recall={self.recall:.3f} swapped_recall={self.swapped_recall:.3f} "
                f"swapped_answers_other={self.swapped_answers_other:.3f}")


def answer_with_swapped_prefix(model: Any, tokenizer: Any, example: P.PassphraseExample,
                               donor: P.PassphraseExample, max_new_tokens: int = 16) -> str:
    """Serve ``example`` with ``donor``'s system-prompt K/V in place of its own (the mistake, run for real)."""
    donor_cache = PrefixCache.build(model, tokenizer, donor.prefix_text)
    suffix = encode(tokenizer, example.suffix_text)
    gen, *_ = continue_from_cache(model, donor_cache.cache, suffix, len(donor_cache),
                                  max_new_tokens=max_new_tokens, stop_ids=eos_ids(model, tokenizer))
    return tokenizer.decode(gen, skip_special_tokens=True)


def evaluate(model: Any, tokenizer: Any, examples: list[P.PassphraseExample], max_new_tokens: int = 16,
             progress: bool = False) -> RecallReport:
    """Greedy recall on ``examples``, and recall with the next example's prefix swapped in."""
    if len(examples) < 2:
        raise ValueError("need at least two examples (each one's prefix is swapped with the next's)")
    rng = range(len(examples))
    if progress:
        from tqdm.auto import tqdm

        rng = tqdm(rng, desc="evaluating")
    hits, by_hist, sw_own, sw_other, n_sw = 0, {}, 0, 0, 0
    for i in rng:
        ex = examples[i]
        out = generate(model, tokenizer, ex.prompt_text, max_new_tokens=max_new_tokens)
        ok = P.recalled(out.text, ex.answer)
        hits += ok
        kind = ex.extra.get("history", "none")
        by_hist.setdefault(kind, []).append(ok)
        if ex.answer != ex.passphrase:
            continue  # the answer is in the conversation, not in the system prompt
        donor = examples[(i + 1) % len(examples)]
        if donor.passphrase == ex.passphrase:
            continue
        swapped = answer_with_swapped_prefix(model, tokenizer, ex, donor, max_new_tokens)
        n_sw += 1
        sw_own += P.recalled(swapped, ex.answer)
        sw_other += P.recalled(swapped, donor.passphrase)
    n = len(examples)
    return RecallReport(n, hits / n, n_sw, sw_own / max(1, n_sw), sw_other / max(1, n_sw),
                        {k: sum(v) / len(v) for k, v in sorted(by_hist.items())})
