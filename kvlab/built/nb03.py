"""What notebook 03_position_encoding_pitfalls.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


# --- 03_position_encoding_pitfalls.ipynb, cell 5 ---
def inverse_frequencies(head_dim: int, theta: float = 10000.0,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """(head_dim/2,): theta ** (-2i / head_dim) for i < head_dim/2; pair 0 turns fastest."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    two_i = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)  # 0, 2, 4, ...
    return 1.0 / (theta ** (two_i / head_dim))


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions``: each (..., seq, head_dim), laid out as cat(freqs, freqs)."""
    freqs = positions[..., None].float() * inverse_frequencies(head_dim, theta, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., seq, D/2) twice: pair i sits at i and i + D/2
    return emb.cos().to(dtype), emb.sin().to(dtype)


# --- 03_position_encoding_pitfalls.ipynb, cell 7 ---
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: a 90-degree turn of each pair."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor | int,
               theta: float = 10000.0) -> torch.Tensor:
    """Rotate queries or keys x (B, H, seq, D) to ``positions``: (seq,), (B, seq) or one int."""
    if isinstance(positions, int):
        positions = torch.full((x.shape[-2],), positions, device=x.device)
    cos, sin = cos_sin(torch.as_tensor(positions, device=x.device), x.shape[-1], theta, x.dtype)
    if cos.dim() == 3:  # per-row positions (batch, seq, D): broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin  # each pair (a, b) -> (a cos - b sin, b cos + a sin)


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Move RoPE'd keys (B, kv_heads, seq, D) from positions p to p + delta: angles add."""
    return apply_rope(keys, delta, theta)  # R(delta) R(p) k = R(p + delta) k


# --- 03_position_encoding_pitfalls.ipynb, cell 9 ---
def rope_theta(config: Any) -> float:
    """HF config's RoPE base: ``rope_parameters['rope_theta']`` (transformers 5) or rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise NotImplementedError("only plain RoPE is implemented here, this config uses "
                                  f"{params['rope_type']!r}")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def head_dim_of(config: Any) -> int:
    """Per-head dimension of an HF config."""
    return int(getattr(config, "head_dim", 0) or config.hidden_size // config.num_attention_heads)


# --- 03_position_encoding_pitfalls.ipynb, cell 17 ---
def rope_score(q: torch.Tensor, k: torch.Tensor, m: int, n: int, theta: float = 10000.0) -> float:
    """The attention score of query q at position m with key k at position n (q, k: (head_dim,))."""
    qm = apply_rope(q.reshape(1, 1, 1, -1), m, theta)  # q turned to position m
    kn = apply_rope(k.reshape(1, 1, 1, -1), n, theta)  # k turned to position n
    return float((qm * kn).sum())


# --- 03_position_encoding_pitfalls.ipynb, cell 22 ---
def token_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Fraction of the reference's generated tokens that ``other`` reproduces at the same step."""
    if not reference:
        raise ValueError("the reference generated no tokens")
    return sum(a == b for a, b in zip(reference, other)) / len(reference)
