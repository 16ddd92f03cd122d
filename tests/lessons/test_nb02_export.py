"""Notebook 02's own code (``#| export`` cells -> kvlab.built.nb02): its loop, its checks and its comparison.

The library twin (``kvlab.prefix``) is tested in test_prefix.py; here the notebook's ``generate`` must give
``model.generate``'s tokens, agree with the library, refuse what it cannot serve, and never write into the
shared prefix; the article's code must pollute.
"""

import copy

import pytest
import torch

import kvlab.prefix as lib
from kvlab.built import nb02 as N
from kvlab.engine.models import encode, eos_ids
from kvlab.engine.reference import hf_generate
from kvlab.lessons import nb02_prefix as L
from kvlab.lessons import passphrase as P


def test_compare_with_hf_greedy_and_sampled_identical(lm):
    model, tok = lm
    ex = P.make_examples(12, "heldout", start=40)
    rows = N.compare_with_hf(model, tok, [e.prompt_text for e in ex], [e.prefix_text for e in ex], 12)
    assert all(r["identical"] for r in rows) and max(r["max_abs_logit_diff"] for r in rows) <= 1e-4
    assert all(r["cached_tokens"] == len(encode(tok, e.prefix_text)) for r, e in zip(rows, ex))
    assert sum(r["new_tokens"] for r in rows) > 2 * len(rows)   # real answers, not one end-of-turn token each
    rows = N.compare_with_hf(model, tok, [e.prompt_text for e in ex[:6]], [e.prefix_text for e in ex[:6]], 10,
                             do_sample=True, temperature=1.3, top_p=0.95, top_k=40, seed=1)
    assert all(r["identical"] for r in rows)


def test_notebook_generate_equals_the_library_and_never_writes_the_prefix(lm):
    model, tok = lm
    for e in P.make_examples(6, "heldout", start=70):
        pc = lib.PrefixKV.build(model, tok, e.prefix_text)
        ours = N.generate(model, tok, e.prompt_text, pc, 12)
        assert ours.token_ids == lib.generate(model, tok, e.prompt_text, pc, 12).token_ids
        assert ours.token_ids == hf_generate(model, tok, e.prompt_text, 12)
        assert ours.num_cached_tokens == len(pc) and pc.seq_length() == len(pc)
    e = P.make_example(5, "heldout")   # the prompt is the prefix: its last token is recomputed
    pc = lib.PrefixKV.build(model, tok, e.prompt_text)
    res = N.generate(model, tok, e.prompt_text, pc, 10)
    assert res.num_cached_tokens == len(pc) - 1 and res.token_ids == hf_generate(model, tok, e.prompt_text, 10)


def test_continue_from_cache_equals_the_library_and_the_reference(lm):
    model, tok = lm
    e = P.make_example(11, "heldout")
    prefix, full = encode(tok, e.prefix_text), encode(tok, e.prompt_text)
    pc = lib.PrefixKV.build(model, tok, prefix)
    ours = N.continue_from_cache(model, pc.fork().cache, full[len(prefix):], len(prefix), 12, eos_ids(model, tok))[0]
    theirs = lib.continue_from_cache(model, pc.fork().cache, full[len(prefix):], len(prefix), max_new_tokens=12,
                                     stop_ids=eos_ids(model, tok))[0]
    assert ours == theirs == hf_generate(model, tok, full, 12)
    assert L.reference_continue(model, pc.fork().cache, full[len(prefix):], len(prefix), 12, eos_ids(model, tok)) == ours


def test_check_compatible_refuses(lm):
    model, tok = lm
    e = P.make_example(3, "heldout")
    pc = lib.PrefixKV.build(model, tok, e.prefix_text)
    N.check_compatible(pc, model, tok, encode(tok, e.prompt_text))   # the right prompt passes
    other = P.make_example(4, "heldout")
    with pytest.raises(lib.PrefixMismatchError, match="not a prefix"):
        N.check_compatible(pc, model, tok, encode(tok, other.prompt_text))
    changed = copy.deepcopy(model)
    with torch.no_grad():
        next(changed.parameters()).add_(1e-3)
    with pytest.raises(lib.PrefixMismatchError, match="another model"):
        N.check_compatible(pc, changed, tok, encode(tok, e.prompt_text))
    N.continue_from_cache(model, pc.cache, encode(tok, e.suffix_text), len(pc), 2)   # written into
    with pytest.raises(lib.PrefixMismatchError, match="polluted"):
        N.generate(model, tok, e.prompt_text, pc, 4)


def test_the_articles_code_pollutes_and_pollution_pairs_measure_it(lm):
    model, tok = lm
    rows = N.pollution_pairs(model, tok, 4, start=0, max_new_tokens=12)
    assert all(r["cache_after_B"] > r["cache_after_A"] > r["prefix_tokens"] for r in rows)
    assert any(r["B_polluted"] != r["B_isolated"] for r in rows)
    e = P.make_example(9, "heldout", history="none")   # one request alone on a fresh cache is right
    cache, plen = N.get_prefix_cache(model, tok, e.prefix_text)
    assert N.generate_with_prefix_cache(model, tok, cache, plen, e.suffix_text, 10) == hf_generate(model, tok, e.prompt_text, 10)
