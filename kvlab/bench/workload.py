"""A token-id workload (prompts in submission order, metadata per prompt) and the article's headline
one (no torch).

``sys512(vocab_size)``: the article's headline experiment (its section 3.5): 16 requests sharing a
512-token prefix, each with a 32-token suffix of its own and 32 new tokens, random ids, seeded.
``ideal_prefill_fraction``: the share of prompt tokens still computed when the shared prefix's whole
blocks are computed once. Prompts are lists of ints, so one workload runs through kvlab's engine,
transformers and vLLM alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvlab.cache import DEFAULT_BLOCK_SIZE

__all__ = ["Workload", "ideal_prefill_fraction", "sys512"]


@dataclass
class Workload:
    """Token-id prompts, submitted in this order, with one metadata dict per prompt."""

    name: str
    prompts: list[list[int]]
    max_tokens: int  # new tokens per request
    meta: list[dict[str, Any]] = field(default_factory=list)
    shared_prefix_tokens: int = (
        0  # tokens that every prompt of one prefix shares (0 when it varies)
    )

    def __len__(self) -> int:
        return len(self.prompts)

    def served(self) -> list[int]:
        """Indices of the prompts that are scored (donors only fill the cache)."""
        return [i for i, m in enumerate(self.meta) if m.get("role", "served") == "served"]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all requests together."""
        return sum(map(len, self.prompts))


def sys512(
    vocab_size: int,
    num_requests: int = 16,
    prefix_tokens: int = 512,
    suffix_tokens: int = 32,
    max_tokens: int = 32,
    seed: int = 0,
) -> Workload:
    """``num_requests`` random-id prompts sharing a ``prefix_tokens`` prefix, each with its own
    suffix."""
    if min(num_requests, suffix_tokens, max_tokens) < 1 or prefix_tokens < 0:
        raise ValueError("need num_requests, suffix_tokens, max_tokens >= 1 and prefix_tokens >= 0")
    rng = random.Random(f"kvlab-sys512:{seed}")
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_tokens)]
    prompts = [
        prefix + [rng.randrange(vocab_size) for _ in range(suffix_tokens)]
        for _ in range(num_requests)
    ]
    meta = [{"request": i, "role": "served"} for i in range(num_requests)]
    name = f"sys{prefix_tokens}" + ("" if (num_requests, suffix_tokens, max_tokens) == (16, 32, 32)
                                     else f"x{num_requests}/s{suffix_tokens}/n{max_tokens}")
    return Workload(name, prompts, max_tokens, meta, prefix_tokens)


def ideal_prefill_fraction(workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Uncached prompt tokens / all prompt tokens when the shared prefix is computed once (whole
    blocks only).

    The first request computes everything; each later one reuses the prefix's full blocks, capped so
    its last prompt token is computed (as kvlab's and vLLM's block managers do).
    """
    total = workload.prompt_tokens
    p = workload.shared_prefix_tokens
    hits = [
        min(p // block_size, (len(ids) - 1) // block_size) * block_size
        for ids in workload.prompts[1:]
    ]
    return (total - sum(hits)) / total
