"""Paged K/V storage: every layer's K and V blocks, written through slot mappings, read through
block tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .models import kv_shape

__all__ = ["PagedKVStore"]


class PagedKVStore:
    """K and V blocks for every layer of one model, on the model's device and in its dtype."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if min(num_layers, num_blocks, block_size, kv_heads, head_dim) < 1:
            raise ValueError("every size of the store must be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        # head-major: a gather is contiguous per head
        shape = (num_layers, kv_heads, num_blocks, block_size, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)
        # k, v: token-major views (L, blocks, block_size, kv_heads, head_dim); zeros keep a padded
        # read finite
        self.k, self.v = (pages.permute(0, 2, 3, 1, 4) for pages in (self.k_pages, self.v_pages))
        # where the tensors live; K and V bytes of one block across all layers, and of the whole
        # store
        self.device = self.k.device
        self.bytes_per_block = 2 * self.k[:, 0].numel() * self.k.element_size()
        self.nbytes = num_blocks * self.bytes_per_block

    @classmethod
    def for_model(cls, model: Any, num_blocks: int, block_size: int) -> PagedKVStore:
        """A store shaped for ``model``'s config, on its device and in its dtype."""
        s, p = kv_shape(model.config), next(model.parameters())
        return cls(
            s["layers"], num_blocks, block_size, s["kv_heads"], s["head_dim"], p.dtype, p.device
        )

    def write_heads(
        self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store one layer's new K/V, two head-major ``(kv_heads, T, head_dim)`` (the layout the
        model computes them in): token i goes to slot ``slot_mapping[i]`` (T,)."""
        # each layer as (kv_heads, blocks * block_size, D)
        flat, dtype = (self.kv_heads, -1, self.head_dim), self.k_pages.dtype
        self.k_pages[layer].view(flat).index_copy_(1, slot_mapping, key.to(dtype))
        self.v_pages[layer].view(flat).index_copy_(1, slot_mapping, value.to(dtype))

    def gather_heads(
        self, layer: int, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V of the blocks ``block_ids`` (n,), in order: two contiguous ``(kv_heads, n
        * block_size, head_dim)``."""
        # each block's rows of one head: (kv_heads, blocks, block_size * D)
        blocks, out = (self.kv_heads, self.num_blocks, -1), (self.kv_heads, -1, self.head_dim)
        k = self.k_pages[layer].view(blocks).index_select(1, block_ids)
        return k.view(out), self.v_pages[layer].view(blocks).index_select(1, block_ids).view(out)

    def clear_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero whole blocks in every layer (K/V a failed step wrote, possibly NaN, must not be read
        back)."""
        if block_ids:
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
            self.k[:, idx] = self.v[:, idx] = 0

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a shared partial
        block)."""
        if pairs:
            src, dst = torch.tensor(list(zip(*pairs)), dtype=torch.long, device=self.device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
