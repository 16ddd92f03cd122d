"""From-scratch attention: equals PyTorch's, cached decode equals recomputation, GQA as in transformers."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.built import nb01 as N
from kvlab.lessons import nb01_attention as A
from kvlab.lessons.nb01_attention import fig_attention_weights, fig_kv_memory, fig_step_cost
from kvlab.lessons.nb02_prefix import fig_prefill_ratio, fig_token_boundary


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


@pytest.mark.parametrize("n_heads,n_kv_heads", [(1, 1), (4, 4), (4, 2), (8, 1)],
                         ids=["single-head", "multi-head", "GQA-2-groups", "MQA"])
def test_cached_decode_equals_recompute(n_heads, n_kv_heads):
    assert N.cached_vs_recompute(n_heads, n_kv_heads, d_model=32, n_layers=2, seq=12) <= 1e-5


def test_cached_decode_is_not_trivially_equal():
    """The equality test can fail: dropping the cache between steps changes the logits."""
    torch.manual_seed(0)
    model = N.TinyDecoder(64, 32, 2, 4, 2).eval()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        full = model(ids)
        amnesiac = torch.stack([model(ids[:, t:t + 1], N.KVCache())[:, -1] for t in range(8)], dim=1)
    assert float((amnesiac - full).abs().max()) > 1e-2


def test_repeat_kv_matches_transformers():
    from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(N.repeat_kv(x, 4), hf_repeat_kv(x, 4))
    assert N.repeat_kv(x, 1) is x


def test_gqa_layer_equals_multi_head_with_duplicated_kv_weights():
    """A GQA layer is a multi-head layer whose K/V projections repeat per group."""
    torch.manual_seed(0)
    gqa = N.SelfAttention(32, n_heads=4, n_kv_heads=2)
    mha = N.SelfAttention(32, n_heads=4, n_kv_heads=4)
    hd = gqa.head_dim
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for proj in ("k_proj", "v_proj"):
            w = getattr(gqa, proj).weight.view(2, hd, 32)  # (kv_heads, head_dim, d_model)
            getattr(mha, proj).weight.copy_(w.repeat_interleave(2, dim=0).reshape(4 * hd, 32))
        x = torch.randn(2, 6, 32)
        assert torch.allclose(gqa(x), mha(x), atol=1e-6)


def test_gqa_rejects_uneven_groups():
    with pytest.raises(ValueError, match="multiple"):
        N.SelfAttention(32, n_heads=4, n_kv_heads=3)


def test_last_row_ignores_past_queries_but_not_past_keys_values():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    d = N.last_row_ignores_past_queries(q, k, v)
    assert d["past Q changed"] == 0.0
    assert d["past K changed"] > 1e-3 and d["past V changed"] > 1e-3


def test_kv_cache_appends_crops_and_counts_bytes():
    c = N.KVCache()
    k = torch.zeros(1, 2, 3, 4)
    c.append(0, k, k)
    c.append(1, k, k)
    c.append(0, k[:, :, :1], k[:, :, :1])
    assert c.keys[0].shape == (1, 2, 4, 4) and c.seq_len() == 4
    assert c.nbytes() == (4 + 4 + 3 + 3) * 2 * 4 * 4
    c.crop(2)
    assert c.seq_len() == 2 and c.keys[1].shape[-2] == 2


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
    rows = N.decode_step_cost([4, 8], d_model=32, n_heads=4, n_kv_heads=2, repeats=1)
    assert [r["n"] for r in rows] == [4, 8]
    assert all(r["cached_s"] > 0 and r["recompute_flops"] > r["cached_flops"] for r in rows)


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


def test_check_kv_bytes_and_max_context():
    assert str(A.check_kv_bytes("Qwen2.5-0.5B-Instruct", "bfloat16", None)).startswith("not yet: no answer")
    assert A.check_kv_bytes("Qwen2.5-0.5B-Instruct", "bfloat16", 2 * 24 * 2 * 64 * 2)
    assert not A.check_kv_bytes("Qwen2.5-0.5B-Instruct", "bfloat16", 2 * 24 * 14 * 64 * 2)
    want = 24 * 2**30 // (2 * 32 * 32 * 128 * 2)  # Qwen1.5-7B-Chat fp16: 0.5 MiB per token
    assert A.max_context_tokens({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096},
                                "float16", 24) == want
    assert A.check_max_context("Qwen1.5-7B-Chat", "float16", 24, 1, want)
    assert not A.check_max_context("Qwen1.5-7B-Chat", "float16", 24, 1, want // 2)


def test_viz_figures_are_figures():
    from matplotlib.figure import Figure


    rows = N.decode_step_cost([4, 8], d_model=32, n_heads=4, n_kv_heads=2, repeats=1)
    _, w = N.attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)))
    figs = [fig_step_cost(rows), fig_attention_weights(w[0, 0], list("abcd")),
            fig_kv_memory({"a": 1024, "b": 4096}, 2048, (1, 4), budget_gib=1.0),
            fig_prefill_ratio([{"setting": "x", "ratio": 0.2, "ideal": 0.1}]),
            fig_token_boundary(["a", "b"], ["a", "bc"], 1)]
    assert all(isinstance(f, Figure) for f in figs)
    import matplotlib.pyplot as plt

    for f in figs:
        plt.close(f)


def test_slope_report_compares_measured_and_counted_growth():
    import numpy as np
    import pandas as pd

    n = np.array([64, 128, 256, 512, 1024, 2048])
    cost = pd.DataFrame({"n": n, "recompute_flops": n * 1.0, "recompute_s": n ** 2 * 1e-9,  # quadratic vs linear count
                         "cached_flops": n * 1.0, "cached_s": n * 1e-6})
    lines = N.slope_report(cost, 512)
    assert len(lines) == 4
    assert any("no cache: time x" in s and "(slope 2.00) where the FLOP count says" in s and "(slope 1.00): grew MORE"
               in s for s in lines)
    assert all("with cache" not in s or s.endswith(": grew as counted") for s in lines)
    assert not any(word in s for s in lines for word in ("memory traffic", "per-call", "because"))  # no causes


def test_slope_report_does_not_call_slopes_far_apart_agreeing():
    import numpy as np
    import pandas as pd

    n = np.array([32, 64, 128, 256, 512, 1024])  # notebook 01's run: time slope 0.30 against a counted 0.18
    cost = pd.DataFrame({"n": n, "recompute_flops": n * 1.0, "recompute_s": n * 1e-6,
                         "cached_flops": n ** 0.18, "cached_s": n ** 0.30 * 1e-6})
    cached = next(s for s in N.slope_report(cost, 4096) if "with cache" in s)
    assert "(slope 0.30)" in cached and cached.endswith("grew MORE than counted")


def test_notebook_01_is_the_source_of_what_it_teaches():
    """The mechanism lives in notebook 01's '#| export' cells (kvlab.built.nb01); the lesson module keeps checkers."""
    for name in ("causal_mask", "attention", "repeat_kv", "KVCache", "decode_logits", "decode_step_flops",
                 "time_interleaved", "ratio_verdict", "curve_verdict", "SelfAttention", "TinyDecoder",
                 "decode_with_step", "cached_vs_recompute", "stepwise_logits", "last_row_ignores_past_queries",
                 "decode_step_cost", "slope_report", "quadratic_crossover"):
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
    hf = AutoConfig.for_model("qwen2", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                              hidden_size=256)  # a transformers config object, no head_dim given
    assert kv_bytes_per_token_by_hand(hf, dtype) == kv_bytes_per_token(hf, dtype)


def test_decode_step_cost_is_timed_interleaved_with_min_max():
    rows = N.decode_step_cost([4, 8], d_model=32, n_heads=4, n_kv_heads=2, repeats=3)
    for r in rows:
        t = r["timings"]
        assert set(t) == {"cached", "recompute"} and len(t["cached"].seconds) == 3
        assert r["cached_s"] == t["cached"].median and t["cached"].lo <= r["cached_s"] <= t["cached"].hi


def test_slope_report_prints_re_run_instead_of_a_cause_for_an_outlier():
    """Notebook 01's run: the cached step jumped 1.30e-03 -> 5.54e-02 s from n = 1024 to 2048, once printed as
    'time slope 5.41 ... the count leaves out memory traffic'."""
    import numpy as np
    import pandas as pd

    n = np.array([32, 64, 128, 256, 512, 1024, 2048])
    cached_s = np.array([1.0e-3, 1.05e-3, 1.1e-3, 1.15e-3, 1.2e-3, 1.30e-3, 5.54e-2])
    cost = pd.DataFrame({"n": n, "recompute_flops": n ** 2 * 1.0, "recompute_s": n ** 2 * 1e-8,
                         "cached_flops": 1e6 + 1e3 * n, "cached_s": cached_s})
    lines = N.slope_report(cost, 1024)
    cached = [s for s in lines if "with cache" in s]
    assert len(cached) == 2  # the jump sits at the edge of the n >= 1024 range: no slope in either range
    assert all("with cache: outlier — re-run (x42.6 from 1024 to 2048" in s and "slope" not in s for s in cached)
    assert all("outlier" not in s and "(slope " in s for s in lines if "no cache" in s)
