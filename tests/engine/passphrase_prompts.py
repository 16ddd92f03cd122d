"""The passphrase prompts of ``kvlab.lessons.passphrase`` as data, so the engine tests need no
lessons.

``passphrase_prompts.json`` holds each example's system turn and history; a prompt is that, one user
question and the assistant's generation prompt (ChatML). ``tests/lessons/test_passphrase.py`` checks
that these functions return exactly what ``kvlab.lessons.passphrase`` returns.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = json.loads((Path(__file__).with_name("passphrase_prompts.json")).read_text(encoding="utf-8"))
ASK_EN, ASK_ZH = DATA["questions"]["en"][:4], DATA["questions"]["zh"][:4]


def prompt(key: str, question: str) -> str:
    """Example ``key``'s system turn and history, then ``question`` as the last user turn."""
    ex = DATA["examples"][key]
    return (
        f"{ex['prefix']}{ex['history']}<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def prefix(key: str) -> str:
    """Example ``key``'s shared prefix: its system turn."""
    return DATA["examples"][key]["prefix"]


def example_prompts(key: str, questions: list[str]) -> list[str]:
    """One prompt per question, all on example ``key``'s prefix."""
    return [prompt(key, q) for q in questions]


def question_prompts(n_examples: int = 40, per_example: int = 5, seed: int = 0) -> list[str]:
    """Like ``kvlab.lessons.passphrase.question_prompts`` on the held-out split: the same prompts,
    same order."""
    if not 0 < n_examples <= 40 or not 0 < per_example <= 8:
        raise ValueError(
            f"the stored set has 40 examples x 8 questions, not {n_examples} x {per_example}"
        )
    out = []
    for i in range(n_examples):
        key = f"heldout:{i}"
        out += example_prompts(key, DATA["questions"][DATA["examples"][key]["lang"]][:per_example])
    random.Random(seed).shuffle(out)
    return out
