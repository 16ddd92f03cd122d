"""Picking the next token (torch): greedy, or seeded temperature/min-p/top-k/top-p sampling
(docs/engine.md).

vLLM v1's order (``vllm/v1/sample/sampler.py``): the log-probabilities a request asks for come from
the raw logits; then ``logit_bias``, ``min_tokens`` (eos and stop ids masked) and the penalties
change the logits, and greedy takes their argmax; sampling divides by the temperature, applies
``min_p``, then top-k and top-p.
"""

from __future__ import annotations

from typing import Any

import torch

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


def process_logits(
    sp: SamplingParams,
    logits: torch.Tensor,
    prompt_ids: list[int],
    output_ids: list[int],
    eos_ids: Any = (),
) -> torch.Tensor:
    """(vocab,) float32 logits after ``logit_bias``, ``min_tokens`` and the penalties, as vLLM v1
    applies them.

    ``min_tokens``: while fewer tokens were generated, eos (``eos_ids``) and ``stop_token_ids`` are
    -inf. Penalties (vLLM's ``apply_penalties``): a token of the prompt or the output has its logit
    divided by ``repetition_penalty`` when positive, multiplied when not; then ``frequency_penalty``
    x its count in the output and ``presence_penalty`` (if it occurs in the output) are subtracted.
    """
    out = logits.float().clone()
    vocab = out.shape[-1]
    if sp.logit_bias:
        ids = torch.tensor(
            [t for t, _ in sp.logit_bias if t < vocab], dtype=torch.long, device=out.device
        )
        bias = torch.tensor(
            [b for t, b in sp.logit_bias if t < vocab], dtype=out.dtype, device=out.device
        )
        out.index_add_(0, ids, bias)
    if sp.min_tokens and len(output_ids) < sp.min_tokens:
        stops = [t for t in {*eos_ids, *sp.stop_token_ids} if t < vocab]
        if stops:
            out[torch.tensor(stops, dtype=torch.long, device=out.device)] = float("-inf")
    if sp.repetition_penalty != 1 or sp.frequency_penalty or sp.presence_penalty:
        counts = torch.zeros(vocab, dtype=out.dtype, device=out.device)
        if output_ids:
            counts.index_add_(0, torch.tensor(output_ids, dtype=torch.long, device=out.device),
                              torch.ones(len(output_ids), dtype=out.dtype, device=out.device))
        seen = counts > 0
        if sp.repetition_penalty != 1:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            in_prompt[torch.tensor(prompt_ids, dtype=torch.long, device=out.device)] = True
            penalty = torch.where(in_prompt | seen, sp.repetition_penalty, 1.0).to(out.dtype)
            out = torch.where(out > 0, out / penalty, out * penalty)
        out = out - sp.frequency_penalty * counts - sp.presence_penalty * seen.to(out.dtype)
    return out


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
