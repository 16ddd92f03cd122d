"""The torch side of the host tier: block K/V to host memory and back, and to other replicas
(docs/engine.md)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..cache.block_manager import BlockManager
from ..cache.hashing import BlockHash
from ..cache.host_tier import HostTier, TierEntry, TierLink, collect_blocks
from .kv_store import PagedKVStore
from .models import synchronize

__all__ = ["HostOffload", "to_wire"]


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy array for shipping (numpy pickles faster than a torch tensor; bf16
    as int16)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _from_wire(a: Any, dtype: torch.dtype) -> Any:
    if not isinstance(a, np.ndarray):
        return a
    # an array from Ray's object store is read-only; it is only read here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.int16 else t


class HostOffload:
    """A host tier for one engine: saves evicted blocks, restores them, exports and stages blocks
    for transfer."""

    def __init__(
        self,
        store: PagedKVStore,
        block_manager: BlockManager,
        capacity_bytes: int,
        *,
        offload: bool = True,
    ) -> None:
        if not isinstance(block_manager, BlockManager):
            raise ValueError(
                "a host tier needs the block cache (cache='blocks'): it is keyed by block hashes"
            )
        self.store, self.block_manager = store, block_manager
        self.tier = HostTier(
            capacity_bytes, block_manager.block_size, emit=block_manager.emit_event
        )
        self.link = TierLink(
            self.tier,
            store.bytes_per_block,
            offload=offload,
            save_payload=self.read_block,
            load_payload=self.write_block,
        )
        block_manager.attach_second_tier(self.link, self.link.on_evict)
        # device -> host, host -> device
        self.bytes_out = self.bytes_in = 0
        self.seconds_out = self.seconds_in = 0.0

    def read_block(self, block_id: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """Copy one block's K and V (every layer) to host memory: ``((k, v), nbytes)``, each (L,
        block_size, kv_heads, head_dim)."""
        t0 = time.perf_counter()
        k, v = (t[:, block_id].to("cpu", copy=True) for t in (self.store.k, self.store.v))
        synchronize(self.store.device)
        self.seconds_out += time.perf_counter() - t0
        self.bytes_out += self.store.bytes_per_block
        return (k, v), self.store.bytes_per_block

    def write_block(self, payload: Any, block_id: int) -> None:
        """Copy a host payload ``(k, v)`` into pool block ``block_id``; raises if it does not fit
        this store."""
        want = self.store.k[:, block_id]
        k, v = (_from_wire(t, want.dtype) for t in payload)
        for t in (k, v):
            if not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype:
                raise ValueError(
                    f"payload of shape {getattr(t, 'shape', None)} does not fit a block "
                    f"{tuple(want.shape)} "
                    f"{want.dtype}"
                )
        t0 = time.perf_counter()
        self.store.k[:, block_id].copy_(k)
        self.store.v[:, block_id].copy_(v)
        synchronize(self.store.device)
        self.seconds_in += time.perf_counter() - t0
        self.bytes_in += self.store.bytes_per_block

    def export(
        self, hashes: Sequence[BlockHash], parent: BlockHash | None = None
    ) -> list[TierEntry]:
        """The leading blocks of ``hashes`` (``parent``: the hash before them) this engine holds,
        copied to host tensors."""
        return collect_blocks(
            self.block_manager,
            self.tier,
            list(hashes),
            self.read_for_wire,
            parent,
            lambda kv: tuple(to_wire(t) for t in kv),
        )

    def read_for_wire(self, block_id: int) -> tuple[tuple[np.ndarray, np.ndarray], int]:
        """``read_block`` with numpy payloads, to ship to another process."""
        (k, v), nbytes = self.read_block(block_id)
        return (to_wire(k), to_wire(v)), nbytes

    def stage(self, entries: Sequence[TierEntry]) -> int:
        """Stage blocks a peer exported into this tier (hashes checked against content); how many
        were taken."""
        return self.link.stage(list(entries), self.block_manager.hash_fn)

    def stats(self) -> dict:
        """The tier's counts plus bytes and seconds copied each way."""
        return {
            **self.link.stats(),
            "bytes_to_host": self.bytes_out,
            "bytes_from_host": self.bytes_in,
            "seconds_to_host": self.seconds_out,
            "seconds_from_host": self.seconds_in,
        }
