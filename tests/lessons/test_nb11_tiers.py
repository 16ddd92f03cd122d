"""Notebook 11's crossover sentence: a length counts as faster or slower only where the repeats tell
the two paths apart (kvlab.lessons.timing.ratio_verdict); elsewhere it says so instead of naming a
crossover."""

import pandas as pd


def _rows(times: dict[int, tuple[tuple, tuple]]) -> pd.DataFrame:
    rows = []
    for n, (rec, tier) in times.items():
        rows.append(
            {
                "prefix_tokens": n,
                "recompute_s": min(rec),
                "tier_s": min(tier),
                "transfer_s": min(tier),
                "copy_s": 0.0,
                "bytes": 1024 * n,
                "recompute_all": rec,
                "tier_all": tier,
                "transfer_all": tier,
            }
        )
    return pd.DataFrame(rows)


def test_a_crossover_is_named_only_between_lengths_the_repeats_tell_apart():
    from kvlab.built.nb11 import crossover_sentences

    clean = _rows({16: ((1.0, 1.1, 1.2), (2.0, 2.1, 2.2)), 256: ((4.0, 4.1, 4.2), (1.0, 1.1, 1.2))})
    assert (
        "faster from 256 prefix tokens on (the crossover lies between 16 and 256)"
        in crossover_sentences(clean)[0]
    )
    noisy = _rows({16: ((1.0, 1.5, 3.0), (1.2, 2.0, 2.5)), 256: ((4.0, 4.1, 4.2), (1.0, 1.1, 1.2))})
    line = crossover_sentences(noisy)[0]
    assert "16: disturbed run — re-run: recompute's repeats span x3.0" in line
    assert (
        "faster at 256 tokens; not told apart at 16 tokens" in line and "crossover lies" not in line
    )
    calm = _rows(
        {16: ((1.0, 1.1, 1.2), (1.15, 1.2, 1.25)), 256: ((4.0, 4.1, 4.2), (1.0, 1.1, 1.2))}
    )
    line = crossover_sentences(calm)[0]
    assert "16: no measurable difference: the ranges overlap" in line and "re-run" not in line
    always = _rows(
        {16: ((2.0, 2.1, 2.2), (1.0, 1.1, 1.2)), 256: ((4.0, 4.1, 4.2), (1.0, 1.1, 1.2))}
    )
    assert "faster at every prefix length measured" in crossover_sentences(always)[0]


def test_the_tier_sentence_ranks_no_ttft_from_one_run():
    """One run per tier size has no spread: the p50/p99 TTFTs are printed, never called lower."""
    from kvlab.built.nb11 import tier_sentences

    base = {"tier_blocks": 0, "pool_hit_rate": 0.2, "restored_rate": 0.0, "served_rate": 0.2,
            "ttft_p50": 0.010, "ttft_p99": 0.050, "bytes_to_host": 0, "bytes_from_host": 0,
            "copy_s": 0.0}
    tier = {**base, "tier_blocks": 256, "restored_rate": 0.3, "served_rate": 0.5,
            "ttft_p50": 0.007, "ttft_p99": 0.030, "bytes_to_host": 2**20, "copy_s": 0.01}
    _, ttft = tier_sentences(pd.DataFrame([base, tier]))
    assert "10.00 ms -> 7.00 ms" in ttft and "50.00 ms -> 30.00 ms" in ttft
    assert "not a ranking" in ttft
    assert not any(w in ttft for w in ("lower", "higher", "faster", "slower"))


def test_the_split_sentence_ranks_no_latency_from_one_run():
    """The P/D split runs once per layout: its TTFT and inter-token latencies are printed, never
    called steadier (it said "steadier"/"not steadier" from one run)."""
    from kvlab.built.nb11 import pd_sentences

    row = {"ttft_p50": 0.009, "ttft_p99": 0.050, "itl_p50": 0.004, "itl_p99": 0.006}
    rows = pd.DataFrame([row, {**row, "itl_p99": 0.005}])
    ttft, itl, moved = pd_sentences({"rows": rows, "moved_tokens": 10, "same_tokens": True})
    assert "p99 6.00 ms vs 5.00 ms" in itl and "not a ranking" in itl
    assert not any(w in itl for w in ("steadier", "lower", "higher", "faster", "slower"))
    assert "restored 10 prompt tokens" in moved and "equal the co-located" in moved
