"""Read vLLM's (or ``kvlab serve``'s) prefix-cache counters from a Prometheus ``/metrics`` text
dump."""

from __future__ import annotations

import re
from pathlib import Path

LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+"
                  r"(?P<value>[-+0-9.eEinfNa]+)(\s+\d+)?\s*$")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
           "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries",
           "kvlab:prefix_cache_queries_total", "kvlab:prefix_cache_queries")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
        "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits",
        "kvlab:prefix_cache_hits_total", "kvlab:prefix_cache_hits")
RATE = ("vllm:gpu_prefix_cache_hit_rate", "vllm:cpu_prefix_cache_hit_rate")


def parse_metrics(text: str) -> dict:
    """{'queries', 'hits', 'hit_rate', 'series', 'source_names'} from Prometheus text (missing ->
    None)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m and m.group("name") in QUERIES + HITS + RATE:
            try:
                v = float(m.group("value"))
            except ValueError:
                continue
            sums[m.group("name")] = sums.get(m.group("name"), 0.0) + v
            counts[m.group("name")] = counts.get(m.group("name"), 0) + 1
    q, h, r = (next((n for n in names if n in sums), None) for names in (QUERIES, HITS, RATE))
    queries, hits = sums.get(q), sums.get(h)
    if queries:
        rate = hits / queries if hits is not None else None
    else:
        rate = sums[r] / counts[r] if r else None  # a gauge per engine: their mean
    names = [n for n in (q, h, r) if n]
    return {
        "queries": queries,
        "hits": hits,
        "hit_rate": rate,
        "series": {n: counts[n] for n in names},
        "source_names": names,
    }


MAX_METRICS_BYTES = 64 << 20  # a /metrics dump is KiBs; a server with many series, a few MiB


def read_metrics(path: str | Path) -> dict:
    """``parse_metrics`` of a file."""
    from ..inputs import read_input

    return parse_metrics(
        read_input(path, "--vllm-metrics", MAX_METRICS_BYTES).decode("utf-8", errors="replace")
    )
