"""Drawing one token from a request's logits (torch): temperature, ``min_p``, then top-k and top-p,
with a seeded generator (vLLM's ``vllm/v1/sample/ops/topk_topp_sampler.py``). ``sampling.sample``
calls it for a request whose temperature is above 0; greedy never comes here."""

from __future__ import annotations

import torch

__all__ = ["sample_next"]


def _limit_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scores as the temperature goes to 0: ``(logits - max) / temperature`` in float64 (+inf logits
    share it all)."""
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
    min_p: float = 0.0,
) -> int:
    """Pick the next token from (vocab,) logits: argmax, or temperature, min-p, then transformers'
    top-k, top-p warpers."""
    if not do_sample:
        return int(torch.argmax(logits))
    scores = logits.float() / temperature
    # NaN, +inf, or all -inf: overflowed, sample the t -> 0 limit stably
    if not bool(scores.max().isfinite()):
        scores = _limit_scores(logits.double(), temperature)
    if min_p > 0:
        # vLLM's apply_min_p: keep tokens with probability >= min_p x the largest (the top one
        # always stays)
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.max(), float("-inf"))
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
