"""Rotary position embedding (RoPE): the helpers around what notebook 03 writes in its cells.

``inverse_frequencies``, ``cos_sin``, ``rotate_half``, ``apply_rope`` and ``rerotate`` are written in notebook 03
and exported to ``kvlab.built.nb03``; this module re-exports them beside the config readers, the score and the
model's own tables used to check them.

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

# RoPE itself is written in notebook 03's cells and exported (scripts/export_notebooks.py); re-exported here
from kvlab.built.nb03 import apply_rope, cos_sin, inverse_frequencies, rerotate, rotate_half

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
