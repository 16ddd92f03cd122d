"""One request's state, waiting -> running -> finished, as vLLM v1's ``Request`` (pure Python;
docs/engine.md)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, auto

from ..cache.interface import NO_SCOPE, TenantScope

# not .sampling: that one imports torch
from .sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(Enum):
    """Where a request is: in the waiting queue, in the running batch, or done."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Request:
    """Tokens, tenant scope, sampling settings and timing of one request (or of one fork of it)."""

    # the engine's internal id (also the block manager's sequence id)
    seq_id: int
    # the caller's id
    request_id: Hashable
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # cache_salt (in the hash of its salted block), public prefix length, tenant label
    scope: TenantScope = NO_SCOPE
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # prompt tokens served by the cache at the first admission
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # tokens whose K/V the scheduled steps write (the scheduler's; 0 while waiting)
    num_computed_tokens: int = 0
    # the first prompt token this admission computes (its cache hits end there): a failed prefill
    # takes every block from here on out of the cache, the earlier chunks' too
    prefill_start: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # "stop" (eos / stop token), "length", "abort", "error"
    finish_reason: str | None = None
    # why a request finished with "error"
    error: str | None = None
    # the engine's per-request random generator (torch), if sampling
    generator: object = None
    # of num_cached_tokens: copied back from a host tier (first admission)
    num_restored_tokens: int | None = None
    # sampling.logprobs: one kvlab.engine.logprobs.TokenLogprob per output token
    logprobs: list | None = None
    # sampling.prompt_logprobs: one per prompt token (None for the first)
    prompt_logprobs: list | None = None

    @property
    def tenant(self) -> Hashable:
        """Who sent it (it scopes ``abort``/``fork`` and labels per-tenant metrics); None if nobody
        was named."""
        return self.scope.tenant

    @property
    def token_ids(self) -> list[int]:
        """Prompt and generated tokens, in order."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)
