"""Notebook 00's build exercise (the suffix-only prefill), its prefill timing and its other
runners."""

import torch

from kvlab.built import nb00 as B
from kvlab.engine.models import encode
from kvlab.lessons import nb00_passphrase as E
from kvlab.lessons import passphrase as P
from kvlab.lessons import solutions as SOL
from kvlab.lessons.build import use_reference
from kvlab.lessons.common import Verdict


def _not_yet(v, *words):
    assert isinstance(v, Verdict) and not v and str(v).startswith("not yet: "), v
    for w in words:
        assert w in str(v), (w, str(v))


def test_the_solution_passes_and_a_blank_stub_gets_a_hint(bundled):
    model, tok = bundled
    assert E.check_suffix_prefill(SOL.build_00_suffix_prefill, model, tok)

    def blank(model, cache, prefix_len, suffix_ids):
        raise NotImplementedError("write it")

    _not_yet(E.check_suffix_prefill(blank, model, tok), "no answer yet. Hint: ", "position_ids")
    _not_yet(E.check_suffix_prefill(None, model, tok), "no answer yet")
    _not_yet(E.check_suffix_prefill(lambda *a: 1 / 0, model, tok), "ZeroDivisionError")


def test_wrong_answers_get_the_hint_that_fits(bundled):
    model, tok = bundled

    # positions 0, 1, ... instead of after the prefix
    def restart_positions(model, cache, prefix_len, suffix_ids):
        pos = torch.arange(len(suffix_ids))[None]
        return model(input_ids=torch.tensor([suffix_ids]), position_ids=pos, cache=cache).logits[
            0, -1
        ]

    # transformers counts them from the cache
    def positions_from_the_cache(model, cache, prefix_len, suffix_ids):
        return model(input_ids=torch.tensor([suffix_ids]), cache=cache, use_cache=True).logits[
            0, -1
        ]

    # recomputes the prefix on top of its own cache
    def whole_prompt_again(model, cache, prefix_len, suffix_ids):
        return model(
            input_ids=torch.tensor([list(range(prefix_len)) + suffix_ids]), cache=cache
        ).logits[0, -1]

    def all_logits(model, cache, prefix_len, suffix_ids):  # (1, S, vocab): the last row is taken
        pos = torch.arange(prefix_len, prefix_len + len(suffix_ids))[None]
        return model(input_ids=torch.tensor([suffix_ids]), position_ids=pos, cache=cache).logits

    _not_yet(E.check_suffix_prefill(restart_positions, model, tok), "continue after the prefix")
    _not_yet(E.check_suffix_prefill(whole_prompt_again, model, tok), "feed the suffix alone")
    _not_yet(E.check_suffix_prefill(lambda *a: "logits", model, tok), "got str")
    assert E.check_suffix_prefill(all_logits, model, tok)
    assert E.check_suffix_prefill(positions_from_the_cache, model, tok)


def test_use_reference_carries_on_with_the_notebooks_step(bundled):
    model, tok = bundled

    def blank(*a):
        raise NotImplementedError

    step = use_reference(
        blank, E.check_suffix_prefill(blank, model, tok), SOL.build_00_suffix_prefill
    )
    assert step is SOL.build_00_suffix_prefill


def test_time_prefill_times_the_step_on_a_fresh_copy_and_says_what_it_saw(bundled):
    """ratio = suffix-only / full medians, ideal = the suffix's token share, the sentence printed
    from the verdict."""
    model, tok = bundled
    ex = P.make_example(0, "heldout", n_filler=20, history="none")
    prefix, suffix = encode(tok, ex.prefix_text), encode(tok, ex.suffix_text)
    calls = []

    def spy(model, cache, prefix_len, suffix_ids):
        logits = SOL.build_00_suffix_prefill(model, cache, prefix_len, suffix_ids)
        # a fresh copy of the prefix each run
        calls.append((prefix_len, len(suffix_ids), cache.get_seq_length()))
        return logits

    r = E.time_prefill(model, prefix, suffix, repeats=2, step=spy)
    assert calls and all(c == (len(prefix), len(suffix), len(prefix) + len(suffix)) for c in calls)
    assert r["ratio"] == r["cached_s"] / r["full_s"] and r["ideal"] == len(suffix) / (
        len(prefix) + len(suffix)
    )
    assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and r["max_abs_logit_diff"] < 1e-4
    assert "outlier" not in r["sentence"]
    # overlapping ranges: a null result with its size
    if r["verdict"].startswith("no measurable saving"):
        assert r["sentence"].startswith(
            f"no measurable saving with a {len(prefix)}-token prefix: the ranges overlap"
        )
    elif r["saving_shown"]:
        assert f"{r['ratio']:.3f} of the full one" in r["sentence"]


def test_an_overlapping_short_prefix_reads_as_no_measurable_saving_not_an_outlier(
    bundled, monkeypatch
):
    """00 §5's short row: when the ranges overlap the sentence says so, with the size; no "re-run"
    for a calm run."""
    from kvlab.lessons import timing

    model, tok = bundled
    # full and cached alternate, overlapping
    seconds = iter([0.0021, 0.0020, 0.0024, 0.0019, 0.0022, 0.0023] * 4)
    monkeypatch.setattr(
        E,
        "time_interleaved",
        lambda variants, **kw: {
            name: timing.Timing(
                name,
                tuple(next(seconds) for _ in range(3)),
                fn[1](fn[0]()) if isinstance(fn, tuple) else fn(),
            )
            for name, fn in variants.items()
        },
    )
    r = E.time_prefill(model, list(range(40)), list(range(40, 52)), repeats=3)
    assert r["sentence"].startswith(
        "no measurable saving with a 40-token prefix: the ranges overlap"
    )
    assert "re-run" not in r["sentence"] and not r["saving_shown"]


def test_show_answers_escapes_a_model_answer_that_is_html():
    import pandas as pd

    html = E.show_answers(
        pd.DataFrame({"answer": ["<img src=x onerror=alert(1)>"], "n": [1]})
    ).to_html()
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_the_swapped_prefix_runs_on_the_donors_cached_prefix(bundled):
    model, tok = bundled
    a, b = P.make_examples(2, "heldout", start=2000, history="none")
    text = B.answer_with_swapped_prefix(model, tok, b, donor=a, max_new_tokens=16)
    # the donor's passphrase
    assert P.recalled(text, a.passphrase) and not P.recalled(text, b.passphrase)
    # its own prefix: right
    assert P.recalled(B.answer_with_swapped_prefix(model, tok, b, donor=b), b.passphrase)
