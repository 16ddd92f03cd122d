"""The two RoPE building blocks the library needs: inverse frequencies and the "rotate half" turn
(torch only).

The pairing convention is the one of transformers' Llama/Qwen2 code: dimension i is paired with
dimension i + head_dim/2. ``kvlab.blend`` re-rotates cached keys with these. Notebook 03 writes RoPE
in its own cells; a test checks its copy of these two agrees with this one.
"""

from __future__ import annotations

import torch


def inverse_frequencies(
    head_dim: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """``theta ** (-2i / head_dim)`` for i = 0 .. head_dim/2 - 1: fast rotation first, slow last.
    (head_dim/2,)"""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90-degree turn of each
    pair."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
