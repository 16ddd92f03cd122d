"""The server's default token budget per step (``--max-num-batched-tokens``), sized to the device.

With chunked prefill a long prompt is cut into chunks of the step's token budget, and every running stream
waits for each step: a step's time is a stream's inter-token gap. vLLM's 2,048 tokens a step take a GPU a few
milliseconds, but a CPU seconds (one 2,992-token prompt stalled two SmolLM2 streams for 6.97 s on 2 cores).
So the budget is what this device prefills in about ``TARGET_STEP_S``: measured once at start on the model
itself (one warm-up forward, then one timed forward of ``PROBE_TOKENS`` tokens), rounded down to a multiple
of 16 and kept in ``[max_num_seqs, 2048]`` (the scheduler needs one token per running sequence a step). On a
CUDA device it is 2,048, vLLM's default. A CPU prefills at a near-constant rate per token, so smaller chunks
cost little throughput there (the measured trade-off is in issue 53's report).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["MAX_BUDGET", "PROBE_TOKENS", "TARGET_STEP_S", "budget_for_rate", "default_token_budget",
           "prefill_rate"]

TARGET_STEP_S = 0.25  # seconds of prefill a step may add to every running stream's gap
PROBE_TOKENS = 64
MAX_BUDGET = 2048  # vLLM's default for online serving


def budget_for_rate(tokens_per_s: float, max_num_seqs: int, target_s: float = TARGET_STEP_S) -> int:
    """The budget that prefills in about ``target_s`` at ``tokens_per_s``: a multiple of 16 in
    ``[max_num_seqs, MAX_BUDGET]``."""
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s!r}")
    budget = int(tokens_per_s * target_s) // 16 * 16
    return max(max_num_seqs, min(MAX_BUDGET, budget))


def prefill_rate(model: Any, tokens: int = PROBE_TOKENS) -> float:
    """Prompt tokens a second that ``model`` prefills in one forward of ``tokens`` tokens (after a warm-up)."""
    import torch

    param = next(model.parameters())
    ids = torch.arange(tokens, device=param.device).remainder(max(1, model.config.vocab_size - 1))[None] + 1
    with torch.inference_mode():
        model(ids)  # warm-up: first-call allocations and kernel choices
        t0 = time.perf_counter()
        model(ids)
        if param.device.type == "cuda":
            torch.cuda.synchronize(param.device)
        seconds = time.perf_counter() - t0
    return tokens / max(seconds, 1e-6)


def default_token_budget(model: Any, max_num_seqs: int) -> tuple[int, str]:
    """``(budget, how it was chosen)`` for ``model`` on its device."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return MAX_BUDGET, "vLLM's default on a CUDA device"
    rate = prefill_rate(model)
    return budget_for_rate(rate, max_num_seqs), (f"{device.type} prefills {rate:,.0f} tokens/s: about "
                                                 f"{TARGET_STEP_S:g} s of prefill a step")
