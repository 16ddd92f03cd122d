"""Picking the next token (torch): greedy, or seeded temperature/min-p/top-k/top-p sampling
(docs/engine.md).

vLLM v1's order (``vllm/v1/sample/sampler.py``): the log-probabilities a request asks for come from
the raw logits; then ``logit_bias``, ``min_tokens`` (eos and stop ids masked) and the penalties
change the logits (``logits_processors.process_logits``, only for a request that sets one), and
greedy takes their argmax; sampling divides by the temperature, applies ``min_p``, then top-k and
top-p.
"""

from __future__ import annotations

from typing import Any

import torch

from .logits_processors import process_logits
from .logprobs import token_logprobs
from .sampling_params import STOP_ID_COLLECTIONS, SamplingParams

__all__ = ["STOP_ID_COLLECTIONS", "SamplingParams", "process_logits", "sample", "sample_next"]


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


def sample(seq: Any, logits: torch.Tensor, top: int, eos_ids: Any = ()) -> int:
    """The next token of request ``seq`` from its (vocab,) ``logits`` (``top``: their argmax).

    Greedy is ``top`` unless the request's logits are processed (``process_logits``: then their
    argmax). When the request asks for ``logprobs``, the chosen token's record is appended to
    ``seq.logprobs`` (from the raw logits, as vLLM's default ``raw_logprobs``). ``eos_ids``: what
    ``min_tokens`` holds back.
    """
    sp = seq.sampling
    scores = (
        process_logits(sp, logits, seq.prompt_ids, seq.output_ids, eos_ids)
        if sp.processes_logits
        else logits
    )
    if sp.temperature == 0:
        token = top if scores is logits else int(torch.argmax(scores))
    else:
        token = sample_next(
            scores, True, sp.temperature, sp.top_p, sp.top_k, seq.generator, sp.min_p
        )
    if sp.logprobs is not None:
        if getattr(seq, "logprobs", None) is None:
            seq.logprobs = []
        seq.logprobs.append(token_logprobs(logits, [token], sp.logprobs)[0])
    return token
