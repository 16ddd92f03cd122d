"""The cache protocol: exactly what ``kvlab.engine``'s scheduler and engine call on their cache
(pure Python; re-exported by ``kvlab.cache.interface``).

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
from typing import Any, Protocol, runtime_checkable

__all__ = ["CACHE_MEMBERS", "CacheManager", "CacheSeq", "check_cache", "missing_members"]


class CacheSeq(Protocol):
    """What the engine reads of one entry of ``CacheManager.seqs`` (see the module docstring).

    kvlab's two caches keep a ``SeqState`` (their shared sequence base, ``kvlab.cache.interface``)
    per entry.
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
