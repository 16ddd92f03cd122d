"""Which ``kvlab.cache.CacheManager`` an ``Engine`` runs on: hash blocks, a radix tree, or the
caller's own, and whether its K/V fits the device before anything is allocated
(``check_kv_budget``)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..cache.block_manager import BlockManager
from ..cache.interface import CacheManager, check_cache
from ..cache.radix import RadixCache
from .config import CACHES, EngineConfig
from .models import blocks_for_bytes, kv_bytes_per_token, model_device_dtype, model_fingerprint

__all__ = [
    "CACHES",
    "RadixCacheManager",
    "adopt_cache",
    "available_memory",
    "check_kv_budget",
    "engine_cache",
    "make_cache_manager",
]

# host bytes of one block's bookkeeping (its Block, free-list entry, list slot: 353 by tracemalloc)
HOST_BYTES_PER_BLOCK = 512


class RadixCacheManager(RadixCache):
    """SGLang's radix tree as a ``kvlab.cache.CacheManager``: no KV events, no
    ``reset_prefix_cache``."""

    def take_events(self) -> list:
        """No events: vLLM's KV-event schema describes hash blocks (``make_cache_manager`` refuses
        the option)."""
        return []

    def reset_prefix_cache(self) -> bool:
        """Not offered by the radix tree: raise ``NotImplementedError``."""
        raise NotImplementedError("reset_prefix_cache needs cache='blocks'")


def engine_cache(
    model: Any, tokenizer: Any, config: EngineConfig, cache: object = None
) -> CacheManager:
    """An engine's cache: ``cache`` itself when it is an object (a ``CacheManager`` brings its own
    size), else one made from ``config`` with ``num_blocks`` blocks, else the blocks that fit
    ``kv_cache_bytes``, else 512."""
    if cache is not None and not isinstance(cache, str):
        adopted = adopt_cache(cache, config.num_blocks, config.kv_cache_bytes)
        check_kv_budget(model, adopted.num_blocks, adopted.block_size)
        return adopted
    n = config.num_blocks
    if n is None and config.kv_cache_bytes is not None:
        n = blocks_for_bytes(model, config.kv_cache_bytes, config.block_size)
    n = 512 if n is None else n
    # before the pool's blocks exist: 10**12 of them would take the host's memory first
    check_kv_budget(model, n, config.block_size)
    fingerprint = model_fingerprint(model, tokenizer, every_weight=False)
    return make_cache_manager(config, n, fingerprint)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (CPU: the host's MemAvailable); None where
    unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
            return torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory()
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def check_kv_budget(model: Any, num_blocks: int, block_size: int) -> int:
    """The bytes ``num_blocks`` blocks of ``block_size`` slots need (the K/V store on the model's
    device and the blocks' bookkeeping on the host); ``ValueError`` naming them, before anything is
    allocated, when the device or the host has less available."""
    device, dtype = model_device_dtype(model)
    kv = num_blocks * block_size * kv_bytes_per_token(model.config, dtype)
    host = num_blocks * HOST_BYTES_PER_BLOCK
    need = {device.type: kv + (host if device.type == "cpu" else 0)}
    if device.type != "cpu":
        need["cpu"] = host
    for kind, nbytes in need.items():
        have = available_memory(torch.device(kind) if kind != device.type else device)
        if have is not None and nbytes > have:
            raise ValueError(
                f"{num_blocks:,} blocks of {block_size:,} slots need {nbytes:,} bytes "
                f"({nbytes / 2**30:,.1f} GiB) "
                f"of {kind} memory ({kv:,} of K/V, {host:,} of block bookkeeping) but {have:,} are "
                f"available: lower num_blocks or block_size, or size the cache by kv_cache_bytes"
            )
    return kv + host


def make_cache_manager(
    config: EngineConfig, num_blocks: int, model_fingerprint: str = ""
) -> BlockManager | RadixCacheManager:
    """The engine's cache manager: ``BlockManager(num_blocks, block_size)`` or a radix tree of the
    same slots.

    ``config`` gives the kind (``cache``), ``block_size``, ``page_size``, ``isolation``,
    ``enable_prefix_caching`` and ``enable_kv_events``.
    """
    cache, block_size, page_size = config.cache, config.block_size, config.page_size
    enable_caching, enable_kv_events = config.enable_prefix_caching, config.enable_kv_events
    # the config checked every field
    if cache == "blocks":
        return BlockManager(
            num_blocks,
            block_size,
            model_fingerprint=model_fingerprint,
            enable_caching=enable_caching,
            enable_kv_events=enable_kv_events,
        )
    if enable_kv_events:
        raise ValueError(
            "KV events (vLLM's schema) describe hash blocks: use cache='blocks' with "
            "enable_kv_events=True"
        )
    # each salt has a root of its own: a public prefix cannot be shared
    if config.isolation == "public-prefix":
        raise ValueError(
            "the radix cache keeps each tenant's salt in its own tree and cannot share a public "
            "prefix across tenants: use cache='blocks' with isolation='public-prefix'"
        )
    slots = num_blocks * block_size
    if slots < page_size:
        raise ValueError(
            f"{num_blocks} blocks of {block_size} slots hold no page of {page_size} slots"
        )
    return RadixCacheManager(
        slots // page_size,
        page_size,
        model_fingerprint=model_fingerprint,
        enable_caching=enable_caching,
    )


def adopt_cache(cache: object, num_blocks: int | None, kv_cache_bytes: int | None) -> CacheManager:
    """A caller's own cache for ``Engine(cache=obj)``: a ``CacheManager`` (else ``TypeError``),
    empty, sized."""
    check_cache(cache)
    if num_blocks is not None or kv_cache_bytes is not None:
        raise ValueError(
            "a cache object brings its own size: leave num_blocks and kv_cache_bytes unset "
            f"(it has {cache.num_blocks} blocks of {cache.block_size} slots)"
        )
    for name in ("num_blocks", "block_size"):
        value = getattr(cache, name)
        if type(value) is not int or value <= 0:
            raise ValueError(f"the cache's {name} must be a positive int, got {value!r}")
    if len(cache.seqs):
        raise ValueError(
            f"the cache already holds {len(cache.seqs)} sequences: give each engine a fresh cache"
        )
    return cache
