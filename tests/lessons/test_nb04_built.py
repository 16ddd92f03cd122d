"""Notebook 04's export cells (kvlab.built.nb04): the hash it writes is kvlab's, its ToyBlocks runs the solution."""

import random

from kvlab.built import nb04
from kvlab.cache import hash_tools, hashing
from kvlab.cache.block_manager import BlockManager
from kvlab.lessons import nb04_blocks as L


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


def test_toyblocks_replay_matches_the_block_manager_and_catches_a_wrong_allocate():
    for seed in range(3):
        ops = nb04.block_trace(seed=seed)
        rows, problem = nb04.replay_against_block_manager(L.reference_allocate, hash_tools.hash_token_blocks, ops)
        assert problem is None and len(rows) == len(ops)

    def no_cap(blocks, seq_id, token_ids, hashes):  # hits every full block, the last prompt token's too
        bs, table = blocks.block_size, []
        for h in hashes:
            b = blocks.cached.get(h)
            if b is None:
                break
            if blocks.ref[b] == 0:
                del blocks.free[b]
            blocks.ref[b] += 1
            table.append(b)
        hits = len(table)
        for i in range(hits, -(-len(token_ids) // bs)):
            table.append(blocks.take())
            if i < len(hashes):
                blocks.register(table[-1], hashes[i])
        blocks.tables[seq_id] = table
        return hits * bs

    _, problem = nb04.replay_against_block_manager(no_cap, hash_tools.hash_token_blocks, nb04.block_trace())
    assert problem is not None and "never take the block of the last prompt token" in problem


def test_toyblocks_take_evicts_a_cached_block_and_free_puts_uncached_first():
    toy = nb04.ToyBlocks(2, 4)
    toy.tables["a"] = [toy.take(), toy.take()]
    toy.register(toy.tables["a"][0], b"h0")
    toy.free_seq("a")
    assert list(toy.free) == [1, 0] and toy.cached == {b"h0": 0}  # the uncached block 1 goes first
    toy.take(), toy.take()
    assert toy.cached == {} and not toy.free
    assert BlockManager(2, 4).num_free_blocks == 2
