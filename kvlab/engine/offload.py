"""The torch side of the host tier: copy a block's K/V out of the paged store and back, and ship blocks between replicas.

``HostOffload`` wires a ``kvlab.cache.host_tier.HostTier`` to an engine's store and block manager through
``BlockManager.attach_second_tier``: ``on_evict`` (an evicted cached block is copied to host memory, all layers,
K and V) and the second tier (a prompt that misses the pool but hits the tier gets the block copied back
into a fresh pool block instead of recomputed); the tier's KV events join the block manager's
(``BlockManager.emit_event``). Engine: ``Engine(..., host_tier_bytes=N)``.

Between replicas the same entries travel: ``export`` reads the leading blocks of a chain of hashes that this
engine holds (pool, then tier) into host tensors; a peer ``stage``s them into its own tier (each block's hash
recomputed from its content first), and its next prompt with that prefix restores them as above. An
``ObjectStore`` carries them (``kvlab.cluster.object_store``: Ray's, or an in-process stand-in). Whatever fails on the way (the holder died, an entry was evicted before it was read, a payload
of the wrong shape) is a miss: the tokens are recomputed.

On a CPU both tiers are RAM: a "transfer" is a memcpy, and the numbers say what a copy costs against a
recompute, not what PCIe or a network would. On a GPU ``export``/``save`` are real device -> host copies.

References: vLLM ``vllm/v1/kv_offload`` (CPU offloading connector) and ``KVConnectorBase_V1``; LMCache;
Mooncake's transfer engine; NVIDIA Dynamo's NIXL-based KV transfer for disaggregated prefill/decode.
"""

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

__all__ = ["HostOffload", "to_wire"]


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy array for shipping (numpy pickles about 20x faster than torch tensors; bf16 as int16)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _from_wire(a: Any, dtype: torch.dtype) -> Any:
    if not isinstance(a, np.ndarray):
        return a
    with warnings.catch_warnings():  # an array from Ray's object store is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.int16 else t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostOffload:
    """A host tier for one engine: saves evicted blocks, restores them, exports and stages blocks for transfer."""

    def __init__(self, store: PagedKVStore, block_manager: BlockManager, capacity_bytes: int, *,
                 offload: bool = True) -> None:
        if not isinstance(block_manager, BlockManager):
            raise ValueError("a host tier needs the block cache (cache='blocks'): it is keyed by block hashes")
        self.store, self.block_manager = store, block_manager
        self.tier = HostTier(capacity_bytes, block_manager.block_size, emit=block_manager.emit_event)
        self.link = TierLink(self.tier, store.bytes_per_block, offload=offload, save_payload=self.read_block,
                             load_payload=self.write_block)
        block_manager.attach_second_tier(self.link, self.link.on_evict)
        self.bytes_out = self.bytes_in = 0  # device -> host, host -> device
        self.seconds_out = self.seconds_in = 0.0

    def read_block(self, block_id: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """Copy one block's K and V (every layer) to host memory: ``((k, v), nbytes)``, each (L, block_size, kv_heads, head_dim)."""
        t0 = time.perf_counter()
        k = self.store.k[:, block_id].to("cpu", copy=True)  # (L, block_size, kv_heads, head_dim)
        v = self.store.v[:, block_id].to("cpu", copy=True)
        _sync(self.store.device)
        nbytes = self.store.bytes_per_block
        self.seconds_out += time.perf_counter() - t0
        self.bytes_out += nbytes
        return (k, v), nbytes

    def write_block(self, payload: Any, block_id: int) -> None:
        """Copy a host payload ``(k, v)`` into pool block ``block_id``; raises if it does not fit this store."""
        want = self.store.k[:, block_id]
        k, v = (_from_wire(t, want.dtype) for t in payload)
        for t in (k, v):
            if not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype:
                raise ValueError(f"payload of shape {getattr(t, 'shape', None)} does not fit a block {tuple(want.shape)} "
                                 f"{want.dtype}")
        t0 = time.perf_counter()
        self.store.k[:, block_id].copy_(k)
        self.store.v[:, block_id].copy_(v)
        _sync(self.store.device)
        self.seconds_in += time.perf_counter() - t0
        self.bytes_in += self.store.bytes_per_block

    def export(self, hashes: Sequence[BlockHash], parent: BlockHash | None = None) -> list[TierEntry]:
        """The leading blocks of ``hashes`` (``parent``: the hash before them) this engine holds, copied to host tensors."""
        return collect_blocks(self.block_manager, self.tier, list(hashes), self.read_for_wire, parent,
                              lambda kv: tuple(to_wire(t) for t in kv))

    def read_for_wire(self, block_id: int) -> tuple[tuple[np.ndarray, np.ndarray], int]:
        """``read_block`` with numpy payloads, to ship to another process."""
        (k, v), nbytes = self.read_block(block_id)
        return (to_wire(k), to_wire(v)), nbytes

    def stage(self, entries: Sequence[TierEntry]) -> int:
        """Stage blocks a peer exported into this tier (hashes checked against content); how many were taken."""
        return self.link.stage(list(entries), self.block_manager.hash_fn)

    def stats(self) -> dict:
        """The tier's counts plus bytes and seconds copied each way."""
        return {**self.link.stats(), "bytes_to_host": self.bytes_out, "bytes_from_host": self.bytes_in,
                "seconds_to_host": self.seconds_out, "seconds_from_host": self.seconds_in}
