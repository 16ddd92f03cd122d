"""Worked solutions of the notebooks' exercises, one function per exercise.

Tested against the checkers in ``tests/test_exercises.py``; never imported by a notebook (each exercise
starts blank there). One block per notebook, in notebook order.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- 00 the passphrase experiment

# ----------------------------------------------------------------------------- 01 QKV and the KV cache

# ----------------------------------------------------------------------------- 02 manual prefix reuse

# ----------------------------------------------------------------------------- 03 position encoding

# ----------------------------------------------------------------------------- 04 the paged block manager

# ----------------------------------------------------------------------------- 05 shared vs isolated

def ex05_1_bug_rows() -> dict[int, str]:
    """05.1: the decision-table row each group's bug breaks (group 2 breaks "overlap-different-start" as well)."""
    return {1: "positions-agree", 2: "same-start", 3: "independent-context"}


def ex05_2_kv_ratio(num_requests: int = 16, prefix_tokens: int = 512, private_tokens: int = 63,
                    block_size: int = 16) -> float:
    """05.2: block-granular shared / isolated KV bytes: the prefix's full blocks once, every other block per request."""
    full = prefix_tokens // block_size
    per_request = -(-(prefix_tokens + private_tokens) // block_size)
    return (full + num_requests * (per_request - full)) / (num_requests * per_request)


def ex05_3_position_fix():
    """05.3: a subclass of the buggy engine that numbers the computed tokens from where they sit (cache kept on)."""
    from kvlab.lessons.nb05_table36 import PositionRestartEngine

    class FixedPositions(PositionRestartEngine):
        def _positions(self, item):
            return range(item.start, item.end)

    return FixedPositions

# ----------------------------------------------------------------------------- 06 vLLM side by side

def ex06_1_cached_tokens(prompt_tokens: int = 250, shared_tokens: int = 200, block_size: int = 32) -> int:
    """06.1: whole blocks of the shared part, never the last prompt token."""
    return min(shared_tokens, prompt_tokens - 1) // block_size * block_size


def ex06_2_ttft_ideal(prompt_tokens: int, cached_tokens: int) -> float:
    """06.2: the share of prompt tokens that still need a forward pass."""
    return (prompt_tokens - cached_tokens) / prompt_tokens


def ex06_3_batch_counts() -> bool:
    """06.3: True: a block is registered under its hash when it is allocated, so a request admitted in the same
    step hits it; the step writes every new token's K/V in each layer before attention reads it."""
    return True

# ----------------------------------------------------------------------------- 07 isolation and security
