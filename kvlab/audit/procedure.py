"""The audit of Gu et al. (ICML 2025), written from the paper's description: is a prompt cache
shared?

Two procedures, each sampled ``samples`` times, all in one random order:

- **cache hit**: the victim sends a random prompt ``victim_requests`` times; then the attacker sends
  a prompt sharing the victim's first ``prefix_fraction`` and records its TTFT;
- **cache miss**: the attacker sends a fresh random prompt and records its TTFT.

If victim and attacker share a cache, hit TTFTs are shorter; the two-sample Kolmogorov-Smirnov test
compares the two samples, and a p-value below ``alpha`` rejects "same distribution": sharing
detected. Who the victim and attacker are sets the *sharing level*: the same API key (per user), two
keys of one organisation (per organisation), keys of two organisations (global). ``power`` asks how
many samples a detection needed: it subsamples both sides many times and counts how often p < alpha.

The false-alarm rate ``alpha`` assumes that hit and miss TTFTs differ by the cache alone. On a busy
machine that did not hold: with tests running on both cores, the project's CI once got p = 0.0009
on a tenant-isolated level where every probe was uncached, while 16 runs of that level on a quiet
machine gave p from 0.24 to 0.96 (why the busy run differed was not established). Where the
endpoint reports ``cached_tokens`` (``AuditResult.hit_cached``), read them beside the p-value;
otherwise audit again on a quieter machine before trusting a detection.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .client import Endpoint, Timing, measure
from .prompts import letters_for, prompt_pair, random_letters

__all__ = [
    "AuditConfig",
    "AuditResult",
    "Level",
    "Probe",
    "calibrate",
    "ks_test",
    "miss_prompt",
    "power",
    "power_at",
    "run_audit",
    "run_levels",
    "samples_to_detect",
]

# one timed request; ``measure`` over HTTP, or a stand-in in tests
Probe = Callable[[Endpoint, str], Timing]


MAX_SAMPLES = 10_000  # per procedure: hours of requests already
MAX_VICTIM_REQUESTS = 100
# beyond any served context; the server's own (max_model_len) is checked by the CLI
MAX_PROMPT_TOKENS = 1 << 20


@dataclass(frozen=True)
class AuditConfig:
    """The audit's knobs, named after the paper's PROMPTLENGTH, PREFIXFRACTION, NUMVICTIMREQUESTS,
    NUMSAMPLES."""

    prompt_tokens: int = 256
    prefix_fraction: float = 0.95
    victim_requests: int = 1
    samples: int = 30  # per procedure
    alpha: float = 1e-3  # significance level of the decision
    seed: int = 0
    tokens_per_letter: float = 1.0  # calibrate() measures it on the server
    # text the prompts start with (e.g. a public system prompt); not counted in prompt_tokens
    head: str = ""
    # False: the cache-miss prompt starts with fresh letters instead (see prompt_pair)
    head_in_miss: bool = True

    def __post_init__(self) -> None:
        for name, low, high in (
            ("prompt_tokens", 1, MAX_PROMPT_TOKENS),
            ("victim_requests", 1, MAX_VICTIM_REQUESTS),
            ("samples", 2, MAX_SAMPLES),
        ):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(
                    f"{name} (--{name.replace('_', '-')}) must be an int in [{low}, {high:,}], "
                    f"got {value!r}"
                )
        if not 0.0 <= self.prefix_fraction <= 1.0:
            raise ValueError(f"prefix_fraction must be in [0, 1], got {self.prefix_fraction!r}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha!r}")


@dataclass(frozen=True)
class Level:
    """A sharing level to test: a name and the victim's and the attacker's endpoints."""

    name: str
    victim: Endpoint
    attacker: Endpoint


@dataclass
class AuditResult:
    """The TTFTs of both procedures, the KS statistic and p-value, and the decision at ``alpha``."""

    level: str
    hit: list[float]  # seconds, attacker's TTFT after the victim's prompt
    miss: list[float]  # seconds, attacker's TTFT of a fresh prompt
    statistic: float
    pvalue: float
    alpha: float
    # what the server reported, when it did
    hit_cached: list[int | None] = field(default_factory=list)
    miss_cached: list[int | None] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's count for the attacker's prompts (median)

    @property
    def detected(self) -> bool:
        """True when p < alpha: the hit and miss TTFTs differ, so the attacker hit the victim's
        cache."""
        return self.pvalue < self.alpha

    def cached_note(self) -> str:
        """What the server reported of the hits' cached tokens, beside the timing verdict ("" when
        it reported none); says so when a detection meets hits the server served uncached."""
        known = [c for c in self.hit_cached if c is not None]
        if not known:
            return ""
        note = f"server-reported cached tokens (hit median) {statistics.median(known):g}"
        if self.detected and max(known) == 0:
            note += (
                ": timing and report disagree (a busy machine can make hit and miss TTFTs differ;"
                " audit again on a quieter one before trusting this detection)"
            )
        return note

    def row(self) -> dict:
        """One row of the audit table (milliseconds; cached tokens as the server reported them)."""
        known = [c for c in self.hit_cached if c is not None]
        return {
            "sharing level": self.level,
            "samples": len(self.hit),
            "prompt tokens": self.prompt_tokens,
            "median TTFT hit (ms)": 1e3 * statistics.median(self.hit),
            "median TTFT miss (ms)": 1e3 * statistics.median(self.miss),
            "server-reported cached tokens (hit, median)": statistics.median(known)
            if known
            else None,
            "KS D": self.statistic,
            "p-value": self.pvalue,
            "alpha": self.alpha,
            "detected": self.detected,
        }


def ks_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Two-sample, two-sided Kolmogorov-Smirnov test (scipy): (statistic D, p-value)."""
    import warnings

    from scipy.stats import ks_2samp

    if len(a) < 1 or len(b) < 1:
        raise ValueError("the KS test needs at least one value on each side")
    # "exact calculation unsuccessful, switching to asymp": fine, and said once here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ks_2samp: Exact calculation unsuccessful")
        res = ks_2samp(list(a), list(b), alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


def calibrate(
    endpoint: Endpoint, probe: Probe | None = None, letters: int = 64, seed: int = 0
) -> float:
    """Tokens per spaced letter on this server, from the ``prompt_tokens`` it reports (1.0 if it
    reports none)."""
    probe = probe or measure
    rng = random.Random(f"kvlab-audit-calibrate:{seed}")
    timing = probe(endpoint, " ".join(random_letters(rng, letters)))
    return timing.prompt_tokens / letters if timing.prompt_tokens else 1.0


def run_audit(level: Level, config: AuditConfig, probe: Probe | None = None) -> AuditResult:
    """Sample both procedures ``config.samples`` times in a random order and test hit vs miss
    TTFTs."""
    import httpx

    rng = random.Random(f"kvlab-audit:{config.seed}:{level.name}")
    n_letters = letters_for(config.prompt_tokens, config.tokens_per_letter)
    order = ["hit"] * config.samples + ["miss"] * config.samples
    rng.shuffle(order)
    with httpx.Client(timeout=120.0) as http:
        probe = probe or (lambda ep, prompt: measure(ep, prompt, http))
        probe(level.attacker, " ".join(random_letters(rng, n_letters)))  # warm-up: not recorded
        hit: list[Timing] = []
        miss: list[Timing] = []
        for kind in order:
            if kind == "hit":
                victim_prompt, attacker_prompt = prompt_pair(
                    rng, n_letters, config.prefix_fraction, config.head
                )
                for _ in range(config.victim_requests):
                    probe(level.victim, victim_prompt)
                hit.append(probe(level.attacker, attacker_prompt))
            else:  # a fresh prompt: no victim sent it
                miss.append(
                    probe(
                        level.attacker,
                        miss_prompt(rng, n_letters, config.head, config.head_in_miss),
                    )
                )
    d, p = ks_test([t.ttft for t in hit], [t.ttft for t in miss])
    counts = [t.prompt_tokens for t in hit + miss if t.prompt_tokens is not None]
    return AuditResult(
        level.name,
        [t.ttft for t in hit],
        [t.ttft for t in miss],
        d,
        p,
        config.alpha,
        [t.cached_tokens for t in hit],
        [t.cached_tokens for t in miss],
        int(statistics.median(counts)) if counts else None,
    )


def miss_prompt(
    rng: random.Random, n_letters: int, head: str = "", head_in_miss: bool = True
) -> str:
    """The cache-miss procedure's prompt: ``head`` (or, with ``head_in_miss=False``, as many fresh
    spaced letters as ``head`` has words: exact for a head of spaced letters) and ``n_letters``
    fresh letters."""
    start = (
        head
        if head_in_miss
        else " ".join(random_letters(rng, len(head.split()))) + (" " if head else "")
    )
    return start + " ".join(random_letters(rng, n_letters))


def run_levels(
    levels: Sequence[Level], config: AuditConfig, probe: Probe | None = None
) -> list[AuditResult]:
    """``run_audit`` for each level in turn (one seed per level, derived from ``config.seed`` and
    its name)."""
    return [run_audit(level, config, probe) for level in levels]


def power_at(hit: Sequence[float], miss: Sequence[float], n: int, alpha: float, reps: int = 100,
             seed: int = 0) -> float:
    """The share of ``reps`` subsamples (``n`` per side, drawn without replacement) whose KS p-value
    is < alpha."""
    if type(n) is not int or n < 1 or n > min(len(hit), len(miss)):
        raise ValueError(
            f"sample size {n!r} is outside 1..{min(len(hit), len(miss))} (the samples recorded)"
        )
    rng = random.Random(f"kvlab-audit-power:{seed}:{n}")
    return (
        sum(
            ks_test(rng.sample(list(hit), n), rng.sample(list(miss), n))[1] < alpha
            for _ in range(reps)
        )
        / reps
    )


def power(
    hit: Sequence[float],
    miss: Sequence[float],
    sizes: Sequence[int],
    alpha: float,
    reps: int = 100,
    seed: int = 0,
) -> list[dict]:
    """Per sample size n: ``{"samples": n, "power": power_at(...)}``."""
    return [{"samples": n, "power": power_at(hit, miss, n, alpha, reps, seed)} for n in sizes]


def samples_to_detect(
    result: AuditResult, target: float = 0.9, reps: int = 100, seed: int = 0
) -> int | None:
    """The fewest samples per procedure whose subsamples detect with probability >= ``target``
    (None: not even all)."""
    for n in range(2, min(len(result.hit), len(result.miss)) + 1):
        if power_at(result.hit, result.miss, n, result.alpha, reps, seed) >= target:
            return n
    return None


