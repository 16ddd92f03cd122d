"""The server's default token budget per step (``--max-num-batched-tokens``), sized to the device.

With chunked prefill a long prompt is cut into chunks of the step's token budget, and every running
stream waits for each step: a step's time is a stream's inter-token gap. vLLM's 2,048 tokens a step
take a GPU a few milliseconds, but a CPU seconds (one 2,992-token prompt stalled two SmolLM2 streams
for 6.97 s on 2 cores). So the budget is what this device prefills in about ``TARGET_STEP_S``,
measured once at start on the model itself: a forward of 1 token (a step's fixed cost: every weight
read once) and one of ``PROBE_TOKENS`` more (the cost a token), after a warm-up. A step is given at
least 4 x its fixed cost, so that chunks small enough for the gap still spend most of a step on
prompt tokens (the throughput). The budget is rounded down to a multiple of 16 and kept in
``[max_num_seqs, 2048]`` (the scheduler needs one token per running sequence a step). On a CUDA
device it is 2,048, vLLM's default. Elsewhere it is at least ``MIN_CPU_BUDGET``: the probe times the
model's plain forward, which is slower than the engine's own path with its speed paths on, so it
underestimates the rate; and below 256 tokens a step the gap measured for short streams barely
shrank while prefill throughput fell by about half (issue 53's note gives the three budgets
measured).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = [
    "MAX_BUDGET",
    "MIN_CPU_BUDGET",
    "PROBE_TOKENS",
    "TARGET_STEP_S",
    "budget_for_rate",
    "default_token_budget",
    "prefill_rate",
]

TARGET_STEP_S = 0.25  # seconds of prefill a step may add to every running stream's gap
PROBE_TOKENS = 64
MAX_BUDGET = 2048  # vLLM's default for online serving
# the least a step takes on a device other than CUDA (see the module docstring)
MIN_CPU_BUDGET = 256


def budget_for_rate(tokens_per_s: float, max_num_seqs: int, target_s: float = TARGET_STEP_S,
                    fixed_s: float = 0.0) -> int:
    """The budget whose step takes about ``max(target_s, 4 x fixed_s)`` at ``tokens_per_s`` past a
    fixed cost of ``fixed_s`` a step: a multiple of 16 in ``[max_num_seqs, MAX_BUDGET]``."""
    if not tokens_per_s > 0 or not fixed_s >= 0:
        raise ValueError(
            f"need tokens_per_s > 0 and fixed_s >= 0, got {tokens_per_s!r}, {fixed_s!r}"
        )
    step = max(target_s, 4 * fixed_s)
    budget = int(tokens_per_s * (step - fixed_s)) // 16 * 16
    return max(max_num_seqs, min(MAX_BUDGET, budget))


def prefill_rate(model: Any, tokens: int = PROBE_TOKENS) -> tuple[float, float]:
    """``(prompt tokens a second past the fixed cost, the fixed cost of a forward in seconds)`` of
    ``model``: a forward of 1 token and one of ``1 + tokens`` tokens, after a warm-up."""
    import torch

    param = next(model.parameters())
    ids = (
        torch.arange(1 + tokens, device=param.device).remainder(
            max(1, model.config.vocab_size - 1)
        )[None]
        + 1
    )

    def timed(x) -> float:
        t0 = time.perf_counter()
        model(x)
        if param.device.type == "cuda":
            torch.cuda.synchronize(param.device)
        return time.perf_counter() - t0
    with torch.inference_mode():
        model(ids)  # warm-up: first-call allocations and kernel choices
        fixed, whole = timed(ids[:, :1]), timed(ids)
    return tokens / max(whole - fixed, 1e-6), fixed


def default_token_budget(model: Any, max_num_seqs: int) -> tuple[int, str]:
    """``(budget, how it was chosen)`` for ``model`` on its device."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return MAX_BUDGET, "vLLM's default on a CUDA device"
    rate, fixed = prefill_rate(model)
    measured = budget_for_rate(rate, max_num_seqs, fixed_s=fixed)
    floor = f"; at least {MIN_CPU_BUDGET}" if measured < MIN_CPU_BUDGET else ""
    return max(MIN_CPU_BUDGET, measured), (
        f"{device.type} prefills {rate:,.0f} tokens/s past {1e3 * fixed:.0f} ms a forward: a step "
        f"of about {max(TARGET_STEP_S, 4 * fixed):.2g} s{floor}"
    )
