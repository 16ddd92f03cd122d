"""Notebook 04's export cells (kvlab.built.nb04): the hash it writes is kvlab's; its ToyBlocks, run
by the worked pieces, is kvlab's BlockManager step for step (allocations, decode appends, frees,
evictions)."""

import random

from kvlab.built import nb04
from kvlab.cache import hash_tools, hashing
from kvlab.lessons import nb04_blocks as L
from kvlab.lessons import solutions as SOL


def test_the_notebooks_hash_block_is_kvlabs():
    rng = random.Random(0)
    keys = hash_tools.first_block_extra_keys("toy-model", "tenant-a")
    parent = None
    for n in (1, 4, 16, 3):
        tokens = [rng.randrange(50_000) for _ in range(n)]
        for k in ((), keys):
            assert nb04.hash_block(parent, tokens, k) == hashing.hash_block(parent, tokens, k)
        parent = hashing.hash_block(parent, tokens)
    assert nb04.NONE_HASH == hashing.NONE_HASH


def test_toyblocks_with_the_worked_pieces_is_the_block_manager_step_for_step():
    for seed in range(3):
        for appends in (False, True):
            ops = L.block_trace(60, seed=seed, appends=appends)
            rows, problem = L.replay(ops, L.kvlab_pieces())
            assert problem is None and len(rows) == len(ops)
            assert rows[-1]["evictions (kvlab)"] > 0  # the trace reaches eviction
            if appends:
                assert any(op[0] == "append" for op in ops)
    ops = L.block_trace(num_blocks=16, seed=1)  # a smaller pool: more evictions
    assert L.replay(ops, L.kvlab_pieces(), num_blocks=16)[1] is None


def test_toyblocks_lookup_register_uncache():
    toy = nb04.ToyBlocks(3, 4, SOL.build_04_take, SOL.build_04_free)
    toy.tables["a"] = [toy.take(), toy.take()]
    toy.register(toy.tables["a"][0], b"h0")
    toy.tables["b"] = [toy.take()]
    toy.register(toy.tables["b"][0], b"h0")  # a twin: the same hash computed twice
    assert toy.lookup(b"h0") == 0 and toy.cached == {b"h0": [0, 2]} and toy.lookup(b"x") is None
    toy.free_seq("a")
    assert list(toy.free) == [1, 0]  # the uncached block 1 first, the cached block 0 at the tail
    toy.uncache(0)
    assert toy.lookup(b"h0") == 2 and toy.hash_of[0] is None
    assert toy.take() == 1 and toy.take() == 0 and not toy.free
