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
