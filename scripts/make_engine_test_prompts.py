"""Write ``tests/engine/passphrase_prompts.json``: the passphrase prompts the engine tests run, as
data.

The engine tests travel with ``kvlab/engine`` and so cannot import ``kvlab.lessons``; they read
these prompts instead. ``tests/lessons/test_passphrase.py`` checks that the file still renders
exactly the prompts ``kvlab.lessons.passphrase`` makes; rerun this script when the task changes:

    python scripts/make_engine_test_prompts.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvlab.lessons import passphrase as P

OUT = Path(__file__).resolve().parents[1] / "tests" / "engine" / "passphrase_prompts.json"

# (key, split, seed, make_example keyword arguments): what the engine tests use
EXAMPLES = [(f"heldout:{s}", "heldout", s, {}) for s in range(40)] + [
    ("heldout:3:filler20", "heldout", 3, {"n_filler": 20}),
    ("heldout:4:filler20", "heldout", 4, {"n_filler": 20}),
    *[(f"heldout:{s}", "heldout", s, {}) for s in (300, 301, 302)],
]


def prompt_set() -> dict:
    """Each example's prefix (the system turn) and history (earlier turns), and the questions per
    language."""
    examples = {}
    for key, split, seed, kw in EXAMPLES:
        ex = P.make_example(seed, split, **kw)
        history = "".join(
            P.chatml("user", t.user) + P.chatml("assistant", t.assistant) for t in ex.turns[:-1]
        )
        examples[key] = {"lang": ex.lang, "prefix": ex.prefix_text, "history": history}
    return {
        "about": "kvlab.lessons.passphrase prompts for the engine tests; written by "
                 "scripts/make_engine_test_prompts.py",
        "questions": {"en": list(P.ASK_EN + P.CHAT_EN), "zh": list(P.ASK_ZH + P.CHAT_ZH)},
        "examples": examples,
    }


def main() -> int:
    """Write the file; print its path."""
    OUT.write_text(json.dumps(prompt_set(), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
