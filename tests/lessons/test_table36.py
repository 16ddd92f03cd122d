"""Named workloads and the table 3.6 modes: shapes, shared (correct) == isolated, every wrong mode
disagrees.

The modes and the run loop are notebook 05's export cells (``kvlab.built.nb05``); the scores,
figures and checkers its lesson module. Correctness runs on the bundled model (``KVLAB_TEST_MODEL``
overrides it); the claim that each wrong mode changes answers is only asserted on the trained
bundled model, where answers mean something.
"""

import os
from types import SimpleNamespace

import pytest
from tiny_models import tiny_qwen2

from kvlab.built import nb05 as N
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import BUNDLED_MODEL
from kvlab.lessons import nb05_table36 as T
from kvlab.lessons import workloads as W
from kvlab.lessons.common import decision_table

BLOCK = 16


@pytest.fixture(scope="module")
def groups(lm):
    return W.seed_groups(lm[1], n=6, block_size=BLOCK)


# --- workloads ------------------------------------------------------------------------------------

def test_sys512_shape():
    wl = W.sys512(1000)
    assert (
        len(wl) == 16
        and wl.max_tokens == 32
        and wl.shared_prefix_tokens == 512
        and wl.name == "sys512"
    )
    assert all(
        len(p) == 544 and p[:512] == wl.prompts[0][:512] and all(0 <= t < 1000 for t in p)
        for p in wl.prompts
    )
    assert len({tuple(p[512:]) for p in wl.prompts}) == 16  # unique suffixes
    assert W.sys512(1000).prompts == wl.prompts and W.sys512(1000, seed=1).prompts != wl.prompts
    small = W.sys512(50, num_requests=3, prefix_tokens=40, suffix_tokens=5, max_tokens=2)
    assert len(small) == 3 and all(len(p) == 45 for p in small.prompts) and small.name != "sys512"
    # the first request computes 45 tokens, the others reuse 2 full blocks of 16 and compute 13
    assert W.ideal_prefill_fraction(small, 16) == pytest.approx((45 + 2 * 13) / 135)
    with pytest.raises(ValueError):
        W.sys512(100, num_requests=0)


def test_seed_groups_shapes(lm, groups):
    tok = lm[1]
    assert set(groups) == {1, 2, 3}
    g1, g2, g3 = groups[1], groups[2], groups[3]
    assert len(g1) == 18 and g1.served() == list(range(18))
    for i, m in enumerate(g1.meta):  # same system prompt tokens, different questions
        twin = next(j for j, n in enumerate(g1.meta) if n["seed"] == m["seed"] and j != i)
        assert g1.prompts[i][:m["prefix_tokens"]] == g1.prompts[twin][:m["prefix_tokens"]]
        assert g1.prompts[i] != g1.prompts[twin]
    for b in g2.served():  # B's text is A's after a block-aligned extra turn
        a, off = g2.meta[b]["donor"], g2.meta[b]["offset"]
        assert g2.meta[a]["role"] == "donor" and off % BLOCK == 0 and off > 0
        assert g2.prompts[a][off:] == g2.prompts[b] and g2.prompts[a][:off] != g2.prompts[b][:off]
    assert len(g3.served()) == 6
    for b in g3.served():
        m = g3.meta[b]
        assert m["history"] in ("none", "chat") and m["other_answer"] != m["expected"]
        assert m["beyond_prompt"][:m["prefix_tokens"]] == g3.prompts[b][:m["prefix_tokens"]]
        assert tok.decode(m["beyond_prompt"]).endswith(
            tok.decode(g3.prompts[b]).split("<|im_start|>user")[-1]
        )


def test_content_hash_ignores_parent_and_position():
    assert N.content_hash(None, [1, 2, 3]) == N.content_hash(b"x" * 32, [1, 2, 3], ("model", "m"))
    assert N.content_hash(None, [1, 2, 3]) != N.content_hash(None, [1, 2, 4])


# --- the modes on the model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured(lm, groups):
    model, tok = lm
    return T.table_36(model, tok, groups, repeats=1, block_size=BLOCK)


def test_shared_correct_is_identical_to_isolated(measured, groups):
    table, runs = measured
    for g in groups:
        iso = runs[(g, "isolated")]["outputs"]
        ok = runs[(g, "shared (correct)")]["outputs"]
        assert [o.output_ids for o in ok] == [o.output_ids for o in iso], f"group {g}"
    d = table.set_index(["group", "mode"])
    assert (
        d.loc[(1, "shared (correct)"), "cached tokens"] > 0
        and d.loc[(3, "shared (correct)"), "cached tokens"] > 0
    )
    # a different start: the chained keys find (almost) nothing to share; the text-only keys find
    # B's prompt
    assert (
        d.loc[(2, "shared (correct)"), "cached tokens"]
        < d.loc[(2, "shared (wrong)"), "cached tokens"] / 4
    )
    for g in (1, 3):
        assert (
            d.loc[(g, "shared (correct)"), "peak KV (KiB)"]
            < d.loc[(g, "isolated"), "peak KV (KiB)"]
        )


def test_wrong_modes_really_share(measured):
    table, runs = measured
    d = table.set_index(["group", "mode"])
    for g in (1, 2, 3):
        assert d.loc[(g, "shared (wrong)"), "cached tokens"] > 0, (
            f"group {g}'s bug never hit the cache"
        )
    assert d.loc[(2, "shared (wrong)"), "peak KV (KiB)"] < d.loc[(2, "isolated"), "peak KV (KiB)"]


@pytest.mark.skipif(
    not (BUNDLED_MODEL / "config.json").exists() or bool(os.environ.get("KVLAB_TEST_MODEL")),
    reason="only the trained bundled model answers meaningfully",
)
def test_each_wrong_mode_changes_answers(measured):
    table, _ = measured
    d = table.set_index(["group", "mode"])
    for g in (1, 2, 3):
        assert d.loc[(g, "isolated"), "recall"] >= 0.5, (
            f"the bundled model should recall in group {g}"
        )
        assert d.loc[(g, "shared (wrong)"), "identical"] < 1.0, f"group {g}'s bug changed nothing"
    assert d.loc[(3, "shared (wrong)"), "answered A's passphrase"] > 0


def test_evidence_and_comparison(measured):
    table, _ = measured
    ev = T.evidence(table)
    assert set(ev) == {"identical-prefix", "same-start", "positions-agree", "independent-context",
                       "overlap-different-start"} and all(s.startswith("nb05") for s in ev.values())
    assert list(decision_table(ev).loc[list(ev), "evidence (measured here)"]) == list(ev.values())
    cmp = T.compare_with_article(table)
    assert len(cmp) == 6 and cmp["TTFT ratio, ours"].notna().all()
    assert list(T.article_table()["TTFT (ms)"]) == [320, 185, 315, 190, 318, 188]


def test_verdict_lines_read_the_table(measured, capsys):
    from kvlab.lessons.passphrase import memory_column

    table, runs = measured
    d = table.set_index(["group", "mode"])
    T.say_wrong_shares(table)
    T.say_against_article(table)
    out = capsys.readouterr().out.splitlines()
    changed = 1 - d.loc[(2, "shared (wrong)"), "identical"]
    assert any(line.startswith(f"group 2, {T.WRONG_MODES[2]}: {changed:.0%} of") for line in out)
    kv = d.loc[(1, "shared (correct)"), "peak KV (KiB)"] / d.loc[(1, "isolated"), "peak KV (KiB)"]
    (memory,) = [line for line in out if line.startswith("memory  ")]
    # the series' one reading, then ours
    assert str(memory_column()) in memory and f"x{kv:.2f}" in memory
    assert not any(word in line for line in out for word in ("outlier", "re-run"))


def test_checkers():
    assert T.check_bug_for_group(
        {1: "positions-agree", 2: "overlap-different-start", 3: "independent-context"}
    )
    assert T.check_bug_for_group({1: "positions-agree", 2: "same-start", 3: "independent-context"})
    assert not T.check_bug_for_group(
        {1: "identical-prefix", 2: "same-start", 3: "independent-context"}
    )
    assert not T.check_bug_for_group(None)
    # positions are not names
    assert "not a row name" in str(T.check_bug_for_group({1: 3, 2: 6, 3: 4}))
    full, per = 512 // 16, -(-(512 + 63) // 16)
    assert T.check_kv_ratio((full + 16 * (per - full)) / (16 * per), 16, 512, 63)
    assert not T.check_kv_ratio(0.5, 16, 512, 63) and not T.check_kv_ratio(None, 16, 512, 63)


# --- the benchmark core on a tiny random model ----------------------------------------------------

def test_bench_core_on_a_tiny_model():

    from kvlab.bench import peers as B

    model = tiny_qwen2()
    wl = W.sys512(256, num_requests=3, prefix_tokens=48, suffix_tokens=8, max_tokens=4)
    keys = ["kvlab/shared", "kvlab/isolated", "HF manual reuse/shared", "HF manual reuse/isolated",
            "HF generate (one by one)/isolated", "HF generate_batch/shared"]
    table, detail = B.measure_sys512(model, wl, repeats=1, systems=keys)
    ok = table[table["error"] == ""]
    assert (ok["token agreement with HF generate"] == 1.0).all(), table
    kv = B.kv_ideal_bytes(wl, detail["kvlab/shared"]["bytes_per_block"])
    t = table.set_index(["system", "mode"])
    assert t.loc[("kvlab", "shared"), "peak KV (MiB)"] * 2 ** 20 == kv["shared"]
    assert t.loc[("kvlab", "isolated"), "peak KV (MiB)"] * 2 ** 20 == kv["isolated"]
    assert t.loc[("kvlab", "shared"), "cached tokens"] == 2 * 48
    r = B.ratios(table, wl)
    assert (
        set(r.system) == {"kvlab", "HF manual reuse"}
        and (r["ideal"] == W.ideal_prefill_fraction(wl)).all()
    )
    goals = B.goals(table, r, wl, detail["kvlab/shared"]["bytes_per_block"])
    # generate_batch ran: its throughput goal is in
    assert len(goals) == 6 and goals["met"].dtype == bool


def test_position_bug_numbers_the_computed_tokens_from_zero():
    """restart_positions: a request with a cache hit computes its tokens at 0, 1, ...; one without
    is unaffected."""
    hit = SimpleNamespace(start=32, end=40, seq=SimpleNamespace(num_cached_tokens=32))
    miss = SimpleNamespace(start=0, end=40, seq=SimpleNamespace(num_cached_tokens=0))
    decode = SimpleNamespace(start=45, end=46, seq=SimpleNamespace(num_cached_tokens=32))
    assert N.restart_positions(hit) == range(0, 8) and N.restart_positions(miss) == range(0, 40)
    assert N.restart_positions(decode) == range(13, 14)  # every later token of the request too


def test_position_fix_checker(lm, groups):
    model, tok = lm
    assert T.check_position_fix(lambda item: range(item.start, item.end), model, tok, groups[1])
    assert not T.check_position_fix(N.restart_positions, model, tok, groups[1])
    assert not T.check_position_fix(None, model, tok, groups[1])
    assert "raised ZeroDivisionError" in str(
        T.check_position_fix(lambda item: 1 / 0, model, tok, groups[1])
    )


# --- notebook 05's opened engine, real-text groups, recorded benchmark ----------------------------

def test_pick_model_and_bench_record(tmp_path):
    import json

    path = tmp_path / "bench.json"
    assert T.pick_model("auto", True) is None and T.pick_model("auto", False) == "smollm2"
    assert T.pick_model("x", True) == "x"
    assert T.latest_bench("smollm2", path) is None
    path.write_text(
        json.dumps(
            {
                "model": {"config": "smollm2"},
                "workload": {"prefix_tokens": 512},
                "systems": [{"system": "kvlab", "mode": "shared", "error": None}],
                "ratios": [],
            }
        )
    )
    report = T.latest_bench("smollm2", path)
    assert report["path"] == str(path) and T.latest_bench(None, path) is None
    table, _ = T.bench_tables(report)
    assert table["error"].tolist() == [""]


def test_real_groups_on_a_chatml_tokenizer(lm):
    """real_groups builds the three groups from ChatML text; the bundled tokenizer speaks ChatML
    too."""
    tok = lm[1]
    g = T.real_groups(tok, n=2, questions=2, block_size=BLOCK)
    g1, g2, g3 = g[1], g[2], g[3]
    assert len(g1) == 2 * 2 + 4 and sum(m.get("kind") == "translation" for m in g1.meta) == 4
    for b in g2.served():
        a, off = g2.meta[b]["donor"], g2.meta[b]["offset"]
        assert off % BLOCK == 0 and g2.prompts[a][off:] == g2.prompts[b]
    for b in g3.served():
        m = g3.meta[b]
        assert m["other_answer"] != m["expected"] and m["beyond_prompt"] != g3.prompts[b]
        assert g3.prompts[b][: m["prefix_tokens"]] == m["beyond_prompt"][: m["prefix_tokens"]]


def test_content_keyed_cache_goes_in_through_the_engines_cache_argument(lm):
    model, tok = lm
    engine = Engine(model, tok, cache=N.ContentKeyedBlockManager(16, BLOCK))
    bm = engine.block_manager
    assert isinstance(bm, N.ContentKeyedBlockManager) and isinstance(bm.pool, N.ContentKeyedPool)
    assert engine.scheduler.block_manager is bm and bm.hash_fn is N.content_hash
    # the bug itself: the same 16 tokens hit after another first block (no parent in the key)
    a, b = list(range(1, 17)), list(range(40, 56))
    engine.generate([b + a + [7]], SamplingParams(max_tokens=1))
    out = engine.generate([a + [9]], SamplingParams(max_tokens=1))
    assert out[0].num_cached_tokens == BLOCK


def test_timing_repeats_give_a_spread_and_evidence_says_how_many_runs(lm):
    model, tok = lm
    small = W.seed_groups(tok, n=2, block_size=BLOCK, max_tokens=2)
    table, runs = T.table_36(model, tok, small, repeats=3, block_size=BLOCK, timed=[1])
    d = table.set_index(["group", "mode"])
    assert (d.loc[1, "timed runs"] == 3).all() and (d.loc[2, "timed runs"] == 0).all()
    assert all(len(r) == 3 for r in d.loc[1, "TTFT runs (ms)"])
    t1 = d.loc[1]
    assert (t1["TTFT min (ms)"] <= t1["TTFT (ms)"]).all() and (
        t1["TTFT (ms)"] <= t1["TTFT max (ms)"]
    ).all()
    # answers only
    assert d.loc[2, ["TTFT (ms)", "total latency (ms)", "peak KV (KiB)"]].isna().all().all()
    # one definition: the ratio of the medians, the guard's range
    v = T.ttft_verdict(table, 1, "shared (correct)")
    assert v.value == pytest.approx(
        t1.loc["shared (correct)", "TTFT (ms)"] / t1.loc["isolated", "TTFT (ms)"]
    )
    assert (
        v.lo <= v.value <= v.hi
        and 0 < t1.loc["shared (correct)", "ideal"] < 1 == t1.loc["isolated", "ideal"]
    )
    cmp = T.compare_with_article(table).set_index(["group", "mode"])
    # the table and the sentence agree
    assert cmp.loc[(1, "shared (correct)"), "TTFT ratio, ours"] == v.value
    text = T.ttft_text(table, 1, "shared (correct)")
    assert (f"TTFT x{v.value:.2f} (x{v.lo:.2f}-x{v.hi:.2f} over 3 interleaved runs" in text) == v.ok
    # otherwise the helper's own words: a null result or a disturbed run
    assert v.ok or text == v.text
    assert T.ttft_verdict(table, 2, "shared (wrong)") is None
    ev = T.evidence(table)
    assert text in ev["identical-prefix"]
    assert (
        "TTFT" not in ev["overlap-different-start"]
        and "requests: " in ev["overlap-different-start"]
    )
    # the answers-only isolated row ran without the donors, the scored requests all have outputs
    iso2 = runs[(2, "isolated")]["outputs"]
    assert all(iso2[i] is None for i, m in enumerate(small[2].meta) if m["role"] == "donor")
    assert all(iso2[i] is not None for i in small[2].served())
    assert (d.loc[2, "requests"] == len(small[2].served())).all() and d.loc[
        (2, "shared (correct)"), "identical"
    ] == 1
    # the full run is the one kept, not a prefill-only one
    assert runs[(1, "isolated")]["outputs"][0].output_ids
    assert all(len(o.output_ids) == 2 for i, o in enumerate(runs[(1, "isolated")]["outputs"]))


def test_real_groups_score_more_requests_in_groups_2_and_3(lm):
    tok = lm[1]
    g = T.real_groups(
        tok, n=1, questions=1, block_size=BLOCK, translations=0, n_wrong=6, wrong_questions=2
    )
    g2, g3 = g[2], g[3]
    assert len(g2.served()) == len(g3.served()) == 6 and len(g2) == 12 and len(g3) == 9
    # no two scored requests of group 2 share a start
    assert len({g2.meta[b]["seed"] for b in g2.served()}) == 6
    # B's whole text reappears in its own donor after the block-aligned preamble
    for b in g2.served():
        a, off = g2.meta[b]["donor"], g2.meta[b]["offset"]
        assert g2.prompts[a][off:] == g2.prompts[b]
    assert len({g3.meta[b]["question"] for b in g3.served()}) == 2
    with pytest.raises(ValueError, match="multiple"):
        T.real_groups(tok, n=1, n_wrong=5, wrong_questions=2)
    for b in g3.served():
        m = g3.meta[b]
        assert tok.decode(m["beyond_prompt"]).rstrip().endswith("assistant") and m[
            "question"
        ] in tok.decode(m["beyond_prompt"])


def test_table36_figure_draws_bars_only_for_timed_rows_and_keeps_the_legend_off_the_points():
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    nan = float("nan")
    table = pd.DataFrame(
        {
            "group": [1, 1, 2, 2],
            "mode": ["isolated", "shared (correct)", "isolated", "shared (wrong)"],
            "TTFT (ms)": [10.0, 6.0, nan, nan],
            "TTFT min (ms)": [9.0, 5.0, nan, nan],
            "TTFT max (ms)": [12.0, 6.5, nan, nan],
            "token agreement": [1.0, 1.0, 1.0, 0.1],
            "recall": [1.0, 1.0, 0.9, 0.25],
        }
    )
    fig = T.fig_table36(table)
    a, b = fig.axes
    # no empty bars for untimed group 2
    assert len(a.patches) == 2 and "2: answers only" in a.get_title()
    # min-max of the timed runs
    (whiskers,) = [c for c in a.collections if len(c.get_segments()) == 2]
    assert sorted(tuple(seg[:, 1]) for seg in whiskers.get_segments()) == [(5.0, 6.5), (9.0, 12.0)]
    fig.canvas.draw()
    legend = b.get_legend().get_window_extent()
    points = b.transData.transform([(x, y) for x, y in enumerate(table["recall"])])
    assert not any(legend.contains(px, py) for px, py in points)


def test_the_position_verdict_cites_notebook_03s_experiment_with_its_n(measured, capsys):
    """Issue 50: 05's group-1 line and its "positions-agree" evidence rest on
    ``position_experiment``'s n, printed."""
    import pandas as pd

    from kvlab.lessons import nb03_position as X

    table, _ = measured
    positions = pd.DataFrame(
        {"prompts": [24, 24], "identical": [1.0, 0.25], "recalled": [0.875, 0.0]},
        index=[X.RIGHT, X.RESTART],
    )
    T.say_wrong_shares(table, positions)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("group 1,")]
    assert "(n = 24 prompts): 75% of answers changed, recall 0% (right positions 88%)" in line
    assert T.restart_text(positions) in T.evidence(table, positions)["positions-agree"]
    assert "n = " not in T.evidence(table)["positions-agree"]
