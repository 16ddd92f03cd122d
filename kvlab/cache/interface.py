"""What every cache shares (pure Python): the per-sequence state and queries, the prompt and token
checks, and the names of the cache interface.

- ``SeqState``: what a cache keeps of a live sequence (tokens, block table, cached and restored
  counts, salt, tenant); ``SequenceTables``: the per-sequence queries on top of it (``block_table``,
  ``num_allocated_tokens``, ``slot_mapping``, ...). ``BlockManager`` and ``RadixCache`` inherit
  them.
- ``check_prompt``, ``check_token``: the clear error every cache gives for bad input, before it
  looks anything up.
- ``TenantScope``: whose cached blocks a sequence may share (its ``cache_salt``, the public prefix
  before it, its label); ``NO_SCOPE``, the caches' default for a caller that gives none.
- Re-exported here so one import serves a cache's author: ``CacheManager`` (the protocol the
  scheduler and engine call), ``CacheSeq``, ``CACHE_MEMBERS``, ``missing_members`` and
  ``check_cache`` from ``kvlab.cache.protocol`` (the members and who calls them).

The salt has one name from the request to the block hash (vLLM's ``cache_salt``) and one rule for
the block it enters (``kvlab.cache.hashing.salted_block``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .protocol import CACHE_MEMBERS, CacheManager, CacheSeq, check_cache, missing_members

__all__ = [
    "CACHE_MEMBERS",
    "MAX_TOKEN_ID",
    "NO_SCOPE",
    "CacheManager",
    "CacheSeq",
    "DuplicateSequenceError",
    "SeqState",
    "SequenceTables",
    "TenantScope",
    "UnknownSequenceError",
    "check_cache",
    "check_prompt",
    "check_token",
    "missing_members",
]

# token ids are hashed as int64: every id must be in [0, MAX_TOKEN_ID)
MAX_TOKEN_ID = 2**63


@dataclass(slots=True, frozen=True)
class TenantScope:
    """Whose cached blocks a sequence may share: its ``cache_salt``, the public prefix before it,
    and its label.

    ``cache_salt`` enters the hash of one block (``kvlab.cache.hashing.salted_block``: block 0 by
    default, as in vLLM): from there on a tenant's blocks are its own, the whole blocks of an
    operator's public prefix before it stay shared. ``tenant`` labels the sequence in per-tenant
    metrics (default: the salt). An engine derives the salt from the request's ``cache_salt`` and
    its tenant (``kvlab.engine.tenants.request_salt``) and builds the scope at intake.
    """

    cache_salt: str | None = None
    public_tokens: int = 0
    tenant: Hashable = None
    # the name metrics use: the tenant, or the salt when no tenant is given (set from the fields)
    label: Hashable = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(
                f"cache_salt must be a str or None, got {type(self.cache_salt).__name__}"
            )
        if type(self.public_tokens) is not int or self.public_tokens < 0:
            raise ValueError(f"public_tokens must be an int >= 0, got {self.public_tokens!r}")
        try:
            # a key of the per-tenant metrics
            hash(self.tenant)
        except TypeError:
            raise TypeError(f"tenant must be hashable, got {type(self.tenant).__name__}") from None
        object.__setattr__(self, "label", self.cache_salt if self.tenant is None else self.tenant)


# no salt, no public prefix: every request may hit every cached block
NO_SCOPE = TenantScope()


class UnknownSequenceError(LookupError):
    """Raised for a sequence id the manager does not hold (never allocated, or already freed)."""


class DuplicateSequenceError(ValueError):
    """Raised when allocating or forking into a sequence id that is already live."""


def check_token(token_id: int) -> None:
    """Raise unless ``token_id`` is a plain int in [0, MAX_TOKEN_ID)."""
    if type(token_id) is not int:
        raise TypeError("token ids must be ints")
    if not 0 <= token_id < MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, 2**63), got {token_id}")


def check_prompt(
    token_ids: Sequence[int], scope: TenantScope = NO_SCOPE, what: str = "a prompt"
) -> list[int]:
    """``token_ids`` as a list, or a clear error: at least one token, plain ints in [0,
    MAX_TOKEN_ID), and ``scope``'s public prefix within it (every cache runs this before it looks
    anything up)."""
    if not isinstance(scope, TenantScope):
        raise TypeError(f"scope must be a TenantScope, got {type(scope).__name__}")
    tokens = list(token_ids)
    if not tokens:
        raise ValueError(f"{what} needs at least one token")
    if any(type(t) is not int for t in tokens):
        raise TypeError("token ids must be ints")
    if min(tokens) < 0 or max(tokens) >= MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, 2**63), got {min(tokens)} .. {max(tokens)}")
    if not 0 <= scope.public_tokens <= len(tokens):
        raise ValueError(
            f"public_tokens must be in [0, {len(tokens)}], got {scope.public_tokens!r}"
        )
    return tokens


@dataclass(slots=True)
class SeqState:
    """What every cache keeps of a live sequence (a ``CacheSeq``): tokens, table, counts, tenant."""

    seq_id: Hashable
    token_ids: list[int]
    # logical block i -> physical block id
    block_table: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    # who this sequence serves (metrics, cross-tenant accounting)
    tenant: Hashable = None
    # prompt tokens hit in the cache at allocate
    num_cached_tokens: int = 0
    # prompt tokens copied back from a second tier at allocate (not computed; 0 without one)
    num_restored_tokens: int = 0


class SequenceTables:
    """The per-sequence queries every cache shares (``BlockManager`` and ``RadixCache`` inherit
    them).

    A cache sets ``seqs`` (id -> ``SeqState``) and ``block_size``.
    """

    seqs: dict[Hashable, SeqState]
    block_size: int

    def _seq(self, seq_id: Hashable) -> SeqState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id!r} (never allocated, or already freed)"
            ) from None

    def _check_new(self, seq_id: Hashable) -> None:
        if seq_id in self.seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of a sequence, in logical order."""
        return list(self._seq(seq_id).block_table)

    def num_allocated_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose K/V slots the cache holds for this sequence (computed or about to be)."""
        return len(self._seq(seq_id).token_ids)

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """Prompt tokens this sequence took from the cache at ``allocate``."""
        return self._seq(seq_id).num_cached_tokens

    def num_restored_tokens(self, seq_id: Hashable) -> int:
        """Of what ``allocate`` returned, the prompt tokens copied back from a second tier (0
        without one)."""
        return self._seq(seq_id).num_restored_tokens

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Physical slot (block_id * block_size + offset) of each position in ``[start, end)``."""
        seq, bs = self._seq(seq_id), self.block_size
        n = len(seq.token_ids)
        end = n if end is None else end
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= n:
            raise ValueError(
                f"positions [{start!r}, {end!r}) are not within the sequence's {n} tokens"
            )
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
