"""Rotary position embedding (RoPE): notebook 03 writes it in its cells (``kvlab.built.nb03``: ``inverse_frequencies``,
``cos_sin``, ``rotate_half``, ``apply_rope``, ``rerotate``, ``rope_score``, ``rope_theta``, ``head_dim_of``); this module
serves those names to the code that imports them from here, beside the model's own tables to check them against.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.built import nb03 as _nb03


def __getattr__(name: str) -> Any:
    """``rope.apply_rope`` and the rest: notebook 03's exported code."""
    return getattr(_nb03, name)


def hf_cos_sin(model: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin a Hugging Face Llama/Qwen2 model computes for ``positions`` (batch, seq), for comparison."""
    rotary, p = model.model.rotary_emb, next(model.parameters())
    return rotary(torch.zeros(1, device=p.device, dtype=p.dtype), positions.to(p.device))  # each (batch, seq, head_dim)
