"""Notebook 03's build step (RoPE for a suffix after a cached prefix): checker, hints, tested
solution."""

import torch

from kvlab.built import nb03 as B
from kvlab.lessons import nb03_position as X


def test_solution_passes_and_equals_apply_rope(lm):
    model, tok = lm
    assert X.check_rope_suffix(X.solution_rope_suffix, model, tok)
    k = torch.randn(1, 2, 5, 32, generator=torch.Generator().manual_seed(0))
    want = B.apply_rope(k, torch.arange(37, 42), 10000.0)
    assert torch.allclose(X.solution_rope_suffix(k, 37, 10000.0), want, atol=1e-5)


def test_the_notebook_rope_at_the_right_positions_passes(lm):
    model, tok = lm
    assert X.check_rope_suffix(
        lambda k, p, theta: B.apply_rope(k, torch.arange(p, p + k.shape[-2]), theta), model, tok
    )


def test_wrong_answers_fail_with_a_hint_that_names_the_mistake(lm):
    model, tok = lm
    blank = X.check_rope_suffix(None, model, tok)
    assert not blank and "prefix_len" in str(blank)
    at_zero = X.check_rope_suffix(
        lambda k, p, theta: B.apply_rope(k, torch.arange(k.shape[-2]), theta), model, tok
    )
    assert not at_zero and "positions 0, 1" in str(at_zero)

    def interleaved(k, p, theta):  # pairs (2i, 2i+1): the other convention, wrong for this model
        x = k.reshape(*k.shape[:-1], -1, 2)
        inv = B.inverse_frequencies(k.shape[-1], theta)
        ang = torch.arange(p, p + k.shape[-2])[:, None].float() * inv
        a, b = x[..., 0], x[..., 1]
        return torch.stack(
            [a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1
        ).reshape(k.shape)

    wrong_pairs = X.check_rope_suffix(interleaved, model, tok)
    assert not wrong_pairs and "differ from the model's" in str(wrong_pairs)
    unturned = X.check_rope_suffix(lambda k, p, theta: k, model, tok)
    assert not unturned
    # the shape is checked
    assert not X.check_rope_suffix(lambda k, p, theta: k[..., :-1], model, tok)


def test_keys_before_rope_turned_are_the_cached_keys(lm):
    model, tok = lm
    ids = tok("你是一个专业的翻译助手，请将以下内容翻译成英文：今天天气很好。").input_ids
    with torch.no_grad():
        cached = model(input_ids=torch.tensor([ids]), use_cache=True).cache.layers[0].keys
    k = X.keys_before_rope(model, ids)
    turned = B.apply_rope(k, torch.arange(len(ids)), B.rope_theta(model.config))
    assert torch.allclose(turned, cached, atol=1e-5)
