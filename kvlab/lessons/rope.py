"""The cos/sin tables a Hugging Face model computes itself, to check notebook 03's RoPE against them.

Notebook 03 writes RoPE in its cells (``kvlab.built.nb03``: ``inverse_frequencies``, ``cos_sin``, ``rotate_half``,
``apply_rope``, ``rerotate``, ``rope_score``, ``rope_theta``, ``head_dim_of``): import them from there.
"""

from __future__ import annotations

from typing import Any

import torch


def hf_cos_sin(model: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin a Hugging Face Llama/Qwen2 model computes for ``positions`` (batch, seq), for comparison."""
    rotary, p = model.model.rotary_emb, next(model.parameters())
    return rotary(torch.zeros(1, device=p.device, dtype=p.dtype), positions.to(p.device))  # each (batch, seq, head_dim)
