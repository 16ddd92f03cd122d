"""Chained block hashes: prefix-stable, sensitive to every token before them, keyed by model and
salt."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache.hash_tools import (
    builtin_hash,
    config_fingerprint,
    first_block_extra_keys,
    hash_token_blocks,
)
from kvlab.cache.hashing import NONE_HASH, hash_block

tokens = st.lists(st.integers(min_value=0, max_value=2**40), max_size=40)


def test_only_full_blocks_are_hashed():
    assert len(hash_token_blocks(list(range(15)), 4)) == 3
    assert len(hash_token_blocks(list(range(16)), 4)) == 4
    assert hash_token_blocks([1, 2, 3], 4) == []


def test_first_hash_chains_from_none_hash():
    assert hash_token_blocks([1, 2], 2) == [hash_block(None, [1, 2])]
    assert hash_block(None, [1, 2]) == hash_block(NONE_HASH, [1, 2])
    assert len(hash_block(None, [1, 2])) == 32  # sha256


@settings(max_examples=60, deadline=None)
@given(tokens, tokens)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(a, b):
    full = hash_token_blocks(a + b, 4)
    assert hash_token_blocks(a, 4) == full[: len(a) // 4]


@settings(max_examples=60, deadline=None)
@given(tokens.filter(lambda t: len(t) >= 8), st.data())
def test_changing_one_token_changes_its_block_and_all_later_blocks(t, data):
    i = data.draw(st.integers(0, len(t) - 1))
    changed = list(t)
    changed[i] += 1
    h1, h2 = hash_token_blocks(t, 4), hash_token_blocks(changed, 4)
    k = i // 4
    assert h1[:k] == h2[:k]
    assert all(x != y for x, y in zip(h1[k:], h2[k:], strict=True))


def test_extra_keys_only_enter_the_first_block_but_change_the_whole_chain():
    t = list(range(12))
    plain = hash_token_blocks(t, 4)
    salted = hash_token_blocks(t, 4, first_block_extra_keys(cache_salt="tenant-a"))
    other_model = hash_token_blocks(t, 4, first_block_extra_keys("model-b"))
    assert all(x != y for x, y in zip(plain, salted, strict=True))
    assert all(x != y for x, y in zip(plain, other_model, strict=True))
    other_salt = hash_token_blocks(t, 4, first_block_extra_keys(cache_salt="tenant-b"))
    assert all(x != y for x, y in zip(salted, other_salt, strict=True))


def test_extra_keys_are_ordered_and_optional():
    assert first_block_extra_keys() == ()
    assert first_block_extra_keys("fp", "s") == (("model", "fp"), ("salt", "s"))
    assert first_block_extra_keys("", "s") == (("salt", "s"),)


def test_config_fingerprint_is_stable_and_config_sensitive():
    a = config_fingerprint("qwen", layers=2, heads=4)
    assert a == config_fingerprint("qwen", heads=4, layers=2)
    assert a != config_fingerprint("qwen", layers=3, heads=4)
    assert a != config_fingerprint("llama", layers=2, heads=4)


def test_builtin_hash_is_8_bytes_and_chained():
    h = builtin_hash(None, [1, 2, 3])
    assert len(h) == 8
    assert builtin_hash(h, [4]) != builtin_hash(None, [4])


@pytest.mark.parametrize("fn", [hash_block, builtin_hash])
def test_hash_fn_is_deterministic(fn):
    assert fn(None, [5, 6], (("salt", "x"),)) == fn(None, (5, 6), (("salt", "x"),))


@pytest.mark.parametrize("public, salted", [(0, 0), (15, 0), (16, 1), (40, 2), (48, 3)])
def test_salted_block_is_the_first_block_not_wholly_public(public, salted):
    """A block straddling the public prefix's end is private; the whole blocks before it are
    shared."""
    from kvlab.cache.hash_tools import salted_block
    from kvlab.cache.hashing import DEFAULT_BLOCK_SIZE

    assert DEFAULT_BLOCK_SIZE == 16 and salted_block(public, DEFAULT_BLOCK_SIZE) == salted
    assert salted_block(public, 1) == public
