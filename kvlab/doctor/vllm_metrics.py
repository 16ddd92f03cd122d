"""Read vLLM's (or ``kvlab serve``'s) prefix-cache counters from a Prometheus ``/metrics`` text dump."""

from __future__ import annotations

import re
from pathlib import Path

LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>[-+0-9.eEinfNa]+)(\s+\d+)?\s*$")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
           "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries",
           "kvlab:prefix_cache_queries_total", "kvlab:prefix_cache_queries")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
        "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits",
        "kvlab:prefix_cache_hits_total", "kvlab:prefix_cache_hits")
RATE = ("vllm:gpu_prefix_cache_hit_rate", "vllm:cpu_prefix_cache_hit_rate")


def parse_metrics(text: str) -> dict:
    """{'queries', 'hits', 'hit_rate', 'series', 'source_names'} from Prometheus text (missing -> None)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        if not m:
            continue
        name = m.group("name")
        if name in QUERIES + HITS + RATE:
            try:
                v = float(m.group("value"))
            except ValueError:
                continue
            sums[name] = sums.get(name, 0.0) + v
            counts[name] = counts.get(name, 0) + 1
    q_name = next((n for n in QUERIES if n in sums), None)
    h_name = next((n for n in HITS if n in sums), None)
    r_name = next((n for n in RATE if n in sums), None)
    queries = sums.get(q_name) if q_name else None
    hits = sums.get(h_name) if h_name else None
    if queries:
        rate = hits / queries if hits is not None else None
    elif r_name:
        rate = sums[r_name] / counts[r_name]  # a gauge per engine: their mean
    else:
        rate = None
    return {"queries": queries, "hits": hits, "hit_rate": rate,
            "series": {n: counts[n] for n in (q_name, h_name, r_name) if n},
            "source_names": [n for n in (q_name, h_name, r_name) if n]}


def read_metrics(path: str | Path) -> dict:
    """``parse_metrics`` of a file."""
    return parse_metrics(Path(path).read_text(encoding="utf-8", errors="replace"))
