"""Notebook 01's timing harness (exported to kvlab.built.nb01): interleaving, median/min-max, and the guard."""

import math

import pytest

from kvlab.built.nb01 import (
    BELOW_IDEAL,
    OUTLIER,
    Timing,
    curve_verdict,
    ratio_verdict,
    time_interleaved,
)


class FakeClock:
    """A clock that only moves when a variant says it took time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_variants_alternate_order_and_each_gets_its_own_seconds():
    clock, calls = FakeClock(), []

    def variant(name, seconds):
        def run():
            calls.append(name)
            clock.now += seconds
            return name.upper()
        return run

    t = time_interleaved({"a": variant("a", 1.0), "b": variant("b", 3.0)}, repeats=4, warmup=2, clock=clock)
    # 2 warm-up rounds in the given order, then the order is reversed every other round
    assert calls == ["a", "b", "a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert t["a"].seconds == (1.0,) * 4 and t["b"].seconds == (3.0,) * 4
    assert t["a"].result == "A" and t["b"].result == "B"


def test_drift_hits_both_variants_alike():
    """A machine that slows down run by run: alternating the order keeps the two medians' ratio honest."""
    clock, runs = FakeClock(), [0]

    def variant(work):
        def run():
            runs[0] += 1
            clock.now += work * (1 + 0.1 * runs[0])  # every run 10 % slower than the one before
        return run

    t = time_interleaved({"a": variant(1.0), "b": variant(1.0)}, repeats=6, warmup=0, clock=clock)
    assert t["a"].median == pytest.approx(t["b"].median)  # the same work reads the same


def test_setup_is_not_timed_and_its_result_is_passed_in():
    clock, seen = FakeClock(), []

    def setup():
        clock.now += 100.0  # an expensive copy, outside the timing
        return "copy"

    def run(arg):
        seen.append(arg)
        clock.now += 2.0

    t = time_interleaved({"x": (setup, run)}, repeats=3, warmup=1, clock=clock)
    assert t["x"].seconds == (2.0, 2.0, 2.0) and seen == ["copy"] * 4


def test_sync_waits_around_every_timed_run():
    clock, events = FakeClock(), []
    time_interleaved({"a": lambda: events.append("run")}, repeats=2, warmup=0, clock=clock,
                     sync=lambda: events.append("sync"))
    assert events == ["sync", "run", "sync"] * 2


def test_timing_median_and_min_max():
    t = Timing("a", (3.0, 1.0, 2.0, 10.0, 2.5))
    assert (t.median, t.lo, t.hi) == (2.5, 1.0, 10.0)


def test_a_clean_ratio_is_not_flagged_and_says_its_sentence():
    cached, full = Timing("cached", (0.40, 0.41, 0.42)), Timing("full", (1.00, 1.01, 1.02))
    v = ratio_verdict(cached, full, ideal=0.3)
    assert v and v.text == "ok" and v.says("saves 60 %") == "saves 60 %"
    assert v.value == pytest.approx(0.41 / 1.01)
    assert v.lo == pytest.approx(0.40 / 1.02) and v.hi == pytest.approx(0.42 / 1.00)


def test_a_ratio_below_the_ideal_is_flagged():
    v = ratio_verdict(Timing("cached", (0.09, 0.1, 0.11)), Timing("full", (1.0, 1.0, 1.0)), ideal=0.33)
    assert not v and v.flag == BELOW_IDEAL and v.says("x11 faster").startswith("below the ideal — re-run")


def test_a_ratio_above_one_and_a_half_is_flagged_when_an_ideal_is_given():
    v = ratio_verdict(Timing("cached", (2.0, 2.0, 2.1)), Timing("full", (1.0, 1.0, 1.0)), ideal=0.5)
    assert not v and v.flag == OUTLIER and "above 1.5" in v.why


def test_overlapping_min_max_is_flagged():
    # medians 0.8 vs 1.0, but one slow run of "cached" reaches into "full"'s range: not told apart
    v = ratio_verdict(Timing("cached", (0.8, 0.79, 1.05)), Timing("full", (1.0, 1.01, 0.99)), ideal=0.5)
    assert not v and v.flag == OUTLIER and "overlap" in v.why
    assert v.says("saves 20 %") == v.text and "saves" not in v.text
    # without an ideal (a speed-up), only the overlap rule applies
    assert ratio_verdict(Timing("r", (5.0, 5.1)), Timing("c", (1.0, 1.1))).ok
    assert not ratio_verdict(Timing("r", (5.0, 5.1)), Timing("c", (1.0, 5.05))).ok


def test_a_curve_jumping_three_times_is_flagged():
    n = [256, 512, 1024, 2048]
    # notebook 01's run: the cached step 1.30e-03 -> 5.54e-02 s from 1024 to 2048
    v = curve_verdict(n, [1.2e-3, 1.25e-3, 1.30e-3, 5.54e-2])
    assert not v and v.flag == OUTLIER and "1024" in v.why and "2048" in v.why
    assert not curve_verdict([1, 2], [1.0, 3.0])  # exactly 3x
    assert curve_verdict([1, 2], [1.0, 2.9])
    assert not curve_verdict([1, 2, 4], [1.0, 1.1, 0.3])  # a curve that falls 3x
    assert math.isnan(v.value)


def test_a_curve_is_judged_against_its_count():
    n = [512, 1024, 2048]
    quadratic = [x * x * 1e-9 for x in n]  # 4x per doubling, as an n^2 count says
    assert curve_verdict(n, quadratic, expected=[x * x for x in n])
    assert not curve_verdict(n, quadratic)  # against a flat expectation, 4x is a jump
    # notebook 01 on a busy machine: the no-cache step fell 0.19 -> 0.085 s while its count grew x2.2
    v = curve_verdict([128, 256], [0.19, 0.085], expected=[528e6, 1174e6])
    assert not v and "falls x2.2" in v.why
    assert curve_verdict([128, 256], [0.19, 0.18], expected=[528e6, 1174e6])  # flat under a growing count: no flag
    flat_count = [1.0, 1.05, 1.1]
    v = curve_verdict(n, [1.0, 1.1, 42.0], expected=flat_count)
    assert not v and "the count says x1.0" in v.why


def test_a_clean_curve_says_its_sentence():
    v = curve_verdict([32, 64, 128], [1.0, 1.2, 1.5])
    assert v and v.says("grows as counted") == "grows as counted"
