"""The passphrase experiment's building blocks: the decision table, timing, and first shares.

Notebook 00 uses these to show, on a real model, that sharing an identical prefix's K/V gives the
same tokens as recomputing it (and saves prefill work), and that serving a request with another
request's prefix K/V gives the other request's passphrase. Later notebooks fill the decision table
with more evidence.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlab import passphrase as P
from kvlab.prefix import PrefixCache, generate

# The article's section 2.4 decision framework: (condition, shareable?, isolate?) as it states them.
# Each notebook adds evidence (what it measured) next to the rows it tests.
DECISION_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("prefix token sequences are identical", "前缀token序列完全一致", "yes", "no"),
    ("the prefix starts at the same position", "前缀起始位置相同", "yes", "no"),
    ("later generation does not modify shared blocks", "后续生成不修改共享块", "yes", "no"),
    ("position encodings agree", "位置编码一致", "yes", "no"),
    ("later contexts of the requests are independent", "不同请求的后续上下文独立", "yes", "no"),
    ("shared blocks may be written", "共享块可能被写入", "no", "yes"),
    ("prefixes overlap partly but start differently", "前缀有部分重叠但起始不同", "no", "yes"),
    ("requests must be fully isolated", "需要保证请求间完全隔离", "no", "yes"),
)


def decision_table(evidence: dict[int, str] | None = None):
    """The article's decision table as a DataFrame, with an ``evidence`` column (row index -> text)."""
    import pandas as pd

    evidence = evidence or {}
    rows = [{"condition": en, "article (zh)": zh, "share?": s, "isolate?": i, "evidence (measured here)": evidence.get(k, "")}
            for k, (en, zh, s, i) in enumerate(DECISION_ROWS)]
    return pd.DataFrame(rows)


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def check_ideal_fraction(answer: float, prompt_tokens: int, cached_tokens: int) -> bool:
    """Exercise checker: the share of prefill tokens still computed when ``cached_tokens`` are reused."""
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    ok = abs(float(answer) - expected) < 1e-6
    print("correct" if ok else f"not quite: {prompt_tokens - cached_tokens} of {prompt_tokens} tokens are still computed")
    return ok


def check_reusable(answer: bool, prefix_ids: Sequence[int], prompt_ids: Sequence[int]) -> bool:
    """Exercise checker: may a cache of ``prefix_ids`` serve ``prompt_ids`` (same model)?"""
    expected = len(prefix_ids) <= len(prompt_ids) and list(prompt_ids[: len(prefix_ids)]) == list(prefix_ids)
    ok = bool(answer) == expected
    print("correct" if ok else ("not quite: the ids " + ("do" if expected else "do not") + " start with the prefix ids"))
    return ok
