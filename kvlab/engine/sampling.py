"""Picking the next token (torch): greedy, or seeded temperature/min-p/top-k/top-p sampling
(docs/engine.md).

vLLM v1's order (``vllm/v1/sample/sampler.py``): the log-probabilities a request asks for come from
the raw logits; then ``logit_bias``, ``min_tokens`` (eos and stop ids masked) and the penalties
change the logits (``logits_processors.process_logits``, only for a request that sets one), and
greedy takes their argmax; sampling divides by the temperature, applies ``min_p``, then top-k and
top-p (``topk_topp_sampler.sample_next``, as vLLM's ``vllm/v1/sample/ops/topk_topp_sampler.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from .logits_processors import process_logits
from .logprobs import token_logprobs
from .sampling_params import STOP_ID_COLLECTIONS, SamplingParams
from .topk_topp_sampler import sample_next

__all__ = ["STOP_ID_COLLECTIONS", "SamplingParams", "process_logits", "sample", "sample_next"]


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
    if sp.greedy:
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
