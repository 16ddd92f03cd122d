"""What the engine returns for a request (vLLM's ``vllm/outputs.py``), built by
``Engine._output``."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["RequestOutput"]


@dataclass(slots=True)
class RequestOutput:
    """A request's result: tokens, text, why it stopped, cache use and timing (seconds)."""

    request_id: Hashable
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished: bool
    # "stop", "length", "abort", "error"
    finish_reason: str | None
    # prompt tokens served from the prefix cache (first admission)
    num_cached_tokens: int
    num_preemptions: int = 0
    # arrival -> first token
    ttft: float | None = None
    # arrival -> finished
    latency: float | None = None
    error: str | None = None
    # of num_cached_tokens: copied back from the host tier (evicted or fetched)
    num_restored_tokens: int = 0
    # sampling.logprobs / prompt_logprobs: kvlab.engine.logprobs.TokenLogprob records (None if not
    # asked)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
