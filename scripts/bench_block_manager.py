"""Benchmark the pure-Python block manager on a realistic trace; print blocks/s, write JSON.

The trace (``kvlab.lessons.traces.realistic_trace``): a few shared system prompts of 100-1000
tokens, conversations of 1-4 growing turns, decode writes every output token, and a pool small
enough to evict. Block operations = full blocks hashed (looked up or registered) + blocks taken +
blocks hit. Ratios (sha256 vs Python's hash, caching off) come from the same run; the median of
--reps is kept.

    .venv/bin/python scripts/bench_block_manager.py [--conversations 900] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cache.block_manager import BlockManager  # noqa: E402
from kvlab.cache.hash_tools import builtin_hash
from kvlab.cache.hashing import hash_block  # noqa: E402
from kvlab.lessons.traces import realistic_trace, replay  # noqa: E402


def run(requests, num_blocks, block_size, max_running, reps, **kw) -> dict:
    """Replay ``reps`` times on fresh managers; the median timing, the counts of the last run."""
    results = [
        replay(BlockManager(num_blocks, block_size, **kw), requests, max_running)
        for _ in range(reps)
    ]
    last = results[-1]
    last.pop("cached_tokens")
    seconds = statistics.median(r["seconds"] for r in results)
    last.update(
        seconds=seconds,
        seconds_all=[r["seconds"] for r in results],
        blocks_per_s=last["block_ops"] / seconds,
        tokens_per_s=last["query_tokens"] / seconds,
    )
    return last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=900)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=3000)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="build/bench/block_manager.json")
    a = p.parse_args()

    requests = realistic_trace(a.conversations, seed=a.seed)
    cfg = dict(
        num_blocks=a.num_blocks, block_size=a.block_size, max_running=a.max_running, reps=a.reps
    )
    runs = {
        "sha256": run(requests, **cfg),
        "builtin_hash": run(requests, **cfg, hash_fn=builtin_hash),
        "no_caching": run(requests, **cfg, enable_caching=False),
    }
    base = runs["sha256"]
    print(
        f"{len(requests)} requests, {base['query_tokens']} prompt tokens, block size "
        f"{a.block_size}, "
        f"{a.num_blocks} blocks, {base['evictions']} evictions, hit rate "
        f"{100 * base['hit_rate']:.1f}%"
    )
    print(f"{'variant':<14}{'block ops':>11}{'seconds':>9}{'blocks/s':>12}{'vs sha256':>11}")
    for name, r in runs.items():
        print(f"{name:<14}{r['block_ops']:>11}{r['seconds']:>9.3f}{r['blocks_per_s']:>12,.0f}"
              f"{r['seconds'] / base['seconds']:>10.2f}x")
    print(f"block manager: {base['blocks_per_s']:,.0f} blocks/s (sha256, median of {a.reps})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "config": vars(a),
                "hash_fn": hash_block.__name__,
                "python": platform.python_version(),
                "num_requests": len(requests),
                "runs": runs,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
