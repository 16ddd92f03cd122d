"""Sampling parameters of one request, checked on construction (pure Python, no torch).

``temperature == 0`` means greedy (argmax), as in vLLM; ``temperature > 0`` samples with the
temperature, top-k and top-p filters of transformers' logits warpers (``kvlab.prefix.sample_next``)
from a generator seeded by ``seed``, so a request's tokens do not depend on what it was batched with.
Every accepted value is numerically safe: a temperature so small that ``logits / temperature``
overflows (around 1e-38 and below) samples from the limit of the distribution as the temperature goes
to 0, i.e. among the most likely tokens (``sample_next`` subtracts the maximum first).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request decodes: length, greedy or seeded sampling, stop tokens."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = drawn from the engine's seeded RNG
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax (temperature 0)."""
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first parameter that is out of range."""
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
