"""Picking the next token (torch): greedy, or seeded temperature/top-k/top-p sampling (docs/engine.md)."""

from __future__ import annotations

from typing import Any

import torch

from .sampling_params import STOP_ID_COLLECTIONS, SamplingParams

__all__ = ["STOP_ID_COLLECTIONS", "SamplingParams", "sample", "sample_next"]


def _limit_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scores as the temperature goes to 0: ``(logits - max) / temperature`` in float64 (+inf logits share it all)."""
    # NaN if any logit is NaN
    top = logits.max()
    if bool(top.isnan()) or bool(top == float("-inf")):
        raise ValueError("the logits are NaN or all -inf: no token can be sampled")
    # a half-precision overflow: the most likely token
    if bool(top.isposinf()):
        return torch.where(logits == top, 0.0, float("-inf")).float()
    # 0 at the maximum, -inf (or very negative) elsewhere
    return ((logits - top) / temperature).float()


def sample_next(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> int:
    """Pick the next token from (vocab,) logits: argmax, or transformers' temperature, top-k, top-p warpers."""
    if not do_sample:
        return int(torch.argmax(logits))
    scores = logits.float() / temperature
    # NaN, +inf, or all -inf: overflowed, sample the t -> 0 limit stably
    if not bool(scores.max().isfinite()):
        scores = _limit_scores(logits.double(), temperature)
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - top_p)
        # always keep the most likely token: the probabilities are never NaN
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))


def sample(seq: Any, logits: torch.Tensor, top: int) -> int:
    """The next token of request ``seq`` from its (vocab,) ``logits``: ``top`` (their argmax) when greedy."""
    sp = seq.sampling
    if sp.temperature == 0:
        return top
    return sample_next(logits, True, sp.temperature, sp.top_p, sp.top_k, seq.generator)
