"""Chained hashes of full KV-cache blocks: the key under which a block of K/V can be shared.

A block's hash covers its parent's hash, its own token ids and some extra keys, so two blocks hash
alike only if everything before them matched too. The first block's extra keys carry the model
fingerprint and, when given, a tenant's ``cache_salt``: different models or tenants never share a
block. Under a *public-prefix* policy the salt enters later instead: in the first block that extends
past the operator's public prefix (``salted_block``, the one place that says which block takes it),
so the public blocks are shared by every tenant and, because hashes chain, nothing after them is.
Only *full* blocks get a hash; a partial tail block is never shared through the cache.

sha256 is the default because collisions of Python's ``hash()`` can be crafted on purpose (vLLM
advisory GHSA-rm76-4mrf-v9r8; vLLM's default is sha256 since v0.10.2). kvlab's pool goes one step
further than vLLM and checks each hit's token ids and parent block, so even a collision can cost a
hit but never serve wrong K/V (see ``block_pool.BlockPool.lookup``).

References: vLLM ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``, ``NONE_HASH``,
``generate_block_hash_extra_keys``); nano-vllm ``nanovllm/engine/block_manager.py``
(``compute_hash``).

Helpers the block manager does not use (hashing a token list with given extra keys, Python's
``hash()``, a config fingerprint) are in ``kvlab.cache.hash_tools``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
ExtraKeys = tuple
HashFn = Callable[[BlockHash | None, Sequence[int], ExtraKeys], BlockHash]

# The parent hash of every first block; a fixed seed keeps hashes reproducible across runs.
NONE_HASH: BlockHash = hashlib.sha256(b"kvlab-root").digest()

# tokens per block when none is given: vLLM's default on GPUs
DEFAULT_BLOCK_SIZE = 16
# the label of the salt among a block's extra keys: part of every salted hash, so it never changes
SALT_KEY = "salt"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """sha256 over the parent hash, the block's token ids (int64) and its extra keys."""
    h = hashlib.sha256(NONE_HASH if parent is None else parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def salted_block(public_tokens: int, block_size: int) -> int:
    """The index of the block whose hash takes the ``cache_salt``: the first not wholly inside the
    public prefix.

    0 without a public prefix (vLLM's ``cache_salt`` on the first block); the blocks before it are
    shared.
    """
    return public_tokens // block_size


def block_extra_keys(
    index: int, model_fingerprint: str = "", cache_salt: str | None = None, salt_block: int = 0
) -> ExtraKeys:
    """Extra keys of block ``index``: the fingerprint on block 0, the salt on block
    ``salt_block``."""
    keys: tuple = ()
    if index == 0 and model_fingerprint:
        keys += (("model", model_fingerprint),)
    if cache_salt is not None and index == salt_block:
        keys += ((SALT_KEY, cache_salt),)
    return keys


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str = "",
    cache_salt: str | None = None,
    salt_block: int = 0,
    hash_fn: HashFn = hash_block,
) -> list[BlockHash]:
    """The hashes a ``BlockManager`` gives a prompt's full blocks (a router computes them the same
    way)."""
    hashes: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        keys = block_extra_keys(i, model_fingerprint, cache_salt, salt_block)
        parent = hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes
