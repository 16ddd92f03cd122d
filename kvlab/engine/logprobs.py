"""Log-probabilities of generated and prompt tokens, from the model's float32 logits (torch).

A generated token's record comes from the logits its step sampled from (``sampling.sample``), before
any penalty or temperature: vLLM's default ``raw_logprobs``. A prompt token's comes from the logits
at the position before it. The engine computes logits only for each request's last position; for a
request that asks for ``prompt_logprobs`` the runner hands this module the final hidden states of
every token the step computed (``record_prompt_logprobs``), which the LM head turns into logits in
slices.

Cached prompt tokens have no hidden states in a step: their K/V came from the cache. Where a
request's prefill starts after a cache hit of ``h`` tokens, positions ``h`` onwards come from the
step that read the cached K/V (so a wrong cached block shows up in their numbers), and positions ``0
.. h-1`` from one forward of the model over those ``h`` tokens, outside the paged path. A prompt
served half from the cache must then give the same ``prompt_logprobs`` as the same prompt computed
from scratch (tests/serve/test_api_surface.py prints the largest difference). vLLM instead skips the
cache for requests that ask for prompt log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TokenLogprob",
    "cached_vs_scratch",
    "record_prompt_logprobs",
    "token_logprobs",
]

# hidden rows turned into logits at once: 256 rows of a 49,152-token vocabulary are 48 MiB of
# float32
ROWS_PER_SLICE = 256


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One token's log-probability, its rank (1 = the most likely), and the ``k`` most likely
    tokens'."""

    token: int
    logprob: float
    rank: int
    # (token id, logprob), most likely first; empty when 0 were asked for
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Records of ``tokens[i]`` under ``logits[i]`` ((N, vocab) or (vocab,) for one token), with the
    top ``k``."""
    rows = logits.reshape(-1, logits.shape[-1]).float().log_softmax(-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=rows.device)[:, None]
    chosen = rows.gather(-1, ids)
    # vLLM's batched_count_greater_than: tokens at least as likely as the chosen one, itself
    # included
    ranks = (rows >= chosen).sum(-1).tolist()
    chosen = chosen[:, 0].tolist()
    if k:
        values, indices = rows.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, r, top) for t, lp, r, top in zip(tokens, chosen, ranks, tops)]


def _prompt_slots(seq: Any) -> list:
    """``seq.prompt_logprobs``: one slot per prompt token, None until computed (slot 0 stays None:
    no context)."""
    if getattr(seq, "prompt_logprobs", None) is None:
        seq.prompt_logprobs = [None] * len(seq.prompt_ids)
    return seq.prompt_logprobs


def _fill(runner: Any, seq: Any, slots: list, hidden: torch.Tensor, first_pos: int) -> None:
    """Slots of the prompt tokens that ``hidden`` rows (positions ``first_pos``...) predict."""
    prompt, k = seq.prompt_ids, seq.sampling.prompt_logprobs
    # the row at position p predicts prompt token p + 1
    n = min(hidden.shape[0], len(prompt) - 1 - first_pos)
    for a in range(0, max(n, 0), ROWS_PER_SLICE):
        b = min(n, a + ROWS_PER_SLICE)
        logits = runner.lm_head(hidden[a:b])
        targets = prompt[first_pos + a + 1 : first_pos + b + 1]
        for j, rec in enumerate(token_logprobs(logits, targets, k), start=first_pos + a + 1):
            slots[j] = rec


@torch.no_grad()
def _prefix_hidden(runner: Any, ids: list[int]) -> torch.Tensor:
    """Final hidden states of ``ids`` from one plain forward of the model (its own attention, no
    cache)."""
    runner.detach()
    try:
        x = torch.tensor([ids], device=runner.device)
        pos = torch.arange(len(ids), device=runner.device)[None]
        return runner.model.base_model(input_ids=x, position_ids=pos, use_cache=False)[0][0]
    finally:
        runner.attach()


@torch.no_grad()
def record_prompt_logprobs(runner: Any, items: list, hidden: torch.Tensor) -> None:
    """After a packed forward: fill the prompt log-probabilities of the scheduled requests that ask
    for them.

    ``hidden`` is the step's (T, hidden) final hidden states, item by item in order. A request's
    prompt positions computed by this step come from its rows; prompt positions before the step's
    first one that have no record yet (a cache hit) from ``_prefix_hidden``: one more forward, of
    the cached tokens, for such a request only.
    """
    offset = 0
    for it in items:
        seq, start, end = it.seq, it.start, it.end
        rows = end - start
        if seq.sampling.prompt_logprobs is not None and start < len(seq.prompt_ids):
            slots = _prompt_slots(seq)
            _fill(runner, seq, slots, hidden[offset : offset + rows], start)
            # positions before this step's first: computed by an earlier chunk, or served by the
            # cache
            before = min(start, len(seq.prompt_ids) - 1)
            if before > 0 and any(slots[j] is None for j in range(1, before + 1)):
                _fill(runner, seq, slots, _prefix_hidden(runner, seq.prompt_ids[:before]), 0)
        offset += rows


def cached_vs_scratch(make_engine: Any, prompt_ids: list[int], num_cached: int,
                      corrupt: Any = None) -> dict:
    """The cache check in numbers: ``prompt_logprobs`` of ``prompt_ids`` served after its first
    ``num_cached`` tokens filled the cache, against the same prompt from scratch (each on a fresh
    ``make_engine()``).

    ``corrupt(engine)``, if given, runs between filling the cache and the second request (e.g. scale
    the cached K): the difference it makes is what a prefix-cache bug looks like. Returns
    ``{"max_abs_diff", "num_cached_tokens", "num_prompt_tokens"}``; with a correct cache the
    difference is float noise (0 on the teaching path, where both runs do the same arithmetic).
    """
    from .sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    runs = []
    for warm in (False, True):
        engine = make_engine()
        if warm:
            engine.generate([prompt_ids[:num_cached]], sp)
            if corrupt is not None:
                corrupt(engine)
        runs.append(engine.generate([prompt_ids], sp)[0])
    scratch, cached = ([r.logprob for r in out.prompt_logprobs[1:]] for out in runs)
    return {"max_abs_diff": max(abs(a - b) for a, b in zip(scratch, cached)),
            "num_cached_tokens": runs[1].num_cached_tokens, "num_prompt_tokens": len(prompt_ids)}
