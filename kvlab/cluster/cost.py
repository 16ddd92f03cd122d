"""The time a replica step takes, modelled from what it computed (pure Python; ``fit`` needs numpy).

``CostModel`` turns what a step ran into seconds: ``base + per_prefill_token x prefill tokens +
per_decode x decoding sequences + per_moved_token x tokens fetched from another replica``. Its
defaults are a *model*, not a measurement; ``CostModel.fit`` fits it to step times measured on real
replicas (notebook 09 fits it on its Ray run). The driver charges it under ``clock="model"``; the
simulator passes it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Seconds of one replica step from what it computed."""

    base: float = 5e-3  # per step (scheduling, launch, sampling)
    per_prefill_token: float = 5e-5
    per_decode: float = 2e-4  # per sequence decoding one token
    # per token of K/V fetched from another replica (notebook 11 measures it)
    per_moved_token: float = 5e-6

    def seconds(self, prefill_tokens: int, decodes: int, moved_tokens: int = 0) -> float:
        """Modelled duration of a step."""
        return (self.base + self.per_prefill_token * prefill_tokens + self.per_decode * decodes
                + self.per_moved_token * moved_tokens)

    @classmethod
    def fit(cls, rows: Sequence[tuple[int, int, float]]) -> CostModel:
        """Least squares on ``(prefill_tokens, decodes, seconds)`` rows of measured steps
        (coefficients >= 0)."""
        import numpy as np

        a = np.array([[1.0, p, d] for p, d, _ in rows])
        y = np.array([s for _, _, s in rows])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        coef = np.maximum(coef, 0.0)
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), cls.per_moved_token)
