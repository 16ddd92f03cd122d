"""A request's sampling parameters, checked against an allow-list per field (pure Python; docs/engine.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["STOP_ID_COLLECTIONS", "SamplingParams"]

# what stop_token_ids may be given as
STOP_ID_COLLECTIONS = (list, tuple, set, frozenset, range)


def _is_real(x: object) -> bool:
    """An int or float that is not a bool (bool is an int subclass; numpy floats subclass float)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request decodes: length, greedy or seeded sampling, stop tokens."""

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

    def __post_init__(self) -> None:
        stops = self.stop_token_ids
        if not isinstance(stops, STOP_ID_COLLECTIONS):
            raise TypeError(
                f"stop_token_ids must be a list, tuple, set or range of ints, got {type(stops).__name__} "
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

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax (temperature 0)."""
        return self.temperature == 0
