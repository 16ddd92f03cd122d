"""Score a model on the passphrase task: greedy recall, and recall when a wrong prefix K/V is swapped in.

The swapped case is the series' central mistake in its plainest form: request B is served with the
cached K/V of request A's system prompt (as a cache keyed on the wrong thing would do). A model
that answers from its context then recalls A's passphrase, not B's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab import passphrase as P
from kvlab.prefix import PrefixCache, continue_from_cache, encode, eos_ids, generate


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
