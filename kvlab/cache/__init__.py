"""The prefix cache's bookkeeping in pure Python (no torch; relative imports only, so it copies
alone).

- ``hashing``: chained full-block hashes with extra keys (model fingerprint, tenant salt),
  ``DEFAULT_BLOCK_SIZE``
- ``block_pool``: blocks, reference counts, the LRU free list, lazy eviction
- ``block_manager``: block tables, prefix hits (vLLM's rules), append, free
- ``fork``: fork and copy-on-write; ``host_tier``: a second tier for evicted blocks; ``uncache``:
  blocks whose K/V was never written leave the cache; ``debug``: invariants, reports
- ``metrics``: hit-rate counters
- ``interface``: what every cache shares (``SeqState``, ``SequenceTables``, the prompt checks), and
  re-exported there: ``protocol``'s ``CacheManager``, the protocol the engine and scheduler use
  (``BlockManager`` implements it), and ``scope``'s ``TenantScope`` (the ``cache_salt``)
- ``kv_events``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in vLLM's schema
  (``enable_kv_events=True``)

Copy this folder under any name and ``from mykv import BlockManager`` works with a bare Python.
"""

from .block_manager import AllocationPlan, BlockManager, cdiv
from .block_pool import Block, BlockPool, NoFreeBlocksError
from .debug import InvariantError
from .hash_tools import hash_token_blocks
from .hashing import DEFAULT_BLOCK_SIZE, hash_block, prompt_block_hashes, salted_block
from .interface import NO_SCOPE, CacheManager, CacheSeq, TenantScope, check_cache, missing_members
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from .metrics import PrefixCacheMetrics

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "NO_SCOPE",
    "AllBlocksCleared",
    "AllocationPlan",
    "Block",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "CacheManager",
    "CacheSeq",
    "EventBatch",
    "TenantScope",
    "cdiv",
    "check_cache",
    "missing_members",
    "BlockPool",
    "InvariantError",
    "NoFreeBlocksError",
    "PrefixCacheMetrics",
    "hash_block",
    "hash_token_blocks",
    "prompt_block_hashes",
    "salted_block",
]
