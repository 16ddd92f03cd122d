"""Hashing helpers beside the block manager's own (``kvlab.cache.hashing``): for lessons, routers
and benchmarks.

``hash_token_blocks`` hashes a token list with extra keys on its first block (notebook 04's chain),
``first_block_extra_keys`` names the first block's fingerprint and salt (``hashing.salted_block``
says which block takes a salt), ``builtin_hash`` is Python's ``hash()`` (fast, collisions can be
crafted: benchmarks only), and ``config_fingerprint`` names a model by its config.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .hashing import BlockHash, ExtraKeys, HashFn, block_extra_keys, hash_block, salted_block

__all__ = [
    "builtin_hash",
    "config_fingerprint",
    "first_block_extra_keys",
    "hash_token_blocks",
    "salted_block",
]


def builtin_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """Python's ``hash()`` of a tuple, 8 bytes: fast, but collisions can be crafted (benchmarks
    only)."""
    return hash((parent, tuple(token_ids), extra_keys)).to_bytes(8, "little", signed=True)


def first_block_extra_keys(model_fingerprint: str = "", cache_salt: str | None = None) -> ExtraKeys:
    """Extra keys of a sequence's first block: the model fingerprint and the tenant's salt, if
    any."""
    return block_extra_keys(0, model_fingerprint, cache_salt)


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys = (),
    hash_fn: HashFn = hash_block,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; the partial tail gets none."""
    hashes: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        keys = extra_keys if i == 0 and parent is None else ()
        parent = hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


def config_fingerprint(name: str, **config: object) -> str:
    """A short, stable fingerprint of a model's name and the config values that change its K/V (no
    weights).

    Not ``kvlab.engine.models.model_fingerprint``, which hashes the weights and the tokenizer
    themselves.
    """
    return hashlib.sha256(repr((name, sorted(config.items()))).encode()).hexdigest()[:16]
