"""Random prompts as Gu et al. drew them: English letters, lower and upper case, separated by
spaces.

Most BPE tokenizers give one token per spaced letter; others split differently (the bundled model's
1,024-token vocabulary makes the space a token of its own), so lengths are asked in tokens and
turned into letters with a ``tokens_per_letter`` ratio, which ``kvlab.audit.procedure.calibrate``
measures on the server from its reported ``prompt_tokens``.
"""

from __future__ import annotations

import random
import string

__all__ = ["LETTERS", "letters_for", "prompt_pair", "random_letters"]

LETTERS = string.ascii_letters  # a-z A-Z


def random_letters(rng: random.Random, n: int) -> list[str]:
    """``n`` letters drawn uniformly from a-z A-Z."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [rng.choice(LETTERS) for _ in range(n)]


def letters_for(tokens: int, tokens_per_letter: float = 1.0) -> int:
    """How many spaced letters make about ``tokens`` tokens (at least 1)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if not tokens_per_letter > 0:
        raise ValueError(f"tokens_per_letter must be > 0, got {tokens_per_letter}")
    return max(1, round(tokens / tokens_per_letter))


def prompt_pair(
    rng: random.Random, n_letters: int, prefix_fraction: float, head: str = ""
) -> tuple[str, str]:
    """A victim prompt and an attacker prompt that share their first ``prefix_fraction`` of letters.

    Both start with ``head`` (text every prompt of the audit starts with, e.g. a public system
    prompt); the letters after the shared part are drawn independently for each.
    """
    if not 0.0 <= prefix_fraction <= 1.0:
        raise ValueError(f"prefix_fraction must be in [0, 1], got {prefix_fraction}")
    shared = round(prefix_fraction * n_letters)
    common = random_letters(rng, shared)
    victim = common + random_letters(rng, n_letters - shared)
    attacker = common + random_letters(rng, n_letters - shared)
    return head + " ".join(victim), head + " ".join(attacker)
