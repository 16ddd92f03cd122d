"""What a default ``Engine.generate`` / ``step`` never runs: public prefixes, abort and fork, stats, debug checks,
KV-event retrieval, cache reset.

Bases of ``Engine`` (``EngineExtras``) and ``Scheduler`` (``SchedulerExtras``), as ``kvlab.cache.extras`` is of
the cache: a caller asks for these (``engine.stats()``, ``engine.take_kv_events()``, ...); the step loop calls
only ``check_invariants``, and only on a ``debug`` engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ..cache.kv_events import EventBatch
from .fork import fork_request
from .invariants import check_engine, check_scheduler

__all__ = ["EngineExtras", "SchedulerExtras", "UnknownRequestError"]


class UnknownRequestError(LookupError):
    """Raised for a request id the engine does not hold (or that belongs to another tenant)."""


class EngineExtras:
    """The ``Engine`` methods off the step path (a base of ``Engine``)."""

    def add_public_prefix(self, prefix: str | Sequence[int]) -> int:
        """Register an operator prefix (e.g. a system prompt) every tenant may share; return its tokens."""
        # tokenized before the lock, as in add_request
        ids = self.intake.check_prefix(prefix)
        with self._lock:
            return self.intake.add_public_prefix(ids)

    def salt_for(self, tenant: str | None) -> str | None:
        """The cache salt the engine gives ``tenant`` under its policy (None under "shared")."""
        return self.intake.salt_for(tenant)

    def abort(self, request_id: Hashable, *, tenant: str | None = None) -> Any:
        """Stop an unfinished request of ``tenant`` (the one it was added with) now and free its blocks."""
        with self._lock:
            seq = self._get(request_id, tenant)
            self._finish(seq, "abort", time.perf_counter())
            return self._output(seq)

    # Engine.fork(request_id, child_id=None, sampling=None, *, tenant=None): kvlab.engine.fork
    fork = fork_request

    def _get(self, request_id: Hashable, tenant: str | None = None) -> Any:
        seq = self.requests.get(request_id)
        # another tenant's request looks like an unknown one
        if seq is None or seq.tenant != tenant:
            who = "" if tenant is None else f" of tenant {tenant!r}"
            raise UnknownRequestError(
                f"unknown request id {request_id!r}{who} (never added, already finished, "
                "or added with another tenant)"
            )
        return seq

    def add_step_observer(self, observer: Callable[[Any], None]) -> None:
        """Call ``observer(record)`` once per step from now on, after the forward (a ``StepRecord``)."""
        self.observers.append(observer)

    def take_kv_events(self) -> list[EventBatch]:
        """The KV-event batches since the last call, oldest first (for a router: ``kvlab.cluster.router``)."""
        with self._lock:
            return [] if self.kv_events is None else self.kv_events.take()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused, False, while a request holds blocks); emits ``AllBlocksCleared``."""
        # the radix cache raises NotImplementedError
        with self._lock:
            return self.block_manager.reset_prefix_cache()

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (and later recomputed) so far."""
        return self.scheduler.num_preemptions

    def stats(self) -> dict:
        """Engine-wide numbers: hit rate, KV bytes in use and peak, preemptions, steps, block-manager stats."""
        with self._lock:
            return {
                **self.block_manager.stats(),
                "kv_bytes_in_use": self.kv_bytes_in_use,
                "peak_kv_bytes": self.peak_kv_bytes,
                "kv_bytes_total": self.store.nbytes,
                "num_preemptions": self.num_preemptions,
                "num_steps": self.num_steps,
                "num_mixed_steps": self.num_mixed_steps,
                "num_waiting": len(self.scheduler.waiting),
                "num_running": len(self.scheduler.running),
                **(self.host_tier.stats() if self.host_tier is not None else {}),
            }

    def check_invariants(self) -> None:
        """Raise unless the block manager, the queues and the request table agree (``Scheduler.check_invariants``)."""
        with self._lock:
            check_engine(self)


class SchedulerExtras:
    """The ``Scheduler`` methods off the step path (a base of ``Scheduler``)."""

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def check_invariants(self) -> None:
        """Raise unless the block manager and the queues agree (``kvlab.engine.invariants.check_scheduler``)."""
        check_scheduler(self)
