"""The cache interface: exactly what ``kvlab.engine``'s scheduler and engine call on their cache,
and the per-sequence state and tenant scope every cache shares (pure Python).

``BlockManager`` (vLLM's hash blocks) and the engine's radix cache (``kvlab.engine.radix_adapter``)
both implement it, and ``Engine(model, tok, cache=obj)`` takes any object that does (a participant's
own block manager, a lesson's deliberately wrong one). Sizes are in blocks of ``block_size`` slots;
``seq_id`` is the engine's int id of one sequence; ``scope`` is a ``TenantScope`` (salt,
public-prefix length, tenant).

Members, and who calls them:

- ``block_size``, ``num_blocks``: the engine sizes its K/V store by them; ``Scheduler.check_fits``
  refuses a request that could never fit ``num_blocks``.
- ``num_free_blocks``: the engine's ``kv_bytes_in_use``.
- ``can_allocate(token_ids, scope)`` -> a plan (falsy: not now), ``allocate(seq_id, token_ids,
  scope, plan=, preempted=)`` -> prompt tokens served from the cache: the scheduler's admission.
- ``can_append(seq_id)``, ``append(seq_id, token)`` -> a result with ``.cow`` (a ``(src, dst)``
  block copy or None): the scheduler's decode step.
- ``fork(parent_id, child_id)``, ``free(seq_id, uncache_from=None)``: fork, preemption, finish,
  requeue.
- ``block_table(seq_id)`` -> physical block ids: the engine's packed batch.
- ``num_allocated_tokens(seq_id)``: the tokens whose K/V slots the cache holds for a sequence (the
  scheduler's chunked prefill); ``num_restored_tokens(seq_id)``: of what ``allocate`` returned, the
  prompt tokens copied back from a second tier rather than hit on the device (0 without one), read
  at a first admission.
- ``seqs``: a mapping seq id -> a ``CacheSeq`` entry, read by the engine's ``check_invariants``
  only.
- ``stats()``, ``check_invariants()``, ``take_events()`` (KV events, may be empty),
  ``reset_prefix_cache()`` (True if cleared, False while a sequence holds blocks; may raise
  ``NotImplementedError``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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


class UnknownSequenceError(LookupError):
    """Raised for a sequence id the manager does not hold (never allocated, or already freed)."""


class DuplicateSequenceError(ValueError):
    """Raised when allocating or forking into a sequence id that is already live."""


@dataclass(slots=True, frozen=True, init=False)
class TenantScope:
    """Whose cached blocks a sequence may share: its ``cache_salt``, the public prefix before it,
    and its label.

    ``cache_salt`` enters the hash of one block (``kvlab.cache.hashing.salted_block``: block 0 by
    default, as in vLLM): from there on a tenant's blocks are its own, the whole blocks of an
    operator's public prefix before it stay shared. ``tenant`` labels the sequence in per-tenant
    metrics (default: the salt). An engine derives the salt from the request's ``cache_salt`` and
    its tenant (``kvlab.engine.tenants.request_salt``).
    """

    cache_salt: str | None = None
    public_tokens: int = 0
    tenant: Hashable = None
    # the name metrics use: the tenant, or the salt when no tenant is given (set from the fields)
    label: Hashable = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        cache_salt: str | None = None,
        public_tokens: int = 0,
        tenant: Hashable = None,
        *,
        salt: str | None = None,
    ) -> None:
        """``salt=``: the keyword's name before issue 51, still accepted from notebooks 04 and
        04b."""
        if salt is not None:
            if cache_salt is not None:
                raise TypeError("give cache_salt or its old name salt, not both")
            cache_salt = salt
        object.__setattr__(self, "cache_salt", cache_salt)
        object.__setattr__(self, "public_tokens", public_tokens)
        object.__setattr__(self, "tenant", tenant)
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

    @property
    def salt(self) -> str | None:
        """``cache_salt`` by its name before issue 51 (notebooks 04, 04b and 05 still read it)."""
        return self.cache_salt


# no salt, no public prefix: every request may hit every cached block
NO_SCOPE = TenantScope()


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


class CacheSeq(Protocol):
    """What the engine reads of one entry of ``CacheManager.seqs`` (see the module docstring).

    kvlab's two caches keep a ``SeqState`` (their shared sequence base) per entry.
    """

    token_ids: Sequence[int]
    num_restored_tokens: int


@runtime_checkable
class CacheManager(Protocol):
    """What the scheduler and the engine use of a prefix cache (see the module docstring)."""

    block_size: int
    num_blocks: int
    num_free_blocks: int
    seqs: Mapping[Hashable, CacheSeq]

    def can_allocate(self, token_ids: Sequence[int], scope: Any = ...) -> Any:
        """A plan for ``allocate`` (falsy when the prompt does not fit now)."""

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        scope: Any = ...,
        *,
        plan: Any = ...,
        preempted: bool = ...,
    ) -> int:
        """Give ``seq_id`` blocks for ``token_ids``; return the prompt tokens served from the
        cache."""

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether one more token of ``seq_id`` fits now."""

    def append(self, seq_id: Hashable, token_id: int) -> Any:
        """Make room for one token; the result's ``cow`` is a ``(src, dst)`` block copy or None."""

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` sharing every block of ``parent_id``."""

    def free(self, seq_id: Hashable, uncache_from: int | None = None) -> None:
        """Release ``seq_id``'s blocks; those from token ``uncache_from`` on leave the cache."""

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of ``seq_id``, in order."""

    def num_allocated_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose K/V slots the cache holds for ``seq_id``."""

    def num_restored_tokens(self, seq_id: Hashable) -> int:
        """Prompt tokens of ``seq_id`` copied back from a second tier at ``allocate``."""

    def stats(self) -> dict:
        """Hit-rate and occupancy numbers (merged into ``Engine.stats()``)."""

    def check_invariants(self) -> None:
        """Raise if the cache's bookkeeping is inconsistent."""

    def take_events(self) -> list:
        """KV events queued since the last call (an empty list when there are none)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False while a sequence holds blocks."""


# the data members are the Protocol's annotations, the rest its public methods: both read from the
# class, so adding a member to CacheManager adds it here (and to what ``check_cache`` asks of a
# caller's cache)
_DATA_MEMBERS = frozenset(CacheManager.__annotations__)
_METHODS = frozenset(
    name
    for name, value in vars(CacheManager).items()
    if callable(value) and not name.startswith("_")
)
# every member of CacheManager, sorted
CACHE_MEMBERS = tuple(sorted(_DATA_MEMBERS | _METHODS))


def missing_members(obj: object) -> list[str]:
    """The members of ``CacheManager`` that ``obj`` lacks or has as a non-callable where a method is
    due (sorted)."""
    missing = []
    for name in CACHE_MEMBERS:
        if not hasattr(obj, name):
            missing.append(name)
        elif name not in _DATA_MEMBERS and not callable(getattr(obj, name)):
            missing.append(f"{name} (not callable)")
    return missing


def check_cache(obj: object) -> CacheManager:
    """Return ``obj`` if it implements ``CacheManager``; else raise ``TypeError`` naming the missing
    members."""
    missing = missing_members(obj)
    if missing:
        raise TypeError(
            f"cache must be 'blocks', 'radix' or an object implementing kvlab.cache.CacheManager; "
            f"{type(obj).__name__} lacks {', '.join(missing)}"
        )
    return obj
