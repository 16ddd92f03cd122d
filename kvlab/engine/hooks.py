"""The engine's optional plug-ins, each run only when asked for: a positions hook, step observers,
KV events.

``Engine(positions=f)`` numbers the tokens a scheduled item computes (``default_positions`` is what
the engine does without one); ``Engine(observers=[...])`` / ``add_step_observer`` get one
``StepRecord`` per step that ran a forward; with ``enable_kv_events`` a ``KVEventLog`` is one more
such observer: it numbers the cache's events into one ``EventBatch`` per step. A step without
observers builds no record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ..cache.interface import CacheManager
from ..cache.kv_events import EventBatch

__all__ = ["KVEventLog", "StepRecord", "checked_positions", "default_positions", "observe"]


def default_positions(item: Any) -> range:
    """The positions of the tokens ``item`` computes (what RoPE sees): where they sit in the
    sequence."""
    return range(item.start, item.end)


def checked_positions(p: Any, item: Any) -> range | list[int]:
    """The positions a ``positions`` hook gave ``item``: one int >= 0 per computed token, else
    ValueError."""
    n = item.end - item.start
    # the usual case, checked without a pass over the tokens
    if isinstance(p, range) and len(p) == n and (n == 0 or min(p[0], p[-1]) >= 0):
        return p
    try:
        got = [int(x) for x in p] if not isinstance(p, (str, bytes)) else None
    except (TypeError, ValueError):
        got = None
    if got is None or len(got) != n or any(x < 0 for x in got):
        raise ValueError(
            f"the engine's positions hook gave {p!r} for tokens [{item.start}, {item.end}): it "
            "must "
            f"give {n} non-negative int positions, one per computed token"
        )
    return got


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step ran, item by item: the argument of a step observer
    (``Engine.add_step_observer``)."""

    # the engine's step counter before this step (0 for the first)
    step: int
    # (request_id, start, end, is_prefill) per scheduled item: it computed positions [start, end)
    items: tuple[tuple[Hashable, int, int, bool], ...]
    tables: tuple[tuple[int, ...], ...]
    positions: tuple[range, ...]
    # the token sampled per item; None for a prompt chunk (end < its length) and for a failed item
    tokens: tuple[int | None, ...]


def observe(
    observers: list[Callable[[StepRecord], None]],
    step: int,
    items: list[Any],
    tables: list[list[int]],
    positions: list[Any] | None,
    tokens: list[int | None],
) -> None:
    """Hand every observer the ``StepRecord`` of this step (``positions`` None: the default
    ones)."""
    if positions is None:
        positions = [default_positions(it) for it in items]
    spans = tuple((it.seq.request_id, it.start, it.end, it.is_prefill) for it in items)
    record = StepRecord(step, spans, tuple(map(tuple, tables)), tuple(positions), tuple(tokens))
    for observer in observers:
        observer(record)


class KVEventLog:
    """The cache's KV events, numbered into one ``EventBatch`` per step that changed it
    (``enable_kv_events``)."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache, self.batches, self.next_seq = cache, [], 0

    def __call__(self, record: StepRecord) -> None:
        """A step observer: the step's events become one batch."""
        self.close_batch()

    def close_batch(self) -> None:
        """Wrap the events queued since the last batch in one ``EventBatch`` with the next sequence
        number."""
        events = self.cache.take_events()
        if events:
            self.batches.append(EventBatch(time.time(), tuple(events), self.next_seq))
            self.next_seq += 1

    def take(self) -> list[EventBatch]:
        """Every batch since the last call, oldest first (events from outside a step form a batch of
        their own)."""
        self.close_batch()
        batches, self.batches = self.batches, []
        return batches
