"""A request's sampling parameters, checked against an allow-list per field (pure Python;
docs/engine.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import refused

__all__ = ["MAX_LOGPROBS", "STOP_ID_COLLECTIONS", "SamplingParams", "make_sampling"]

# what stop_token_ids may be given as
STOP_ID_COLLECTIONS = (list, tuple, set, frozenset, range)
# most top log-probabilities a token may ask for (vLLM's default max_logprobs, OpenAI's top_logprobs
# cap)
MAX_LOGPROBS = 20
# a logit_bias value's bound (OpenAI's)
MAX_LOGIT_BIAS = 100.0


def _is_real(x: object) -> bool:
    """An int or float that is not a bool (bool is an int subclass; numpy floats subclass float)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request decodes: length, greedy or seeded sampling, stop tokens, penalties,
    log-probabilities.

    The fields past ``stop_token_ids`` have vLLM's meaning (``vllm/sampling_params.py``), each
    neutral by default: penalties over the prompt and output tokens, ``min_p`` relative to the top
    token's probability, ``min_tokens`` before an eos or stop token may be sampled, ``logit_bias``
    added to the logits, and ``logprobs`` / ``prompt_logprobs``: how many top log-probabilities to
    return per generated / prompt token (None = none; 0 = only the chosen token's), from the model's
    raw float32 logits (kvlab.engine.logprobs).
    """

    max_tokens: int = 16
    # 0 = greedy
    temperature: float = 0.0
    top_p: float = 1.0
    # 0 = off
    top_k: int = 0
    # None = drawn from the engine's seeded RNG
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # subtracted once from every token that appears in the output so far, in [-2, 2]
    presence_penalty: float = 0.0
    # subtracted per occurrence in the output so far, in [-2, 2]
    frequency_penalty: float = 0.0
    # > 1 discourages tokens of the prompt or output: positive logits divided by it, negative
    # multiplied
    repetition_penalty: float = 1.0
    # in [0, 1]: drop tokens whose probability is below min_p x the top token's (sampling only)
    min_p: float = 0.0
    # eos and stop_token_ids are not sampled before this many output tokens
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits; a dict is accepted and kept as sorted pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # top log-probabilities per generated token (None = none)
    logprobs: int | None = None
    # top log-probabilities per prompt token (None = none)
    prompt_logprobs: int | None = None
    # derived, not given: whether the logits change before the choice (penalties, bias, min_tokens,
    # min_p); else greedy's choice is the argmax. Set once in __post_init__, so a step reads a field
    processes_logits: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stops = self.stop_token_ids
        if not isinstance(stops, STOP_ID_COLLECTIONS):
            raise TypeError(
                "stop_token_ids must be a list, tuple, set or range of ints, got "
                f"{type(stops).__name__} "
                "(an iterator or generator would be used up by validation: pass list(...))"
            )
        # frozen: set once, here
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        # a ValueError names the first parameter that is out of range
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )

        self._check_vllm_fields()
        processes = (self.presence_penalty or self.frequency_penalty or self.logit_bias
                     or self.repetition_penalty != 1 or self.min_tokens or self.min_p)
        object.__setattr__(self, "processes_logits", bool(processes))

    def _check_vllm_fields(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not 0 < rp < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}"
            )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if type(self.min_tokens) is not int or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}"
            )
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(sorted(bias.items()))
        if not isinstance(bias, (tuple, list)) or any(
            not isinstance(p, (tuple, list)) or len(p) != 2 for p in bias
        ):
            raise TypeError(
                "logit_bias must be a dict of token id -> bias, got "
                f"{type(self.logit_bias).__name__}"
            )
        bias = tuple((t, float(b) if _is_real(b) else b) for t, b in bias)
        object.__setattr__(self, "logit_bias", bias)
        for t, b in bias:
            if type(t) is not int or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not _is_real(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax (temperature 0)."""
        return self.temperature == 0


def _sampling_field(fields: dict[str, Any]) -> str | None:
    """The field of ``fields`` at fault: the first one, in their order, that ``SamplingParams``
    refuses together with the fields before it (alone, or across fields: ``min_tokens`` after a
    smaller ``max_tokens``)."""
    given: dict[str, Any] = {}
    for name, value in fields.items():
        given[name] = value
        try:
            SamplingParams(**given)
        except (TypeError, ValueError):
            return name
    return None


def make_sampling(**fields: Any) -> SamplingParams:
    """``SamplingParams(**fields)``; a refusal is a ``RequestError`` whose ``field`` is the
    parameter at fault."""
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise refused(_sampling_field(fields), e) from None
