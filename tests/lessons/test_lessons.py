"""kvlab.lessons: what the notebooks print and draw agrees with the numbers they measured (issue
27)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _draw(fig) -> None:
    fig.canvas.draw()
    plt.close(fig)


# ----------------------------------------------------------------------------- CJK glyphs

def test_the_shipped_cjk_font_is_registered_and_draws_chinese_without_missing_glyphs():
    from kvlab.lessons import common

    # the subset in data/fonts, not whatever the machine has
    assert common.CJK_FONT == common.CJK_FAMILY
    assert common.label("口令是什么？") == "口令是什么？"  # no \\u escapes
    fig, ax = plt.subplots()
    ax.set_title("你是一个专业的翻译助手，请将以下内容翻译成英文：「今天天气很好。」")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Glyph .* missing")
        _draw(fig)


def test_the_shipped_font_has_every_character_the_series_draws_and_its_licence():
    spec = importlib.util.spec_from_file_location(
        "make_cjk_font", ROOT / "scripts" / "make_cjk_font.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.missing() == []
    fonts = ROOT / "data" / "fonts"
    assert (fonts / "kvlab-cjk-sans.otf").stat().st_size < 400_000
    assert "SIL Open Font License" in (fonts / "OFL.txt").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- words from numbers

def test_share_word_names_all_most_half_and_none():
    from kvlab.lessons.common import share_word

    assert [share_word(k, 24) for k in (24, 23, 12, 3, 0)] == [
        "all",
        "most",
        "half",
        "a minority",
        "none",
    ]
    with pytest.raises(ValueError):
        share_word(3, 2)


def test_policy_sentences_name_a_tie_instead_of_one_policy():
    from kvlab.built import nb09 as R

    df = pd.DataFrame(
        [
            {
                "policy": p,
                "replicas": 2,
                "hit_rate": h,
                "ttft_p99": 0.03,
                "ttft_mean": 0.01,
                "imbalance": 1.0,
            }
            for p, h in (
                ("round_robin", 0.824),
                ("least_loaded", 0.824),
                ("kv_aware", 0.824),
                ("prefix_tree", 0.882),
            )
        ]
    )
    line = R.policy_sentences(df)[0]
    assert "prefix_tree hits most (88.2 %)" in line
    assert "round_robin, least_loaded and kv_aware tie for the least (82.4 %)" in line


def test_weight_sentence_reads_the_whole_sweep_not_its_two_ends():
    from kvlab.built import nb09 as R

    df = pd.DataFrame({"weight": [0, 0.25, 1, 4, 16], "hit_rate": [0.68, 0.76, 0.79, 0.808, 0.804],
                       "imbalance": [1.636, 1.245, 1.343, 2.0, 2.27]})
    text = R.weight_sentence(df)
    assert "trade Dynamo's cost intends" not in text
    assert "lowest imbalance at w = 0.25 (1.25)" in text and "Highest hit rate at w = 4" in text
    monotone = df.assign(hit_rate=[0.6, 0.7, 0.75, 0.8, 0.81], imbalance=[1.0, 1.1, 1.2, 1.5, 2.0])
    assert "trade Dynamo's cost intends" in R.weight_sentence(monotone)


def test_index_sentence_compares_the_router_index_with_the_replicas_caches():
    from kvlab.built import nb09 as R
    from kvlab.lessons.nb09_routing import chat_workload

    res, replicas = R.simulate_with_replicas(chat_workload(True, 0), 2, "kv_aware", num_blocks=64)
    assert "the same hashes on every replica" in R.index_sentence(res, replicas)
    # a replica that lost its cache behind the router's back
    replicas[0].block_manager.pool.cached.clear()
    assert "DIFFERENT on replica(s) [0]" in R.index_sentence(res, replicas)


def test_decision_table_evidence_does_not_call_one_timing_run_evidence():
    from kvlab.lessons import nb05_table36 as T

    def rows(n):
        return pd.DataFrame(
            [
                {
                    "group": g,
                    "mode": m,
                    "requests": 4,
                    "identical": 1.0,
                    "cached tokens": 0.0,
                    "recall": float("nan") if g == 2 else 1.0,
                    "answered A's passphrase": 0.0,
                    "TTFT runs (ms)": (t,) * n,
                    "ideal": 1.0 if m == "isolated" else 0.5,
                }
                for g in (1, 2, 3)
                for m, t in (
                    ("isolated", 10.0),
                    ("shared (correct)", 11.4),
                    ("shared (wrong)", 8.2),
                )
            ]
        )

    one = T.evidence(rows(1))
    assert "TTFT x1.14 (1 run: a timing, not evidence)" in one["identical-prefix"]
    assert "recall nan" not in one["same-start"]
    assert "not evidence" not in T.evidence(rows(3))["identical-prefix"]
    assert (
        "TTFT x0.82 (x0.82-x0.82 over 3 interleaved runs, ideal x0.50)"
        in T.evidence(rows(3))["positions-agree"]
    )


def test_fix_labels_tell_two_fixes_of_one_kind_apart():
    from kvlab.doctor import report as D

    chain = [
        {"step": "as logged", "kind": ""},
        {
            "step": "per-request field (timestamp) in system message: Current time:",
            "kind": "volatile",
        },
        {"step": "per-request field (id) in system message: Request id:", "kind": "volatile"},
        {"step": "documents in varying order", "kind": "order"},
    ]
    labels = D.fix_labels(chain)
    assert labels == [
        "as logged",
        "+ volatile: Current time:",
        "+ volatile: Request id:",
        "+ order",
    ]


# ----------------------------------------------------------------------------- figures

def _inside(inner, outer) -> bool:
    return (
        inner.x0 >= outer.x0
        and inner.x1 <= outer.x1
        and inner.y0 >= outer.y0
        and inner.y1 <= outer.y1
    )


def test_policy_figure_keeps_its_legend_off_the_bars():
    from kvlab.lessons import nb09_routing as R

    df = pd.DataFrame([{"policy": p, "replicas": n, "hit_rate": 0.8, "ttft_p99": 0.03}
                       for p in ("round_robin", "kv_aware") for n in (1, 2, 4)])
    fig = R.fig_policies(df, "t")
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            # beside the axes, not over the data
            assert legend.get_window_extent().x0 >= ax.get_window_extent().x1
    assert sum(ax.get_legend() is not None for ax in fig.axes) == 1
    plt.close(fig)


def test_radix_ttft_figure_shows_at_most_twelve_request_ticks():
    from kvlab.lessons import nb04b_radix as L

    results = [
        {"cache": c, "ttft": [0.001] * 24, "cached": [0] * 24}
        for c in ("blocks 16", "radix page 1")
    ]
    fig = L.fig_ttft(results, [f"g1 #{i}" for i in range(24)])
    assert all(len(ax.get_xticks()) <= 12 for ax in fig.axes)
    plt.close(fig)


def test_outcome_bars_label_a_zero_bar():
    from kvlab.lessons import nb03_position as X

    summary = pd.DataFrame(
        {"prompts": [4, 4], "identical": [1.0, 0.0], "recalled": [1.0, 0.0]},
        index=["right", "wrong"],
    )
    fig = X.fig_position_cases(summary, "t")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("0%") == 2 and texts.count("100%") == 2
    plt.close(fig)


def test_layer_error_figure_leaves_room_around_its_y_label_and_thins_30_layer_ticks():
    from kvlab.lessons import nb03_position as X

    rows = [{"treatment": t, "tensor": k, "layer": layer, "relative error": 0.1}
            for t in (X.AS_IS, X.REROTATED) for k in ("K", "V") for layer in range(30)]
    fig = X.fig_layer_errors(pd.DataFrame(rows), "SmolLM2")
    fig.canvas.draw()
    box = fig.axes[0].yaxis.label.get_window_extent()
    # not edge to edge, where it clips
    assert _inside(box, fig.bbox) and box.height < 0.75 * fig.bbox.height
    assert all(len(ax.get_xticks()) <= 15 for ax in fig.axes)
    plt.close(fig)


def test_rays_token_notice_is_filtered_and_nothing_else():
    import logging

    from kvlab.cluster import replica as R

    R.quiet_ray_token_notice()
    R.quiet_ray_token_notice()  # twice: still one filter
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    assert sum(isinstance(f, R._DropRayTokenNotice) for f in log.filters) == 1

    def passes(msg: str) -> bool:
        return log.filter(
            logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, None, None)
        )

    assert not passes(R.RAY_TOKEN_NOTICE + ". Set RAY_AUTH_MODE=disabled to opt out.")
    assert passes(
        "Token authentication is disabled for this Ray cluster. Anyone with network access ..."
    )


def test_nb00_live_start_sees_the_second_request_hit(bundled):
    """Notebook 00's top-down start: the openai client through kvlab serve (in-process), cached
    tokens and /metrics."""
    import openai
    from starlette.testclient import TestClient

    from kvlab.built import nb00 as B
    from kvlab.engine import Engine
    from kvlab.lessons import nb00_passphrase as E
    from kvlab.serve import ServeConfig, create_app

    model, tok = bundled
    app = create_app(Engine(model, tok, num_blocks=64, block_size=16), ServeConfig(model_name="m"))
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        system, texts = E.ARTICLE_TRANSLATION
        before = B.cache_counters("http://testserver/v1", http)
        replies = [B.ask(client, "m", system, t, max_tokens=3) for t in texts]
        after = B.cache_counters("http://testserver/v1", http)
    assert replies[0]["cached_tokens"] == 0 and replies[1]["cached_tokens"] >= 16
    assert after["hits"] - before["hits"] == replies[1]["cached_tokens"]
    assert after["queries"] - before["queries"] == sum(r["prompt_tokens"] for r in replies)
    assert all(r["ttft_s"] > 0 and r["text"] for r in replies)


def test_reveal_is_collapsed_in_html_and_plain_in_text():
    import pandas as pd

    from kvlab.lessons.common import Reveal

    r = Reveal(
        "Predicted? Open: the measured answer", "recall 50% <of> 8", pd.DataFrame({"a": [1]})
    )
    page = r._repr_html_()
    assert (
        page.startswith("<details><summary>Predicted? Open: the measured answer</summary>")
        and "open" not in page[:9]
    )
    assert "recall 50% &lt;of&gt; 8" in page and "<table" in page and page.endswith("</details>")
    assert repr(r).splitlines()[:2] == ["Predicted? Open: the measured answer", "recall 50% <of> 8"]
