"""Notebook 04b: the comparison it writes (kvlab.built.nb04b) runs every cache on every trace with
the same capacity, the sentences come from the rows, its walk matches the tree, and the exercise
checkers (the lesson module) accept right answers, hint on blank ones and never leak the expected
value."""

from kvlab.built import nb04b as N
from kvlab.lessons import nb04b_radix as L
from kvlab.lessons.common import Verdict


def test_compare_rows_and_summary():
    traces = {"chat": N.chat_trace(3, turns=2), "short": N.short_prefix_trace(12),
              "few-shot": N.fewshot_trace(10)}
    rows = N.compare(traces)
    assert len(rows) == len(traces) * len(N.CACHES)
    by = {(r["workload"], r["cache"]): r for r in rows}
    for w in traces:
        # same capacity in tokens
        assert len({by[(w, c)]["ample pool (tokens)"] for c in N.CACHES}) == 1
        assert len({by[(w, c)]["small pool (tokens)"] for c in N.CACHES}) == 1
        assert by[(w, "radix page 1")]["cached tokens"] >= by[(w, "blocks 16")]["cached tokens"]
        assert by[(w, "radix page 16")]["cached tokens"] == by[(w, "blocks 16")]["cached tokens"]
    assert (
        by[("short", "blocks 16")]["cached tokens"]
        == 0
        < by[("short", "radix page 1")]["cached tokens"]
    )
    lines = N.summary(rows)
    assert str(by[("chat", "radix page 1")]["cached tokens"]) in lines[0]
    for fig in (L.fig_hit_rate(rows), L.fig_pressure(rows)):
        assert fig.axes


def test_article_requests_and_tenants():
    rows, tree, show = N.article_requests()
    assert [r["radix page 1"] for r in rows] == [
        0,
        rows[1]["prompt tokens"] - 1,
        rows[2]["system prompt tokens"],
    ]
    assert "你" in tree.dump(show=show)
    assert N.walk(tree.roots[None], list(range(10_000, 10_005))) == 0
    for row, name in zip(rows, "ABC"):
        # every prompt is cached
        assert N.walk(tree.roots[None], tree.seqs[name].token_ids) == row["prompt tokens"]
    t = {r["cache"]: r for r in N.tenant_sharing()}
    public, radix = t["blocks 16, salt after the public prefix"], t["radix page 1, a root per salt"]
    assert public["cached tokens"] > radix["cached tokens"] and public["public hits (blocks)"] > 0
    assert all(r["cross-tenant hits"] == 0 for r in t.values())


def test_checkers():
    right = [L.check_radix_cached(lambda n, p: (n - 1) // p * p),
             L.check_gain(lambda s, n, b: min(s, n - 1) - min(s, n - 1) // b * b)]
    assert all(isinstance(v, Verdict) and v for v in right)
    for check in (L.check_radix_cached, L.check_gain):
        blank = check(None)
        assert not blank and "no answer yet" in str(blank)
    wrong = L.check_radix_cached(lambda n, p: n)
    assert not wrong and "predicted" in str(wrong)


def test_engine_ttft_interleaves_the_caches_and_keeps_the_outputs():
    import kvlab

    model, tok = kvlab.load_model(None)
    prompts = [list(range(1, 40)), list(range(1, 30)) + [50, 51]]
    caches = {"blocks 16": {}, "radix page 1": {"cache": "radix", "page_size": 1}}
    res = N.engine_ttft(model, tok, prompts, caches, max_tokens=3, num_tokens=1024, repeats=2)
    assert list(res) == list(caches)
    assert res["blocks 16"]["outputs"] == res["radix page 1"]["outputs"]
    assert res["radix page 1"]["cached"][1] == 29 > res["blocks 16"]["cached"][1] == 16
    for r in res.values():
        assert len(r["timing"].seconds) == 2 and all(s > 0 for s in r["timing"].seconds)
