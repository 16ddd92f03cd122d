"""The one timing helper of the series (teaching floor): warm-up, interleaved repeats, median with
min–max.

Words: ranges that do not overlap are a result; overlapping ranges a null result of that size ("no
measurable saving at 52 tokens"); "re-run" only when they overlap and a spread exceeds
``DISTURBED_SPREAD``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import log
from statistics import median
from time import perf_counter
from typing import Any

# a variant's slowest repeat over its fastest above this: the run was disturbed
DISTURBED_SPREAD = 2.0
DISTURBED = "disturbed run — re-run"
UNEXPLAINED = "a jump the count does not explain"


@dataclass(frozen=True)
class Timing:
    """The seconds one variant took in each repeat, and what its last run returned."""

    name: str
    seconds: tuple[float, ...]
    result: Any = field(default=None, repr=False, compare=False)

    @property
    def median(self) -> float:
        return median(self.seconds)

    @property
    def lo(self) -> float:
        return min(self.seconds)

    @property
    def hi(self) -> float:
        return max(self.seconds)

    @property
    def spread(self) -> float:
        """Slowest repeat over fastest (1.0 for a single repeat)."""
        return self.hi / self.lo if self.lo > 0 else float("inf")

    @property
    def disturbed(self) -> bool:
        return self.spread > DISTURBED_SPREAD

    @property
    def span(self) -> str:
        """``'cached 0.00183–0.00238 s'``: the name and the min–max of the repeats."""
        return f"{self.name} {self.lo:.3g}–{self.hi:.3g} s"


def time_interleaved(variants: Mapping[str, Callable[[], Any]
                                       | tuple[Callable[[], Any], Callable[[Any], Any]]],
                     repeats: int = 5, warmup: int = 1, sync: Callable[[], None] | None = None,
                     clock: Callable[[], float] = perf_counter) -> dict[str, Timing]:
    """Time several variants of one computation against each other: ``{name: Timing}``. A variant is
    ``fn`` or ``(setup, fn)`` (setup untimed); ``warmup`` untimed runs, then ``repeats`` rounds in
    alternating order."""
    def split(variant):
        return variant if isinstance(variant, tuple) else (None, lambda _: variant())

    names = list(variants)
    for _ in range(warmup):
        for name in names:
            setup, fn = split(variants[name])
            fn(setup() if setup else None)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, Any] = {}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):   # alternate who goes first
            setup, fn = split(variants[name])
            arg = setup() if setup else None                   # not timed
            if sync:
                sync()
            t0 = clock()
            last[name] = fn(arg)
            if sync:
                sync()
            seconds[name].append(clock() - t0)
    return {name: Timing(name, tuple(seconds[name]), last.get(name)) for name in names}


@dataclass(frozen=True)
class TimingVerdict:
    """What a measurement says: ``ok`` (a result, maybe with a ``note``), or not ok with a ``flag``
    and ``why``."""

    ok: bool
    flag: str = ""
    why: str = ""
    value: float = float("nan")
    lo: float = float("nan")
    hi: float = float("nan")
    note: str = ""
    disturbed: bool = False

    def __bool__(self) -> bool:
        return self.ok

    @property
    def text(self) -> str:
        return ((f"ok ({self.note})" if self.note else "ok") if self.ok
                else f"{self.flag}: {self.why}")

    def says(self, sentence: str) -> str:
        if not self.ok:
            return self.text
        return f"{sentence} — {self.note}" if self.note else sentence


def ratio_verdict(num: Timing, den: Timing, ideal: float | None = None, high: float = 1.5, *,
                  at: str = "",
                  ideal_is: str = "") -> TimingVerdict:
    """``num / den`` (medians) with its min–max (num.lo / den.hi to num.hi / den.lo), judged."""
    value, lo, hi = num.median / den.median, num.lo / den.hi, num.hi / den.lo
    found = dict(value=value, lo=lo, hi=hi)
    at = f" {at.strip()}" if at.strip() else ""
    if num.lo <= den.hi and den.lo <= num.hi:
        shaken = [t for t in (num, den) if t.disturbed]
        if shaken:
            t = max(shaken, key=lambda t: t.spread)
            other = den if t is num else num
            return TimingVerdict(False, DISTURBED,
                                 f"{t.name}'s repeats span x{t.spread:.1f} ({t.lo:.3g}–{t.hi:.3g} "
                                 f"s), more than x{DISTURBED_SPREAD:g}, and overlap {other.span}",
                                 disturbed=True, **found)
        what = "saving" if ideal is not None else "difference"
        return TimingVerdict(False, f"no measurable {what}{at}",
                             f"the ranges overlap ({num.span} and {den.span})",
                             **found)
    note = ""
    described = f" ({ideal_is})" if ideal_is else ""
    if ideal is not None and hi < ideal:
        note = (f"ratio {value:.3g} ({lo:.3g}–{hi:.3g}) beats the ideal {ideal:.3g}{described} in "
                "every repeat: the work removed cost more than its share of the time")
    elif ideal is not None and value < ideal:
        note = (f"ratio {value:.3g} under the ideal {ideal:.3g}{described}, which lies inside its "
                f"range {lo:.3g}–{hi:.3g}: as fast as the ideal, within the spread of the repeats")
    elif ideal is not None and value > high:
        note = f"ratio {value:.3g}: {num.name} took longer than {den.name}, not a saving"
    return TimingVerdict(True, note=note, **found)


def curve_verdict(sizes: Sequence[float], seconds: Sequence[float | Timing],
                  expected: Sequence[float] | None = None,
                  jump: float = 3.0) -> TimingVerdict:
    """A timed curve (one time per size, sizes increasing), judged step by step between
    neighbours."""
    sizes = list(sizes)
    timings = [s if isinstance(s, Timing) else None for s in seconds]
    times = [s.median if isinstance(s, Timing) else float(s) for s in seconds]
    # no count: a flat curve
    counts = list(expected) if expected is not None else [1.0] * len(sizes)
    for i in range(len(sizes) - 1):
        grew = times[i + 1] / times[i]
        counted = counts[i + 1] / counts[i]
        says = f", the count says x{counted:.1f}" if expected is not None else ""
        if grew >= jump * counted:
            why = f"x{grew:.1f} from {sizes[i]:g} to {sizes[i + 1]:g}{says}"
        elif grew < 1 and grew * jump <= counted:
            why = f"falls x{1 / grew:.1f} from {sizes[i]:g} to {sizes[i + 1]:g}{says}"
        else:
            continue
        shaken = [t for t in timings[i:i + 2] if t is not None and t.disturbed]
        if shaken:
            t = max(shaken, key=lambda t: t.spread)
            return TimingVerdict(False, DISTURBED,
                                 f"{why}; the repeats at that size span x{t.spread:.1f} "
                                                   f"({t.lo:.3g}–{t.hi:.3g} s)", disturbed=True)
        return TimingVerdict(False, UNEXPLAINED, why)
    return TimingVerdict(True)


def loglog_slope(sizes: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of log(value) over log(size): 1 grows linearly, 2 quadratically."""
    xs, ys = [log(s) for s in sizes], [log(v) for v in values]
    if len(xs) < 2:
        raise ValueError("a slope needs at least two sizes")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
