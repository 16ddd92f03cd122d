"""The series' one timing helper (kvlab.lessons.timing): interleaving, median/min-max, and the
verdict words."""

import math

import pytest

from kvlab.lessons.timing import (
    DISTURBED,
    DISTURBED_SPREAD,
    UNEXPLAINED,
    Timing,
    curve_verdict,
    loglog_slope,
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

    t = time_interleaved(
        {"a": variant("a", 1.0), "b": variant("b", 3.0)}, repeats=4, warmup=2, clock=clock
    )
    # 2 warm-up rounds in the given order, then the order is reversed every other round
    assert calls == ["a", "b", "a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert t["a"].seconds == (1.0,) * 4 and t["b"].seconds == (3.0,) * 4
    assert t["a"].result == "A" and t["b"].result == "B"


def test_drift_hits_both_variants_alike():
    """A machine that slows down run by run: alternating the order keeps the two medians' ratio
    honest."""
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


def test_a_ratio_that_beats_its_ideal_is_a_result_with_a_note_not_a_re_run():
    # notebook 08's case: ratio 0.668 where the token share says 0.77
    v = ratio_verdict(
        Timing("fix", (0.66, 0.668, 0.67)),
        Timing("logged", (1.0, 1.0, 1.01)),
        ideal=0.77,
        ideal_is="the share of prompt tokens computed",
    )
    assert v and v.value == pytest.approx(0.668)
    assert "beats the ideal 0.77 (the share of prompt tokens computed) in every repeat" in v.note
    assert "re-run" not in v.says("x") and v.says("x").startswith("x — ratio 0.668")
    # 08's smoke run: 0.615 (0.538-0.724) under the ideal 0.696 -- which lies inside the range
    v = ratio_verdict(
        Timing("fix", (0.51, 0.56, 0.574)), Timing("logged", (0.792, 0.91, 0.949)), ideal=0.696
    )
    assert v and "beats" not in v.note and "lies inside its range 0.537–0.725" in v.note
    assert (
        ratio_verdict(Timing("fix", (0.8, 0.81)), Timing("logged", (1.0, 1.01)), ideal=0.77).note
        == ""
    )


def test_a_slower_saving_path_is_a_result_not_a_flag():
    v = ratio_verdict(Timing("cached", (2.0, 2.0, 2.1)), Timing("full", (1.0, 1.0, 1.0)), ideal=0.5)
    assert v and "took longer than full" in v.note and "re-run" not in v.says("s")


def test_overlapping_ranges_are_a_null_result_of_the_size_given():
    # notebook 00's 52-token row: cached 0.00183-0.00238 s, full 0.00219-0.00329 s
    cached, full = (
        Timing("cached", (0.00183, 0.0021, 0.00238)),
        Timing("full", (0.00219, 0.0025, 0.00329)),
    )
    v = ratio_verdict(cached, full, ideal=0.2, at="at 52 tokens")
    assert not v and not v.disturbed
    assert v.text.startswith("no measurable saving at 52 tokens: the ranges overlap")
    assert "cached 0.00183–0.00238 s" in v.text and "full 0.00219–0.00329 s" in v.text
    assert "re-run" not in v.text and v.says("saves 20 %") == v.text
    # without an ideal the same overlap is "no measurable difference"; without a size, no size
    assert ratio_verdict(cached, full).flag == "no measurable difference"
    # the ranges that only touch still overlap; separated ranges are a result
    assert not ratio_verdict(Timing("r", (5.0, 5.1)), Timing("c", (1.0, 5.0))).ok
    assert ratio_verdict(Timing("r", (5.0, 5.1)), Timing("c", (1.0, 4.99))).ok


def test_re_run_only_when_a_variants_own_spread_shows_a_disturbed_run():
    calm, full = Timing("cached", (0.8, 0.85, 1.05)), Timing("full", (1.0, 1.01, 0.99))
    assert calm.spread == pytest.approx(1.05 / 0.8) and not calm.disturbed
    assert not ratio_verdict(calm, full).disturbed
    shaken = Timing("cached", (0.5, 0.52, 1.5))   # one repeat three times the fastest
    assert shaken.spread > DISTURBED_SPREAD and shaken.disturbed
    v = ratio_verdict(shaken, full, ideal=0.5, at="at 52 tokens")
    assert not v and v.disturbed and v.flag == DISTURBED
    assert (
        "x3.0" in v.why
        and "0.5–1.5 s" in v.why
        and v.text.startswith("disturbed run — re-run: cached's repeats")
    )
    # a disturbed variant whose range still clears the other's is a result: the spread did not
    # change the answer
    assert ratio_verdict(Timing("cached", (0.1, 0.35)), full).ok


def test_a_curve_jumping_three_times_is_flagged():
    n = [256, 512, 1024, 2048]
    # notebook 01's run: the cached step 1.30e-03 -> 5.54e-02 s from 1024 to 2048
    v = curve_verdict(n, [1.2e-3, 1.25e-3, 1.30e-3, 5.54e-2])
    assert (
        not v
        and v.flag == UNEXPLAINED
        and "1024" in v.why
        and "2048" in v.why
        and "re-run" not in v.text
    )
    assert not curve_verdict([1, 2], [1.0, 3.0])  # exactly 3x
    assert curve_verdict([1, 2], [1.0, 2.9])
    assert not curve_verdict([1, 2, 4], [1.0, 1.1, 0.3])  # a curve that falls 3x
    assert math.isnan(v.value)


def test_a_curve_of_timings_says_re_run_only_at_a_disturbed_step():
    calm = [Timing("a", (1.0, 1.1)), Timing("b", (1.2, 1.3)), Timing("c", (42.0, 43.0))]
    assert curve_verdict([1, 2, 4], calm).flag == UNEXPLAINED
    shaken = calm[:2] + [Timing("c", (10.0, 42.0, 60.0))]
    v = curve_verdict([1, 2, 4], shaken)
    assert v.flag == DISTURBED and v.disturbed and "x6.0" in v.why and "10–60 s" in v.why
    # a disturbed size whose step the count explains is no flag
    assert curve_verdict([1, 2], [Timing("a", (1.0, 1.1, 9.0)), Timing("b", (1.5, 1.6))])


def test_a_curve_is_judged_against_its_count():
    n = [512, 1024, 2048]
    quadratic = [x * x * 1e-9 for x in n]  # 4x per doubling, as an n^2 count says
    assert curve_verdict(n, quadratic, expected=[x * x for x in n])
    assert not curve_verdict(n, quadratic)  # against a flat expectation, 4x is a jump
    # notebook 01 on a busy machine: the no-cache step fell 0.19 -> 0.085 s while its count grew
    # x2.2
    v = curve_verdict([128, 256], [0.19, 0.085], expected=[528e6, 1174e6])
    assert not v and "falls x2.2" in v.why
    # flat under a growing count: no flag
    assert curve_verdict([128, 256], [0.19, 0.18], expected=[528e6, 1174e6])
    flat_count = [1.0, 1.05, 1.1]
    v = curve_verdict(n, [1.0, 1.1, 42.0], expected=flat_count)
    assert not v and "the count says x1.0" in v.why


def test_a_clean_curve_says_its_sentence():
    v = curve_verdict([32, 64, 128], [1.0, 1.2, 1.5])
    assert v and v.says("grows as counted") == "grows as counted"


def test_loglog_slope():
    assert loglog_slope([1, 2, 4, 8], [3, 6, 12, 24]) == pytest.approx(1.0)
    assert loglog_slope([10, 20, 40], [1, 4, 16]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        loglog_slope([1], [1])
