"""Paged K/V storage: per layer, ``[num_blocks, block_size, kv_heads, head_dim]`` tensors for K and V.

The block manager decides *where* each token's K/V lives (block id, offset); this module holds the
numbers. New K/V is written through a **slot mapping** (slot = block_id * block_size + offset, one per
token) and read back through **block tables** (a sequence's physical block ids in logical order).
Copy-on-write copies whole blocks (``copy_blocks``). The tensors start at zero, so a padded read of an
unused block is finite (attention masks it out; zeros keep 0 * value from becoming NaN).

Reference: vLLM ``vllm/attention/ops/paged_attn.py`` (``write_to_paged_cache``), nano-vllm
``nanovllm/layers/attention.py`` (``store_kvcache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .models import kv_shape

__all__ = ["PagedKVStore"]


class PagedKVStore:
    """K and V blocks for every layer of one model, on the model's device and in its dtype."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if min(num_layers, num_blocks, block_size, kv_heads, head_dim) < 1:
            raise ValueError("every size of the store must be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, blocks, block_size, kv_heads, head_dim)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model: Any, num_blocks: int, block_size: int) -> PagedKVStore:
        """A store shaped for ``model``'s config, on its device and in its dtype."""
        s = kv_shape(model.config)
        p = next(model.parameters())
        return cls(s["layers"], num_blocks, block_size, s["kv_heads"], s["head_dim"], p.dtype, p.device)

    @staticmethod
    def blocks_for_bytes(model: Any, nbytes: int, block_size: int) -> int:
        """How many blocks of ``block_size`` tokens fit in ``nbytes`` of K/V for ``model``."""
        s = kv_shape(model.config)
        per_block = 2 * s["layers"] * block_size * s["kv_heads"] * s["head_dim"] * next(model.parameters()).element_size()
        return nbytes // per_block

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.k.device

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole store (K and V, every layer)."""
        return self.num_blocks * self.bytes_per_block

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one layer's new K/V: token i goes to slot ``slot_mapping[i]``."""
        # slot_mapping (T,) int64; key, value (T, kv_heads, head_dim)
        flat_k = self.k[layer].view(-1, self.kv_heads, self.head_dim)  # (blocks * block_size, kv_heads, head_dim)
        flat_v = self.v[layer].view(-1, self.kv_heads, self.head_dim)
        flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read one layer's K/V through block tables: ``(B, max_blocks)`` -> two ``(B, max_blocks * block_size, kv_heads, head_dim)``."""
        b, m = block_tables.shape
        keys = self.k[layer][block_tables]  # (B, max_blocks, block_size, kv_heads, head_dim)
        values = self.v[layer][block_tables]
        return (keys.reshape(b, m * self.block_size, self.kv_heads, self.head_dim),
                values.reshape(b, m * self.block_size, self.kv_heads, self.head_dim))

    def read(self, layer: int, block_table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first ``length`` K/V entries of one layer: two ``(length, kv_heads, head_dim)``."""
        table = torch.as_tensor(list(block_table), dtype=torch.long, device=self.device)[None]
        keys, values = self.gather(layer, table)
        return keys[0, :length], values[0, :length]

    def clear_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero whole blocks in every layer (K/V a failed step wrote, possibly NaN, must not be read back)."""
        if not block_ids:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.k[:, idx] = 0
        self.v[:, idx] = 0

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a shared partial block)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
