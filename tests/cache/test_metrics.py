"""Prefix-cache metrics: misses by reason, and a per-tenant table whose size stays bounded."""

import pytest

from kvlab.cache.metrics import MAX_TENANTS, OTHER_TENANTS, PrefixCacheMetrics

MISS = {"short": 1, "no_prefix": 2, "evicted": 0}


def _lookup(m, tenant, hits=3):
    m.record_lookup(tenant, hits + sum(MISS.values()), hits, MISS)


def test_tenant_table_keeps_the_most_recent_tenants_and_sums_the_rest():
    m = PrefixCacheMetrics(max_tenants=3)
    for i in range(10):
        _lookup(m, f"t{i}", hits=i)
    _lookup(m, "t7")  # seen again: now the most recent, so t8 is the next to go
    _lookup(m, "new")
    assert list(m.by_tenant) == ["t9", "t7", "new"]
    rows = {r["tenant"]: r for r in m.tenant_table()}
    assert set(rows) == {"t9", "t7", "new", OTHER_TENANTS}
    assert rows[OTHER_TENANTS]["requests"] == 8 and rows["t7"]["requests"] == 2
    for key in (
        "requests",
        "query_tokens",
        "hit_tokens",
        "miss_short",
        "miss_no_prefix",
        "miss_evicted",
    ):
        # nothing lost, nothing counted twice
        assert sum(r[key] for r in rows.values()) == m.as_dict()[key]


def test_no_other_row_until_a_tenant_is_pushed_out():
    m = PrefixCacheMetrics()
    assert m.max_tenants == MAX_TENANTS
    _lookup(m, None)
    _lookup(m, "a")
    assert [r["tenant"] for r in m.tenant_table()] == [None, "a"]


def test_per_tenant_memory_stays_bounded():
    m = PrefixCacheMetrics(max_tenants=16)
    for i in range(5000):  # a server that sees a new tenant (or unsafe salt) in every request
        _lookup(m, f"salt-{i}")
    assert len(m.by_tenant) == 16 and m.other.requests == 5000 - 16 and m.total.requests == 5000


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_max_tenants_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_tenants"):
        PrefixCacheMetrics(max_tenants=bad)
