"""One request's state as it moves through the engine: waiting -> running -> finished (pure Python).

A sequence owns its tokens (prompt + generated); the block manager owns where their K/V lives. While a
sequence runs, every token but the last has its K/V in the paged store; the last one (just sampled)
is fed to the model in the next step. A preempted sequence goes back to waiting with its tokens and is
prefilled again from them later (preemption by recompute).

Reference: nano-vllm ``nanovllm/engine/sequence.py``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, auto

from .sampling_params import SamplingParams  # not .sampling: that one imports torch

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(Enum):
    """Where a sequence is: in the waiting queue, in the running batch, or done."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """Tokens, sampling settings and timing of one request."""

    seq_id: int  # the engine's internal id (also the block manager's sequence id)
    request_id: Hashable  # the caller's id
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    salt: str | None = None  # passed through to the block manager's first-block hash
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int | None = None  # prompt tokens served by the cache at the first admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", "error"
    error: str | None = None  # why a request finished with "error"
    generator: object = None  # the engine's per-request random generator (torch), if sampling
    tenant: object = None  # who sent it (per-tenant metrics); the salt is derived from it by the engine
    public_tokens: int = 0  # leading tokens of an operator's public prefix (shared across tenants)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and generated tokens, in order."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        """The newest token (the one the next decode step feeds)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        """Whether the sequence is done (finished or aborted)."""
        return self.status is SequenceStatus.FINISHED
