"""Notebook 06 (vLLM side by side): exercise checkers, whether vLLM is there, and the record of the
last run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvlab.lessons.common import Verdict, check_number, record_files, unanswered, verdict
from kvlab.vllm.bridge import VllmNotFoundError, run_kvlab, vllm_python

# the last comparison with vLLM, relative to the repository root
RECORD = "build/vllm/nb06_last.json"
save_record, load_record = record_files(RECORD)


def vllm_found(python: Any = None) -> tuple[bool, str]:
    """Whether a vLLM interpreter is there, WITHOUT importing vLLM (tens of seconds)."""
    if os.environ.get("KVLAB_SKIP_VLLM") == "1":
        return False, "vLLM skipped: KVLAB_SKIP_VLLM=1 is set (unset it to use the vLLM venv)"
    try:
        path = vllm_python(python)
    except VllmNotFoundError as e:
        return False, str(e)
    return (True,
            f"a vLLM interpreter is at {path} (vLLM itself is imported once, by the worker in "
            "section 2)")


def check_cached_tokens(answer: int | None, prompt_tokens: int, shared_tokens: int,
                        block_size: int = 32) -> Verdict:
    """Exercise 06.1: the ``num_cached_tokens`` both engines report for a prompt sharing
    ``shared_tokens`` with a cached one."""
    expected = min(shared_tokens, prompt_tokens - 1) // block_size * block_size
    return check_number(answer, expected,
                        f"{expected}: whole blocks of the shared part, never the last prompt token",
                        "count only whole blocks of the shared tokens, and the last prompt token "
                        "is always recomputed", int)


def check_ttft_ideal(answer: float | None, prompt_tokens: int, cached_tokens: int,
                     tol: float = 0.01) -> Verdict:
    """Exercise 06.2: the ideal TTFT ratio cached/uncached when prefill cost is proportional to
    computed tokens."""
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    return check_number(answer, expected,
                        f"{expected:.3f}: the share of prompt tokens still computed",
                        "divide the tokens that still need a forward pass by all prompt tokens",
                        tol=tol)


def check_batch_counts(answer: bool | None, model: Any, tokenizer: Any,
                       prompts: Sequence[Sequence[int]],
                       sequential: dict, block_size: int = 32, max_tokens: int = 4) -> Verdict:
    """Exercise 06.3: do all-at-once arrivals get the same ``num_cached_tokens`` as one-at-a-time
    ones? (runs kvlab)"""
    hint = ("run it: VB.run_kvlab(model, tok, prompts, 32, 4, arrival='batch', "
            "repeat=False)['num_cached_tokens'] against ours['num_cached_tokens'], and think about "
            "when a block is registered under its hash")
    if answer is None:
        return unanswered(hint)
    if not isinstance(answer, bool):
        return verdict(False, hint=f"answer True or False, not {answer!r}")
    batch = run_kvlab(model, tokenizer, prompts, block_size, max_tokens, arrival="batch",
                      repeat=False)
    same = batch["num_cached_tokens"] == list(sequential["num_cached_tokens"])
    why = ("a block is registered under its hash when it is allocated, before its K/V is computed; "
           "a request in the same step may use it because each layer writes every new token's K/V "
           "before attention reads them"
           if same else "requests in one step did not see each other's blocks here")
    return verdict(answer is same, f"{same}: {why}", hint)
