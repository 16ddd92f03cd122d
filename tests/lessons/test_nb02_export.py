"""Notebook 02's own code (``#| export`` cells -> kvlab.built.nb02) and its runners
(kvlab.lessons.nb02_prefix).

The article's code must pollute the cache it is given; the tokenization fix must cut the ids the
prompts really share; the equality and pollution runners must measure what they say. The checked
loop (``kvlab.prefix``) is tested in test_prefix.py, the build exercise in test_build_exercises.py.
"""

from kvlab.built import nb02 as N
from kvlab.engine.models import encode
from kvlab.engine.reference import hf_generate
from kvlab.lessons import nb02_prefix as L
from kvlab.lessons import passphrase as P


def test_the_articles_code_pollutes_and_pollution_pairs_measure_it(lm):
    model, tok = lm
    pairs = L.pollution_pairs(model, tok, 4, start=0, max_new_tokens=12)
    assert all(pairs["cache after B"] > pairs["cache after A"]) and all(
        pairs["cache after A"] > pairs["prefix tokens"]
    )
    assert (pairs["B on A's cache"] != pairs["B isolated"]).any()
    said = L.pollution_sentence(pairs)
    changed = (pairs["B on A's cache"] != pairs["B isolated"]).mean()
    assert said.startswith("4 pairs on one shared cache") and f"changed in {changed:.0%}" in said
    e = P.make_example(9, "heldout", history="none")   # one request alone on a fresh cache is right
    cache, plen = N.get_prefix_cache(model, tok, e.prefix_text)
    assert N.generate_with_prefix_cache(model, tok, cache, plen, e.suffix_text, 10) == hf_generate(
        model, tok, e.prompt_text, 10
    )


def test_common_prefix_ids_is_the_run_every_whole_tokenization_shares(lm):
    _, tok = lm
    prompts = ["你是一个专业的翻译助手，请翻译：今天", "你是一个专业的翻译助手，请翻译：明天"]
    ids = N.common_prefix_ids(tok, prompts)
    whole = [encode(tok, p) for p in prompts]
    assert (
        ids
        and all(w[: len(ids)] == ids for w in whole)
        and whole[0][len(ids)] != whole[1][len(ids)]
    )
    assert N.common_prefix_ids(tok, prompts[:1]) == whole[0]


def test_loop_equals_generate_and_its_sentence(lm):
    model, tok = lm
    rows = L.loop_equals_generate(model, tok, 4, 2, seed=1, max_new_tokens=8, start=40)
    assert list(rows.decoding) == ["greedy"] * 4 + ["seeded sampling"] * 2
    assert rows.identical.all() and (rows.cached_tokens > 0).all()
    said = L.equality_sentence("x", rows)
    n = int((rows.hf.str.strip() != "").sum())
    assert (
        said.startswith(f"x: {n}/{n} non-empty answers token-identical")
        and "(float32 rounding)" in said
    )


def test_token_pieces_show_whole_characters_never_byte_fragments(lm):
    _, tok = lm
    text = "你是一个专业的翻译助手，请将以下内容翻译成英文："
    pieces = L.token_pieces(tok, encode(tok, text))
    assert not any(p.startswith("<") and p.endswith(">") for p in pieces), pieces   # no "<e4 bb>"
    joined = "".join(p.replace("…", "") for p in pieces)
    # every character is shown, in the token(s) that carry it
    assert all(ch in joined for ch in text)
    split = [i for i, p in enumerate(pieces) if p.endswith("…")]
    assert split and all(pieces[i + 1].startswith("…") for i in split if i + 1 < len(pieces))
    # ids that stop inside a character (01's first 12 tokens): the cut one reads "请…", not "请<e5>"
    cut = L.token_pieces(tok, encode(tok, text)[:12])
    assert not any("<" in p for p in cut) and cut[-1].endswith("…"), cut
    special = L.token_pieces(tok, encode(tok, "<|im_start|>system\nhi"))
    # a newline shown as \n
    assert special[0] == "<|im_start|>" and "".join(special[1:]) == "system\\nhi"
