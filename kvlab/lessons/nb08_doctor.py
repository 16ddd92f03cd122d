"""Notebook 08: why is my hit rate low? The notebook's log (a workload) and the exercise
checkers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlab.cache import DEFAULT_BLOCK_SIZE
from kvlab.doctor.logio import read_log
from kvlab.doctor.prepare import prepare
from kvlab.doctor.replay import replay_tokens
from kvlab.doctor.report import fig_divergence, fig_hit_rates, pct  # noqa: F401  (re-exported)
from kvlab.doctor.sample_log import make_log
from kvlab.doctor.tokenization import PromptEncoder, tokstr
from kvlab.lessons import common  # noqa: F401  (registers the CJK font for the doctor's figures)


def notebook_log(smoke: bool, seed: int = 0) -> tuple[list[dict], Any]:
    """The notebook's log: a help desk and a coding assistant, short enough for the bundled model's
    1,024 positions."""
    return make_log(support_conversations=60 if smoke else 330,
                    coding_conversations=20 if smoke else 110,
                    users=30 if smoke else 120, doc_sentences=1, rules=4, tools=4, seed=seed)


def _say(ok: bool, good: str, hint: str) -> bool:
    print(("correct: " + good) if ok else ("not yet: " + hint))
    return ok


def check_fix(my_fix: Callable[[list[dict]], list[dict]] | None, smoke: bool = True) -> bool:
    """Exercise 1: ``my_fix(messages)`` keeps every line of a support request but makes its system
    prompt shareable."""
    hint = ("write my_fix(messages) that returns new messages where the line starting 'Current "
            "time:' has left the system message and sits in the last user message; keep every "
            "other line where it is")
    if my_fix is None:
        return _say(False, "", hint)
    log, _ = make_log(support_conversations=40, coding_conversations=0, users=12, doc_sentences=1,
                      rules=4, seed=7)
    recs, _ = read_log(log)
    enc = PromptEncoder()
    fixed = []
    for r in recs:
        try:
            out = my_fix([dict(m) for m in r.messages])
        except Exception as e:  # the reader's code: report, do not raise
            return _say(False, "", f"my_fix raised {type(e).__name__}: {e}")
        if not isinstance(out, list) or not all(isinstance(m, dict) and "role" in m
                                                and "content" in m for m in out):
            return _say(False, "",
                        "my_fix must return a list of {'role': ..., 'content': ...} dicts")
        lines_in = sorted(x.strip() for m in r.messages for x in m["content"].split("\n")
                          if x.strip())
        lines_out = sorted(x.strip() for m in out for x in m["content"].split("\n") if x.strip())
        if lines_in != lines_out:
            return _say(False, "",
                        "some line was lost, changed or duplicated: move the line, do not edit it")
        fixed.append(r.replace(messages=out))
    got = replay_tokens(prepare(fixed, enc).tokens, 16).hit_rate
    from kvlab.doctor.culprits import FieldPattern, move_fields

    ref = replay_tokens(prepare(move_fields(recs, [FieldPattern("system", 0, "Current time: ",
                                                                "prefix", "line", "")]),
                                enc).tokens, 16).hit_rate
    base = replay_tokens(prepare(recs, enc).tokens, 16).hit_rate
    if got >= 0.95 * ref:
        return _say(True,
                    f"your fix takes this small log from {pct(base)} to {pct(got)} (the doctor's: "
                    f"{pct(ref)})", hint)
    return _say(False, "",
                f"your fixed log hits {pct(got)} of the prompt tokens, the log as logged "
                f"{pct(base)}: the system prompts still differ somewhere before the shared "
                "rules. " + hint)


def check_identical_rate(answer: float | None, requests: int = 50, tokens: int = 100,
                         block_size: int = DEFAULT_BLOCK_SIZE) -> bool:
    """Exercise 2: the unbounded hit rate of ``requests`` identical prompts of ``tokens`` tokens."""
    hint = ("the first request finds nothing; every later one reuses whole blocks only, and never "
            "its last token (n-1 rule): count the cached tokens per repeat, then divide by all "
            "prompt tokens")
    if answer is None:
        return _say(False, "", hint)
    prompt = tokstr(list(range(tokens)))
    truth = replay_tokens([prompt] * requests, block_size).hit_rate
    return _say(abs(float(answer) - truth) < 1e-3, f"{pct(truth)}, as the replay measures", hint)


