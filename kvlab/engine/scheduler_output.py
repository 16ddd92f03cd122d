"""What one ``Scheduler.schedule()`` hands the engine (vLLM's ``vllm/v1/core/sched/output.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Request

__all__ = ["ScheduledSeq", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence in a step: its tokens at positions ``[start, end)`` are computed."""

    seq: Request
    start: int
    end: int
    is_prefill: bool
    # the step samples its next token: ``end`` is the end of its tokens (a prompt chunk that ends
    # before them only writes K/V)
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, and the block copies (copy-on-write) to do before it."""

    items: list[ScheduledSeq] = field(default_factory=list)
    # (src block, dst block)
    cow_pairs: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
