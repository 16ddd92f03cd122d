"""From-scratch attention: equals PyTorch's, cached decode equals recomputation, GQA as in
transformers."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.built import nb01 as N
from kvlab.lessons import nb01_attention as A
from kvlab.lessons.nb01_attention import fig_attention_weights, fig_step_cost
from kvlab.lessons.nb02_prefix import fig_token_boundary


def test_attention_equals_torch_sdpa_full_and_decode():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 16) for _ in range(3))
    out, w = N.attention(q, k, v)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 7))
    # a decode step: one query at the last position sees every key (is_causal=False, no mask needed)
    out1, _ = N.attention(q[:, :, -1:], k, v)
    assert torch.allclose(out1, F.scaled_dot_product_attention(q[:, :, -1:], k, v), atol=1e-6)
    assert torch.allclose(out1, out[:, :, -1:], atol=1e-6)


def test_causal_mask_places_queries_at_the_end():
    m = N.causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert torch.equal(N.causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.integers(1, 8))
def test_weights_are_causal_distributions(b, h, t, d):
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    _, w = N.attention(q, k, v)
    assert torch.allclose(w.sum(-1), torch.ones(b, h, t), atol=1e-5)
    assert float(w.triu(diagonal=1).abs().max()) == 0.0  # no weight on the future


def test_cached_decode_equals_one_pass_in_every_layout():
    from kvlab.lessons import solutions as SOL

    table = A.cached_vs_recompute(SOL.build_01_decode_step, seq=12)
    assert list(table.attention) == ["single head", "multi-head", "grouped-query", "multi-query"]
    assert (table.iloc[:, -1] <= 1e-5).all()


def test_cached_decode_is_not_trivially_equal():
    """The equality test can fail: a step that forgets the cache changes the logits."""
    from kvlab.lessons import solutions as SOL

    def forgetful(cache, layer, q, k, v):
        return SOL.build_01_decode_step({}, layer, q, k, v)

    assert A.cached_vs_recompute(forgetful, seq=8).iloc[:, -1].min() > 1e-2


def test_forgetting_the_real_models_cache_is_measured(bundled):
    model, tok = bundled
    from kvlab.engine.models import encode

    d = A.stepwise_vs_one_pass(
        model, encode(tok, "<|im_start|>system\n你是一个翻译助手<|im_end|>\n")[:12]
    )
    assert d["with the cache"] <= 1e-4 and d["with the cache: argmax agrees"] == 1.0
    assert d["forgetting the cache"] > 1e-2


def test_repeat_kv_matches_transformers():
    from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(N.repeat_kv(x, 4), hf_repeat_kv(x, 4))
    assert N.repeat_kv(x, 1) is x


def test_toy_decoder_rejects_uneven_groups():
    with pytest.raises(ValueError, match="multiple"):
        A.TinyDecoder(64, 32, 2, n_heads=4, n_kv_heads=3)


def test_last_row_ignores_past_queries_but_not_past_keys_values():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    d = N.last_row_ignores_past_queries(q, k, v)
    assert d["past Q changed"] == 0.0
    assert d["past K changed"] > 1e-3 and d["past V changed"] > 1e-3


def test_decode_flops_linear_with_cache_quadratic_without():
    f = lambda n, cache: N.decode_step_flops(n, 64, 4, 2, use_cache=cache)  # noqa: E731
    # with the cache: constant + linear; second differences vanish
    assert f(300, True) - 2 * f(200, True) + f(100, True) == 0
    # without: the n x n score matrix makes the second difference positive and constant
    d2 = f(300, False) - 2 * f(200, False) + f(100, False)
    assert d2 > 0 and d2 == f(400, False) - 2 * f(300, False) + f(200, False)
    # hand count at n=1 with the cache: projections 2*64*16*(2*4+2*2) + attention 4*4*16
    assert f(1, True) == 2 * 64 * 16 * 12 + 4 * 4 * 16


def test_decode_step_cost_rows():
    rows = A.decode_step_cost([4, 8], d_model=32, n_heads=4, n_kv_heads=2, repeats=1)
    assert list(rows.n) == [4, 8]
    assert (rows.cached_s > 0).all() and (rows.recompute_flops > rows.cached_flops).all()


def _my_gqa(q, k, v):
    b, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.view(b, kvh, h // kvh, t, d)  # query heads grouped by the KV head they read
    s = qg @ k[:, :, None].transpose(-2, -1) / d**0.5  # (B, KVH, G, T, T)
    s = s.masked_fill(~N.causal_mask(t, t), float("-inf"))
    return (s.softmax(-1) @ v[:, :, None]).reshape(b, h, t, d)


def test_check_gqa_attention():
    assert str(A.check_gqa_attention(None)).startswith("not yet: no answer")
    assert A.check_gqa_attention(_my_gqa)
    no_mask = lambda q, k, v: N.attention(q, N.repeat_kv(k, 3), N.repeat_kv(v, 3), causal=False)[0]  # noqa: E731
    assert not A.check_gqa_attention(no_mask)
    wrong_grouping = lambda q, k, v: N.attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))[0]  # noqa: E731
    assert not A.check_gqa_attention(wrong_grouping)
    assert "raised" in str(A.check_gqa_attention(lambda q, k, v: 1 / 0))


def test_check_kv_bytes():
    assert str(A.check_kv_bytes("Qwen2.5-0.5B-Instruct", "bfloat16", None)).startswith(
        "not yet: no answer"
    )
    assert A.check_kv_bytes("Qwen2.5-0.5B-Instruct", "bfloat16", 2 * 24 * 2 * 64 * 2)
    assert not A.check_kv_bytes("Qwen2.5-0.5B-Instruct", "bfloat16", 2 * 24 * 14 * 64 * 2)


def test_viz_figures_are_figures():
    from matplotlib.figure import Figure


    rows = A.decode_step_cost([4, 8], d_model=32, n_heads=4, n_kv_heads=2, repeats=1)
    _, w = N.attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)))
    figs = [fig_step_cost(rows), fig_attention_weights(w[0, 0], list("abcd")),
            fig_token_boundary(["a", "b"], ["a", "bc"], 1)]
    assert all(isinstance(f, Figure) for f in figs)
    import matplotlib.pyplot as plt

    for f in figs:
        plt.close(f)


def _cost(n, recompute_s, cached_s, recompute_flops, cached_flops, spread=1.01):
    """A decode_step_cost table from given medians: three repeats each, within ``spread`` of the
    median."""
    import pandas as pd

    from kvlab.lessons.timing import Timing

    def t(name, x):
        return Timing(name, (x / spread, x, x * spread))

    return pd.DataFrame(
        {
            "n": n,
            "recompute_s": recompute_s,
            "cached_s": cached_s,
            "recompute_flops": recompute_flops,
            "cached_flops": cached_flops,
            "timings": [
                {"recompute": t("recompute", r), "cached": t("cached", c)}
                for r, c in zip(recompute_s, cached_s)
            ],
        }
    )


def test_step_cost_verdicts_compare_measured_and_counted_growth():
    import numpy as np

    n = np.array([64, 128, 256, 512, 1024, 2048])
    # recompute: quadratic time vs a linear count
    cost = _cost(n, n ** 2 * 1e-9, n * 1e-6, n * 1.0, n * 1.0)
    lines = A.step_cost_verdicts(cost, 512)
    assert lines[0].startswith("n = 2048: the cached step is x") and len(lines) == 5
    assert any(
        s.startswith("no cache, n <= crossover")
        and "(slope 2.00) where the FLOP count says" in s
        and s.endswith("(slope 1.00): grew MORE than counted")
        for s in lines
    )
    assert all(s.endswith(": grew as counted") for s in lines if s.startswith("with cache"))
    assert not any(
        word in s for s in lines for word in ("memory traffic", "per-call", "because", "outlier")
    )


def test_step_cost_verdicts_do_not_call_slopes_far_apart_agreeing():
    import numpy as np

    # notebook 01's run: time slope 0.30 against a counted 0.18
    n = np.array([32, 64, 128, 256, 512, 1024])
    cost = _cost(n, n * 1e-5, n ** 0.30 * 1e-6, n * 1.0, n ** 0.18)
    cached = next(s for s in A.step_cost_verdicts(cost, 4096) if s.startswith("with cache"))
    assert "(slope 0.30)" in cached and cached.endswith("grew MORE than counted")


def test_overlapping_speed_up_reads_as_no_measurable_difference():
    import numpy as np

    n = np.array([32, 64])
    cost = _cost(n, [1e-3, 1.0e-3], [1e-3, 0.99e-3], n * 2.0, n * 1.0, spread=1.2)
    assert A.step_cost_verdicts(cost, 512)[0].startswith(
        "n = 64: no measurable difference at n = 64: the ranges overlap"
    )


def test_notebook_01_is_the_source_of_what_it_teaches():
    """The mechanism lives in notebook 01's '#| export' cells (kvlab.built.nb01); the lesson module
    runs and checks."""
    for name in (
        "causal_mask",
        "attention",
        "repeat_kv",
        "decode_step_flops",
        "last_row_ignores_past_queries",
        "kv_bytes_per_token_by_hand",
    ):
        assert getattr(N, name).__module__ == "kvlab.built.nb01", name
    assert A.attention is N.attention  # the checkers use the notebook's attention


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", torch.bfloat16])
def test_kv_bytes_by_hand_equals_the_library_on_every_shipped_config(dtype):
    from transformers import AutoConfig

    from kvlab.built.nb01 import kv_bytes_per_token_by_hand
    from kvlab.engine.models import CONFIGS_DIR, kv_bytes_per_token, load_public_config

    names = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
    assert len(names) >= 4
    for name in names:
        cfg = load_public_config(name)
        assert kv_bytes_per_token_by_hand(cfg, dtype) == kv_bytes_per_token(cfg, dtype), name
    hf = AutoConfig.for_model(
        "qwen2", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, hidden_size=256
    )  # a transformers config object, no head_dim given
    assert kv_bytes_per_token_by_hand(hf, dtype) == kv_bytes_per_token(hf, dtype)


def test_decode_step_cost_is_timed_interleaved_with_min_max():
    rows = A.decode_step_cost([4, 8], d_model=32, n_heads=4, n_kv_heads=2, repeats=3)
    for _, r in rows.iterrows():
        t = r["timings"]
        assert set(t) == {"cached", "recompute"} and len(t["cached"].seconds) == 3
        assert (
            r["cached_s"] == t["cached"].median
            and t["cached"].lo <= r["cached_s"] <= t["cached"].hi
        )


def test_a_jump_the_count_does_not_explain_gets_no_slope():
    """Notebook 01's run: the cached step jumped 1.30e-03 -> 5.54e-02 s from n = 1024 to 2048, once
    printed as 'time slope 5.41 ... the count leaves out memory traffic'."""
    import numpy as np

    n = np.array([32, 64, 128, 256, 512, 1024, 2048])
    cached_s = np.array([1.0e-3, 1.05e-3, 1.1e-3, 1.15e-3, 1.2e-3, 1.30e-3, 5.54e-2])
    lines = A.step_cost_verdicts(_cost(n, n**2 * 1e-8, cached_s, n**2 * 1.0, 1e6 + 1e3 * n), 1024)
    cached = [s for s in lines if s.startswith("with cache")]
    assert (
        cached == [s for s in cached if "x42.6 from 1024 to 2048" in s and "no slopes" in s]
        and len(cached) == 1
    )
    assert all("(slope " in s for s in lines if s.startswith("no cache"))


def test_kv_cache_figure_has_a_colour_bar_for_k_and_for_v(bundled):
    import matplotlib.pyplot as plt

    model, tok = bundled
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([list(range(10, 20))]), use_cache=True).cache
    fig = A.fig_kv_cache(cache)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert sorted(ax.get_ylabel() for ax in bars) == ["K value", "V value"]
    plt.close(fig)
