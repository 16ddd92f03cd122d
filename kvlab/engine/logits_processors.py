"""What changes a request's logits before the choice (torch): ``logit_bias``, ``min_tokens`` and
the repetition, frequency and presence penalties, in vLLM v1's order
(``vllm/v1/sample/sampler.py``). ``sampling.sample`` calls it only for a request whose
``SamplingParams.processes_logits`` is set."""

from __future__ import annotations

from typing import Any

import torch

from .sampling_params import SamplingParams

__all__ = ["process_logits"]


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
