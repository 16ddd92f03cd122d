"""Prefix-cache metrics counted in tokens, with every miss given a reason.

vLLM reports prefix-cache queries and hits in tokens (``PrefixCacheStats``) and a hit rate; a 0 %
hit rate then looks the same whether the prompts were too short to fill a block, shared nothing, or
were evicted before they came back. Here each missed token gets one of three reasons:

- ``short``: not inside a cacheable full block: a prompt shorter than one block, the partial tail
  block, or the block holding the last prompt token (always recomputed, its logits are needed);
- ``no_prefix``: a full block whose content was never cached (nothing shared it);
- ``evicted``: a full block whose hash was cached before but was evicted by LRU.

Across tenants it counts blocks, not tokens: a hit on a block that another tenant's request
registered is a ``public_hit`` inside an operator's public prefix and a ``cross_tenant_hit``
anywhere else -- the number that must stay 0 when tenants are salted.

The per-tenant table is bounded: it keeps the ``max_tenants`` (default 1024) most recently seen
tenants; the counts of a tenant pushed out are added to one ``other`` row (``OTHER_TENANTS``), so
the rows still sum to the totals and a server that sees a new tenant (or unsafe salt) per request
keeps flat memory.

This file counts; ``kvlab.cache.debug`` reads the counts out (``as_dict``, ``tenant_table``).

References: vLLM ``vllm/v1/metrics/stats.py`` (``PrefixCacheStats``) and
``vllm/v1/core/kv_cache_manager.py`` (``make_prefix_cache_stats``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from .debug import OTHER_TENANTS, metrics_report, tenant_report

__all__ = ["MAX_TENANTS", "MISS_REASONS", "OTHER_TENANTS", "CacheCounts", "PrefixCacheMetrics"]

MISS_REASONS = ("short", "no_prefix", "evicted")
# rows of the per-tenant table; older tenants are summed into one "other" row (OTHER_TENANTS, in
# kvlab.cache.debug with the table's other columns)
MAX_TENANTS = 1024


@dataclass(slots=True)
class CacheCounts:
    """Queries and hits in tokens, and misses by reason, for one tenant or in total."""

    requests: int = 0
    # prompt tokens looked up
    queries: int = 0
    # prompt tokens served from the cache
    hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def hit_rate(self) -> float:
        """Hit tokens / query tokens (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def merge(self, other: CacheCounts) -> None:
        """Add another tenant's counts to these (requests included)."""
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits
        for reason, n in other.misses.items():
            self.misses[reason] += n


@dataclass(slots=True)
class PrefixCacheMetrics:
    """Everything the block manager counts: lookups, hash work, allocation, copy-on-write."""

    # first lookups only, as vLLM's PrefixCacheStats
    total: CacheCounts = field(default_factory=CacheCounts)
    # lookups again after a preemption
    preempted: CacheCounts = field(default_factory=CacheCounts)
    # key: the salt (None = no salt); least recently seen first, at most max_tenants of them
    by_tenant: OrderedDict[Hashable, CacheCounts] = field(default_factory=OrderedDict)
    # tenants pushed out of by_tenant, summed
    other: CacheCounts = field(default_factory=CacheCounts)
    max_tenants: int = MAX_TENANTS
    # hash function calls
    hashed_blocks: int = 0
    # tokens fed to the hash function
    hashed_tokens: int = 0
    # blocks taken from the free list (new data)
    blocks_taken: int = 0
    # blocks served by the cache
    blocks_hit: int = 0
    cow_copies: int = 0
    # blocks of a public prefix registered by one tenant and served to another
    public_hits: int = 0
    # any other block registered by one tenant and served to another
    cross_tenant_hits: int = 0

    def __post_init__(self) -> None:
        if type(self.max_tenants) is not int or self.max_tenants < 1:
            raise ValueError(f"max_tenants must be a positive int, got {self.max_tenants!r}")

    def record_blocks(self, hashed: int, block_size: int, hit: int = 0, taken: int = 0) -> None:
        """Count full blocks hashed (of ``block_size`` tokens each), blocks hit in the cache, blocks
        taken."""
        self.hashed_blocks += hashed
        self.hashed_tokens += hashed * block_size
        self.blocks_hit += hit
        self.blocks_taken += taken

    def record_lookup(
        self,
        tenant: Hashable,
        queries: int,
        hits: int,
        misses: dict[str, int],
        preempted: bool = False,
    ) -> None:
        """Count one request's prefix lookup, in total and for its tenant.

        ``preempted``: the request was preempted and is looked up again. As in vLLM, such lookups
        are counted apart (``preempted``), so ``requests`` counts requests and the hit rate counts
        first lookups.
        """
        if queries != hits + sum(misses.values()):
            raise ValueError("every queried token must be a hit or a miss with a reason")
        if preempted:
            rows = [self.preempted]
        else:
            # the tenant's row, now the most recently seen; a new row pushes the least recent into
            # other
            row = self.by_tenant.pop(tenant, None)
            if row is None and len(self.by_tenant) >= self.max_tenants:
                self.other.merge(self.by_tenant.popitem(last=False)[1])
            row = self.by_tenant[tenant] = row or CacheCounts()
            rows = [self.total, row]
        for c in rows:
            c.requests += 1
            c.queries += queries
            c.hits += hits
            for reason, n in misses.items():
                c.misses[reason] += n

    @property
    def hit_rate(self) -> float:
        """Overall hit rate in tokens."""
        return self.total.hit_rate

    def as_dict(self) -> dict:
        """A flat dict of the totals (for JSON and DataFrames; ``debug.metrics_report``)."""
        return metrics_report(self)

    def tenant_table(self) -> list[dict]:
        """One row per tenant (and one ``OTHER_TENANTS`` row once tenants were pushed out):
        requests, tokens, misses (``debug.tenant_report``)."""
        return tenant_report(self)
