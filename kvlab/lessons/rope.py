"""Rotary position embedding (RoPE) from scratch, and re-rotation of cached keys.

RoPE (Su et al. 2021, "RoFormer") encodes position m by rotating each pair of dimensions of a query
or key by the angle ``m * inv_freq[i]``. Two facts carry notebook 03:

* a rotation by m followed by a rotation by d is a rotation by m + d, so a key cached at position m
  can be *moved* to position m + d by rotating it again by d (``rerotate``);
* the score q_m . k_n depends on m - n only, so shifting every position by the same amount changes
  nothing, while shifting the prefix but not the suffix changes every distance between them.

The pairing convention is the one of transformers' Llama/Qwen2 code ("rotate half"): dimension i
is paired with dimension i + head_dim/2, and ``cos``/``sin`` are laid out as ``cat(freqs, freqs)``.
Tensors are created on the device of their inputs. Shapes: keys and queries are
``(batch, heads, seq, head_dim)``; positions are ``(seq,)`` or ``(batch, seq)``.
"""

from __future__ import annotations

from typing import Any

import torch

# the two building blocks live in the engine (the library never imports lessons); re-exported here
from kvlab.engine.rope import inverse_frequencies, rotate_half

__all__ = [
    "apply_rope", "cos_sin", "head_dim_of", "hf_cos_sin", "inverse_frequencies", "rerotate", "rope_score",
    "rope_theta", "rotate_half",
]


def rope_theta(config: Any) -> float:
    """The RoPE base of an HF config (``rope_parameters['rope_theta']`` in transformers 5, else ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise NotImplementedError(f"only plain RoPE is implemented here, this config uses {kind!r}")
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def head_dim_of(config: Any) -> int:
    """Per-head dimension of an HF config."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions``: each (..., seq, head_dim), laid out as cat(freqs, freqs)."""
    inv = inverse_frequencies(head_dim, theta, device=positions.device)  # (head_dim/2,)
    freqs = positions[..., None].float() * inv  # (..., seq, head_dim/2): the angle of each pair
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., seq, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor | int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate queries or keys x (batch, heads, seq, head_dim) to ``positions``.

    ``positions`` is (seq,), (batch, seq) or a single int applied to every token (a uniform rotation).
    """
    seq, head_dim = x.shape[-2], x.shape[-1]
    if isinstance(positions, int):
        positions = torch.full((seq,), positions, device=x.device)
    positions = torch.as_tensor(positions, device=x.device)
    cos, sin = cos_sin(positions, head_dim, theta, dtype=x.dtype)  # (seq, D) or (batch, seq, D)
    if cos.dim() == 3:  # per-row positions: broadcast over heads
        cos, sin = cos[:, None], sin[:, None]  # (batch, 1, seq, D)
    return x * cos + rotate_half(x) * sin


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Move RoPE'd keys (batch, kv_heads, seq, head_dim) from positions p to p + delta.

    Rotations of a pair compose by adding angles, so rotating by ``delta`` more is exact: a key
    computed at p and re-rotated equals the same pre-RoPE key computed at p + delta, up to float error.
    It fixes *where* a key sits; it cannot fix *what* it encodes (see notebook 03, experiment 3).
    """
    return apply_rope(keys, delta, theta)  # R(delta) R(p) k = R(p + delta) k


def rope_score(q: torch.Tensor, k: torch.Tensor, m: int, n: int, theta: float = 10000.0) -> float:
    """The attention score of query q at position m with key k at position n (q, k: (head_dim,))."""
    qm = apply_rope(q.reshape(1, 1, 1, -1), m, theta)
    kn = apply_rope(k.reshape(1, 1, 1, -1), n, theta)
    return float((qm * kn).sum())


def hf_cos_sin(model: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin a Hugging Face Llama/Qwen2 model computes for ``positions`` (batch, seq), for comparison."""
    rotary = model.model.rotary_emb
    p = next(model.parameters())
    x = torch.zeros(1, device=p.device, dtype=p.dtype)
    return rotary(x, positions.to(p.device))  # each (batch, seq, head_dim)
