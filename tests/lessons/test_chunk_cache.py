"""kvlab.blend: chunk cache (scopes, content keys), key re-rotation, selective recompute; notebook
03b's exercise."""

import json
from pathlib import Path

import pytest
import torch

from kvlab import blend as B
from kvlab.built import nb03
from kvlab.engine.models import encode
from kvlab.lessons import nb03b_blend as Z
from kvlab.lessons import passphrase as P
from kvlab.prefix import PrefixKV, continue_from_cache, generate

ROOT = Path(__file__).resolve().parents[2]


def _pieces(tok, seed=3):
    """A system line, three passages of the example's system text (reused), and the question."""
    ex = P.make_example(seed, "heldout", n_filler=6, lang="en", history="none")
    lines = ex.system.split("\n")
    head = P.IM_START + "system\n" + lines[0] + "\n"
    chunks = ["\n".join(lines[1:3]) + "\n", "\n".join(lines[3:5]) + "\n", "\n".join(lines[5:])]
    tail = P.IM_END + "\n" + ex.suffix_text
    return (
        [(encode(tok, head), False)]
        + [(encode(tok, c), True) for c in chunks]
        + [(encode(tok, tail), False)]
    )


def _ids(pieces):
    return [t for ids, _ in pieces for t in ids]


@pytest.fixture(scope="module")
def chunks(lm):
    model, tok = lm
    return B.ChunkCache(model, tok)


def _tiny(kind: str, tok):
    """A random 3-layer model of one RoPE family, the bundled tokenizer's vocabulary."""
    import transformers as T

    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    configs = {
        "llama": lambda: T.LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 500.0}
        ),
        "qwen2": lambda: T.Qwen2Config(**common),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=16),
        "phi": lambda: T.PhiConfig(
            **{**common, "num_key_value_heads": 4}
        ),  # partial rotary: half of head_dim
        "stablelm": lambda: T.StableLmConfig(
            **{**common, "num_key_value_heads": 4}
        ),  # a quarter of head_dim
    }
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(configs[kind](), dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- r = 100 % and r = 0


@pytest.mark.parametrize("with_prefix", [False, True])
def test_full_recompute_is_token_identical_to_a_full_prefill(lm, chunks, with_prefix):
    model, tok = lm
    for seed in (3, 4, 5):
        pieces = _pieces(tok, seed)
        prefix = PrefixKV.build(model, tok, pieces[0][0]) if with_prefix else None
        full = generate(model, tok, _ids(pieces), max_new_tokens=12, keep_logits=True)
        b = B.blend_generate(chunks, pieces, 1.0, prefix=prefix, max_new_tokens=12)
        assert b.token_ids == full.token_ids
        assert torch.allclose(b.logits, full.step_logits[0], atol=1e-4)
        assert len(b.recomputed) == len(b.reused) > 0


def test_zero_recompute_equals_naive_reuse_built_by_hand(lm, chunks):
    model, tok = lm
    pieces = _pieces(tok)
    ids = _ids(pieces)
    theta = nb03.rope_theta(model.config)
    # by hand: the system turn computed, each chunk alone at 0 and rotated to its place
    with torch.no_grad():
        layers = [
            list(kv)
            for kv in (
                (lay.keys, lay.values)
                for lay in model(
                    input_ids=torch.tensor([pieces[0][0]]), use_cache=True
                ).cache.layers
            )
        ]
        pos = len(pieces[0][0])
        for chunk, _ in pieces[1:-1]:
            alone = model(input_ids=torch.tensor([chunk]), use_cache=True).cache
            for i, lay in enumerate(alone.layers):
                layers[i][0] = torch.cat([layers[i][0], nb03.rerotate(lay.keys, pos, theta)], 2)
                layers[i][1] = torch.cat([layers[i][1], lay.values], 2)
            pos += len(chunk)
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(layers):
            cache.update(k, v, i)
        naive, _, _, logits = continue_from_cache(
            model,
            cache,
            pieces[-1][0],
            pos,
            max_new_tokens=12,
            stop_ids={tok.eos_token_id},
            keep_logits=True,
        )
    b = B.blend_generate(chunks, pieces, 0.0, max_new_tokens=12)
    assert b.recomputed == [] and b.deviation is None
    assert b.prompt_ids == ids and b.token_ids == naive
    assert torch.allclose(b.logits, logits[0], atol=1e-4)
    assert not torch.allclose(
        b.logits, generate(model, tok, ids, keep_logits=True).step_logits[0], atol=1e-3
    )


def test_selective_recompute_picks_the_largest_deviations(lm, chunks):
    model, tok = lm
    pieces = _pieces(tok)
    b = B.blend_prefill(chunks, pieces, 0.15)
    assert len(b.recomputed) == round(0.15 * len(b.reused))
    ranked = sorted(range(len(b.reused)), key=lambda i: -float(b.deviation[i]))
    assert sorted(b.recomputed) == sorted(b.reused[i] for i in ranked[:len(b.recomputed)])
    # layer 0 is exact for every token, so a recomputed token's layer-1 K/V are the full prefill's;
    # kept ones stay naive
    with torch.no_grad():
        full = model(input_ids=torch.tensor([_ids(pieces)]), use_cache=True).cache.layers[1]
    naive = B.blend_prefill(chunks, pieces, 0.0).cache.layers[1]
    kept = sorted(set(b.reused) - set(b.recomputed))
    for got, want, old in (
        (b.cache.layers[1].keys, full.keys, naive.keys),
        (b.cache.layers[1].values, full.values, naive.values),
    ):
        picked = got[:, :, b.recomputed]
        assert (
            float((picked - want[:, :, b.recomputed]).norm() / want[:, :, b.recomputed].norm())
            < 1e-5
        )
        assert torch.equal(got[:, :, kept], old[:, :, kept])
        # they did deviate
        assert float((old[:, :, b.recomputed] - want[:, :, b.recomputed]).norm()) > 1e-2


def test_bad_arguments_are_refused(chunks, lm):
    pieces = _pieces(lm[1])
    with pytest.raises(ValueError, match="layer 0's K/V depend only on token and position"):
        B.blend_prefill(chunks, pieces, 0.1, select_layer=0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        B.blend_prefill(chunks, pieces, 1.5)
    with pytest.raises(ValueError, match="unknown isolation"):
        B.ChunkCache(*lm, isolation="public")


# ----------------------------------------------------------------------------- re-rotation


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi", "stablelm"])
def test_rerotated_chunk_keys_equal_a_full_prefill_at_layer_0_only(lm, kind):
    tok = lm[1]
    model = _tiny(kind, tok)
    theta, rotary_dim = B.rotary_spec(model.config)
    head_dim = model.config.head_dim if kind == "qwen3" else model.config.hidden_size // 4
    assert rotary_dim == {"phi": head_dim // 2, "stablelm": head_dim // 4}.get(kind, head_dim)
    cc = B.ChunkCache(model, tok)
    pieces = _pieces(tok)
    b = B.blend_prefill(cc, pieces, 0.0)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([_ids(pieces)]), use_cache=True).cache
    at = b.reused

    def rel(x, y):
        return float((x[:, :, at] - y[:, :, at]).norm() / y[:, :, at].norm())

    assert rel(b.cache.layers[0].keys, full.layers[0].keys) < 1e-5  # float rounding
    assert rel(b.cache.layers[0].values, full.layers[0].values) < 1e-6
    # deeper layers miss the other passages
    assert rel(b.cache.layers[2].keys, full.layers[2].keys) > 1e-3


def test_rerotate_keys_composes_and_leaves_the_unrotated_dims(lm):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 6, 32, generator=g)
    moved = B.rerotate_keys(keys, 40, 10000.0, rotary_dim=16)
    assert torch.equal(moved[..., 16:], keys[..., 16:])
    assert torch.allclose(B.rerotate_keys(moved, -40, 10000.0, rotary_dim=16), keys, atol=1e-5)
    assert torch.allclose(B.rerotate_keys(keys, 40, 10000.0), nb03.rerotate(keys, 40), atol=1e-5)


def test_a_put_entry_moves_from_where_it_was_computed(lm):
    model, tok = lm
    cc = B.ChunkCache(model, tok)
    head_a, head_b = (
        encode(tok, P.IM_START + "system\nHi.\n"),
        encode(tok, P.IM_START + "system\nHello there, all.\n"),
    )
    seg = encode(tok, "Remember the passphrase \"AB2CDE\".\n")
    with torch.no_grad():
        a = model(input_ids=torch.tensor([head_a + seg]), use_cache=True).cache
        b_full = model(input_ids=torch.tensor([head_b + seg]), use_cache=True).cache
    stored = [(lay.keys[:, :, len(head_a):], lay.values[:, :, len(head_a):]) for lay in a.layers]
    cc.put(seg, stored, start=len(head_a))
    b = B.blend_prefill(
        cc, [(head_b, False), (seg, True), (encode(tok, "<|im_end|>\n"), False)], 0.0
    )
    span = slice(len(head_b), len(head_b) + len(seg))
    k, want = b.cache.layers[0].keys[:, :, span], b_full.layers[0].keys[:, :, span]
    assert float((k - want).norm() / want.norm()) < 1e-5
    stored[0][0].zero_()  # the caller's tensors are not the cache's
    assert cc.compute(seg).layers[0][0].abs().sum() > 0


def test_non_rope_models_are_refused_with_the_feature_named(lm):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(lm[1]), n_embd=32, n_layer=2, n_head=2, n_positions=128)
    ).eval()
    with pytest.raises(B.ChunkReuseError, match=r"rotary position embeddings \(RoPE\).*'gpt2'"):
        B.ChunkCache(gpt2, lm[1])


# ----------------------------------------------------------------------------- isolation and
# immutability


def test_another_tenant_misses_and_the_same_tenant_hits(lm):
    model, tok = lm
    chunk = encode(tok, "Remember the passphrase \"AB2CDE\".\n")
    cc = B.ChunkCache(model, tok, secret=b"a server secret of 32 bytes ....")
    cc.compute(chunk, tenant="acme")
    assert (chunk, "acme") in cc and (chunk, "globex") not in cc and (chunk, None) not in cc
    assert cc.key(chunk, "acme") != cc.key(chunk, "globex")
    cc.compute(chunk, tenant="globex")
    cc.compute(chunk, tenant="acme")
    assert (cc.misses, cc.hits, len(cc)) == (2, 1, 2)
    b = B.blend_prefill(
        cc, [(chunk, True), (encode(tok, "<|im_end|>\n"), False)], 0.0, tenant="initech"
    )
    assert cc.misses == 3 and b.seconds["miss"] > 0
    shared = B.ChunkCache(model, tok, isolation="shared")
    shared.compute(chunk, tenant="acme")
    assert (chunk, "globex") in shared
    other = B.ChunkCache(model, tok, secret=b"another server secret, 32 bytes.")
    # the salt, not the tenant id, is the scope
    assert other.key(chunk, "acme") != cc.key(chunk, "acme")


def test_blending_never_writes_into_the_chunk_or_prefix_cache(lm, chunks):
    model, tok = lm
    pieces = _pieces(tok, 7)
    prefix = PrefixKV.build(model, tok, pieces[0][0])
    before = [chunks.compute(ids).layers[1][0].clone() for ids, reuse in pieces if reuse]
    for r in (0.0, 0.3, 1.0):
        B.blend_generate(chunks, pieces, r, prefix=prefix, max_new_tokens=4)
    after = [chunks.compute(ids).layers[1][0] for ids, reuse in pieces if reuse]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert prefix.seq_length() == len(prefix)


def test_a_prefix_cache_of_another_prompt_is_refused_before_anything_is_computed(lm):
    model, tok = lm
    pieces = _pieces(tok)
    cc = B.ChunkCache(model, tok)
    wrong = PrefixKV.build(model, tok, encode(tok, P.IM_START + "user\n"))
    with pytest.raises(B.ChunkReuseError, match="first tokens"):
        B.blend_prefill(cc, pieces, 0.0, prefix=wrong)
    # reaches into a reused chunk
    too_long = PrefixKV.build(model, tok, _ids(pieces)[:len(pieces[0][0]) + 2])
    with pytest.raises(B.ChunkReuseError, match="inside the"):
        B.blend_prefill(cc, pieces, 0.0, prefix=too_long)
    assert len(cc) == 0 and cc.misses == 0


# ----------------------------------------------------------------------------- notebook 03b


def test_rag_requests_vary_the_order_and_tokenize_like_the_whole_text(lm):
    from kvlab.built import nb03b as N

    reqs = N.rag_requests(lm[1], range(2), per_docset=4)
    assert all(r.whole_text_tokens and 0 in r.order and 2 <= len(r.order) <= 4 for r in reqs)
    assert len({r.order for r in reqs}) > 2


def test_exercise_03b_solution_passes_and_blank_or_wrong_answers_get_a_hint():
    from kvlab.lessons import solutions as SOL

    assert Z.check_rerotate(SOL.ex03b_1_rerotate)
    blank = Z.check_rerotate(None)
    assert not blank and str(blank).startswith("not yet: no answer yet. Hint: ")
    wrong = Z.check_rerotate(lambda keys, delta, theta: keys)
    assert not wrong and str(wrong).startswith("not yet: for delta 7")


def test_notebook_03b_build_starts_blank_and_is_checked():
    nb = json.loads((ROOT / "notebooks" / "03b_reusing_the_middle.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    stub = next(i for i, src in enumerate(code) if "def my_rerotate" in src)
    assert "raise NotImplementedError" in code[stub] and "    return " not in code[stub]
    assert (
        "Z.check_rerotate(my_rerotate)" in code[stub + 1]
        and "use_reference(my_rerotate" in code[stub + 1]
    )
    assert not any("getsource" in src for src in code)


def test_the_notebooks_blend_prefill_equals_kvlabs(lm):
    """03b writes chunk_key and blend_prefill in its cells (kvlab.built.nb03b); the library
    (kvlab.blend) agrees."""
    from kvlab.built import nb03b as N

    model, tok = lm
    mine, lib = B.ChunkCache(model, tok), B.ChunkCache(model, tok)
    pieces = _pieces(tok)
    assert N.chunk_key(mine.scope("acme"), mine.fingerprint, pieces[1][0]) == mine.key(
        pieces[1][0], "acme"
    )
    prefix = PrefixKV.build(model, tok, pieces[0][0])
    for r in (0.0, 0.15, 0.5, 1.0):
        for pre in (None, prefix):
            a = N.blend_prefill(mine, pieces, r, prefix=pre)
            b = B.blend_prefill(lib, pieces, r, prefix=pre)
            assert (
                a.reused == b.reused
                and a.recomputed == b.recomputed
                and a.prompt_ids == b.prompt_ids
            )
            assert torch.allclose(a.logits, b.logits, atol=1e-5)
            for x, y in zip(a.cache.layers, b.cache.layers):
                assert torch.allclose(x.keys, y.keys, atol=1e-5) and torch.allclose(
                    x.values, y.values, atol=1e-5
                )
    ga = N.blend_generate(mine, pieces, 0.15, prefix=prefix, max_new_tokens=8)
    gb = B.blend_generate(lib, pieces, 0.15, prefix=prefix, max_new_tokens=8)
    assert ga.token_ids == gb.token_ids
    full = N.blend_generate(mine, [(ids, False) for ids, _ in pieces], 1.0, max_new_tokens=8)
    assert (
        N.blend_generate(mine, pieces, 1.0, prefix=prefix, max_new_tokens=8).token_ids
        == full.token_ids
    )


def test_the_ttft_table_and_the_sentences_read_one_ratio(lm):
    """03b's TTFT table and the sentences under it take the same ratio_verdict numbers."""
    from kvlab.built import nb03b as N
    from kvlab.lessons.timing import ratio_verdict

    model, tok = lm
    req = N.rag_requests(tok, [0], per_docset=1)[0]
    ttft = N.run_ttft(B.ChunkCache(model, tok), [req], [0.0, 0.5], repeats=2)
    table, timings = N.ttft_table(ttft), N.ttft_timings(ttft)
    assert (
        list(table.index) == N.ttft_methods([0.0, 0.5])
        and table.loc["full prefill", "vs full prefill"] == 1.0
    )
    v = ratio_verdict(timings["blend r=50%"], timings["full prefill"])
    assert table.loc["blend r=50%", ["vs full prefill", "ratio lo", "ratio hi"]].tolist() == [
        v.value,
        v.lo,
        v.hi,
    ]
    assert all(len(t.seconds) == 2 for t in timings.values())
