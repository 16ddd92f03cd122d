"""Notebook 05's capstone: the slot mapping, YourManager over the reader's pieces, paged_generate
(kvlab.built.nb05), whose piece ran, and the same cache under kvlab's engine."""

import pytest
from tiny_models import tiny_qwen2

from kvlab.built import nb05 as N
from kvlab.cache.hash_tools import hash_token_blocks
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import eos_ids
from kvlab.lessons import nb04_blocks as L04
from kvlab.lessons import nb05_assemble as AS
from kvlab.lessons import nb05_table36 as T
from kvlab.lessons import solutions as SOL

BLOCK = 16


def not_yet(v, *parts):
    assert not v and all(p in str(v) for p in parts), str(v)


def test_slot_mapping_checker_passes_the_solution_and_names_each_mistake():
    assert AS.check_slot_mapping(SOL.build_05_slot_mapping)
    not_yet(AS.check_slot_mapping(None), "no answer yet", "block_table[p // block_size]")

    def blank(table, bs, start, end):
        raise NotImplementedError

    ref = SOL.build_05_slot_mapping
    not_yet(AS.check_slot_mapping(blank), "no answer yet")
    not_yet(AS.check_slot_mapping(lambda t, bs, s, e: list(range(s, e))), "logical position")
    not_yet(
        AS.check_slot_mapping(lambda t, bs, s, e: [t[p // bs] + p % bs for p in range(s, e)]),
        "multiply",
    )
    not_yet(AS.check_slot_mapping(lambda t, bs, s, e: ref(t, bs, 0, e)), "below start are cached")
    not_yet(
        AS.check_slot_mapping(lambda t, bs, s, e: ref(t, bs, s, e - 1)), "one slot per position"
    )
    not_yet(AS.check_slot_mapping(lambda *a: 1 / 0), "ZeroDivisionError")


def test_pieces_from_04_takes_only_checked_pieces_and_says_whose(capsys):
    def my_take(blocks):  # right, and defined here: __module__ is this test's, not "__main__"
        return SOL.build_04_take(blocks)

    pieces = AS.pieces_from_04(
        hashes=None, take=my_take, free=SOL.build_04_free, allocate=lambda *a: 0
    )
    out = capsys.readouterr().out
    assert pieces.take is my_take and pieces.hashes is SOL.build_04_block_hashes
    assert pieces.allocate is SOL.build_04_allocate and "allocate: kvlab's (yours: not yet" in out
    my_take.__module__ = "__main__"  # as a function typed in a notebook
    AS.say_whose(pieces)
    out = capsys.readouterr().out
    assert "take: yours (my_take)" in out and "allocate: kvlab's (build_04_allocate)" in out


@pytest.fixture(scope="module")
def three(lm):
    return T.three_requests(lm[1], BLOCK)


def test_capstone_generates_what_isolated_generate_does_and_reuses_the_prefix(lm, three):
    model, tok = lm
    own = model.config._attn_implementation
    cache = AS.YourManager(64, BLOCK, L04.kvlab_pieces())
    results = N.paged_generate(
        model, three, cache, SOL.build_05_slot_mapping, 6, eos_ids(model, tok)
    )
    assert model.config._attn_implementation == own  # the model gets its own attention back
    reference = AS.isolated_generate(model, three, 6)
    assert AS.check_capstone(results, reference)
    assert results[0][1] == 0 and all(c > 0 and c % BLOCK == 0 for _, c in results[1:])
    cache.check_invariants()
    assert not cache.seqs and sum(cache.blocks.ref) == 0  # every request freed its blocks


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Qwen2: every K/V it reads moves its argmax (the trained bundled model often
    answers the same from wrong K/V), and prompts sharing a 48-token prefix."""
    import random


    model = tiny_qwen2()
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(48)]
    return model, [prefix + [rng.randrange(256) for _ in range(8)] for _ in range(3)]


def test_a_wrong_slot_mapping_append_or_hash_chain_changes_the_tokens(tiny):
    model, prompts = tiny
    reference = AS.isolated_generate(model, prompts, 8)

    def run(slots=SOL.build_05_slot_mapping, ps=prompts, **pieces):
        cache = AS.YourManager(64, BLOCK, L04.kvlab_pieces(**pieces))
        cache.blocks.take()  # block 0 in use: no sequence's blocks sit at its logical slots
        return N.paged_generate(model, ps, cache, slots, 8)

    assert AS.check_capstone(run(), reference)
    # a block id not scaled by block_size: blocks overlap, positions overwrite each other's K/V
    assert not AS.check_capstone(
        run(slots=lambda t, bs, start, end: [t[p // bs] + p % bs for p in range(start, end)]),
        reference,
    )

    def unchained(tokens, bs, extra_keys=()):  # every block keyed on its tokens alone: wrong hits
        return [
            hash_token_blocks(tokens[i * bs : (i + 1) * bs], bs)[0]
            for i in range(len(tokens) // bs)
        ]

    # block 1's text first, then the whole prompt
    moved = [prompts[0], prompts[1][BLOCK:2 * BLOCK] + prompts[1]]
    results = run(hashes=unchained, ps=moved)
    assert results[1][1] > 0 and not AS.check_capstone(
        results, AS.isolated_generate(model, moved, 8)
    )

    # registers filled blocks but never takes a new one
    def no_new_block(blocks, seq_id, token_ids):
        if len(token_ids) % blocks.block_size == 0:
            SOL.build_05_append(blocks, seq_id, token_ids)

    # whole blocks: the first decoded token starts a new one
    long = [p[:BLOCK * 3] for p in prompts]
    # its slot has no block in the table: the slot mapping cannot place it
    with pytest.raises(IndexError):
        run(ps=long, append=no_new_block)


def test_your_manager_runs_under_the_engine_and_caches_generated_blocks(lm, three):
    model, tok = lm
    sp = SamplingParams(max_tokens=6)
    cache = AS.YourManager(64, BLOCK, L04.kvlab_pieces())
    engine = Engine(model, tok, cache=cache)
    outs = engine.generate(three, sp)
    iso = Engine(model, tok, enable_prefix_caching=False).generate(three, sp)
    assert [o.output_ids for o in outs] == [o.output_ids for o in iso]
    assert sum(o.num_cached_tokens for o in outs) > 0
    engine.check_invariants()
    # a second turn repeating the first request with its answer hits the blocks that its decode
    # steps filled
    first = engine.generate([three[0]], SamplingParams(max_tokens=BLOCK + 1, ignore_eos=True))[0]
    turn = list(first.prompt_ids) + list(first.output_ids) + [0]
    again = engine.generate([turn], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > len(first.prompt_ids) // BLOCK * BLOCK
    engine.check_invariants()


def test_your_manager_refuses_a_salted_scope_and_takes_an_unsalted_one():
    from kvlab.cache.interface import TenantScope

    cache = AS.YourManager(8, BLOCK, L04.kvlab_pieces())
    with pytest.raises(NotImplementedError, match="tenant salt"):
        cache.allocate("a", list(range(20)), TenantScope(cache_salt="tenant-a"))
    assert not cache.seqs
    assert cache.allocate("b", list(range(20)), TenantScope(tenant="t")) == 0
