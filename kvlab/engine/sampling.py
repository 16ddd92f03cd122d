"""Picking the next token (torch): greedy, or seeded temperature/top-k/top-p sampling (``sample_next``).

The filters follow transformers' logits warpers, from a generator seeded per request, so a request's tokens do
not depend on what it was batched with; every accepted value is numerically safe (see ``sample_next``).
``SamplingParams`` (the allow-listed settings, no torch) lives in ``sampling_params`` and is re-exported here.
"""

from __future__ import annotations

import torch

from .sampling_params import STOP_ID_COLLECTIONS, SamplingParams

__all__ = ["STOP_ID_COLLECTIONS", "SamplingParams", "sample_next"]


def _limit_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scores ``(logits - max) / temperature`` in float64: 0 at the maximum, so softmax is defined (float32 out).

    A +inf logit (a half-precision overflow) is the most likely token: the +inf ones share the probability.
    NaN logits, or every logit -inf, leave nothing to sample: ``ValueError``.
    """
    top = logits.max()  # NaN if any logit is NaN
    if bool(top.isnan()) or bool(top == float("-inf")):
        raise ValueError("the logits are NaN or all -inf: no token can be sampled")
    if bool(top.isposinf()):
        return torch.where(logits == top, 0.0, float("-inf")).float()
    return ((logits - top) / temperature).float()  # 0 at the maximum, -inf (or very negative) elsewhere


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> int:
    """Pick the next token from (vocab,) logits: argmax, or temperature/top-k/top-p sampling.

    The filters follow transformers' logits warpers (temperature, then top-k, then top-p keeping at
    least one token) so seeded sampling reproduces ``model.generate`` token for token. A temperature
    so small that ``logits / temperature`` overflows (about 1e-38 and below in float32: to +inf, or to
    -inf everywhere when every logit is negative) would make every probability NaN; then the maximum
    is subtracted first, in float64, which gives the limit as the temperature goes to 0: the most
    likely tokens keep all the probability. Top-k and top-p never remove the most likely token, so the
    filtered scores keep a finite maximum and the probabilities are never NaN for finite logits.
    """
    if not do_sample:
        return int(torch.argmax(logits))
    scores = logits.float() / temperature
    if not bool(scores.max().isfinite()):  # NaN, +inf, or all -inf: overflowed, sample the t -> 0 limit stably
        scores = _limit_scores(logits.double(), temperature)
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
