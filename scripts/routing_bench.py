"""Routing benchmark: replica counts x policies on the chat and sys512 workloads ->
build/bench/routing.json.

    python scripts/routing_bench.py                  # model-free simulation (seconds)
    # + real kvlab engines as Ray actors (measured step times)
    python scripts/routing_bench.py --ray
    python scripts/routing_bench.py --smoke          # small sizes

Per (workload, replicas, policy): fleet hit rate, TTFT p50/p99 (modelled clock in the simulation,
measured step times on Ray), load imbalance (max/mean requests per replica), preemptions. Policies:
notebook 09's and ``pull`` (route for load, fetch the prefix from the replica that holds it;
notebook 11). Also the kv_aware weight sweep on 4 replicas, and (with --ray) whether the simulation
reproduces the Ray run's routing and hits: for every policy, one Ray run on the modelled clock
replayed by the simulation with the model's replies, printed as requests on the same replica and
requests with the same cached tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab.built import nb09 as B  # noqa: E402  (notebook 09's sweeps, written in its cells)
from kvlab.cluster import (  # noqa: E402
    ALL_POLICIES,
    agree,
    ray_available,
    ray_replicas,
    run_fleet,
    simulate,
    start_ray,
)
from kvlab.lessons import nb09_routing as L  # noqa: E402  (its workloads)


def table(rows: list[dict]) -> str:
    """A plain-text table of the summary rows."""
    head = (
        f"{'workload':<12}{'n':>3} {'policy':<17}{'hit':>7}{'fetched':>8}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'imb':>6}{'pre':>5}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['workload']:<12}{r['replicas']:>3} {r['policy']:<17}{100 * r['hit_rate']:>6.1f}%"
            f"{100 * r.get('restored_rate', 0.0):>7.1f}%"
            f"{1000 * r['ttft_p50']:>9.2f}{1000 * r['ttft_p99']:>9.2f}"
            f"{r['imbalance']:>6.2f}{r['preemptions']:>5}"
        )
    return "\n".join(lines)


def agreement_lines(checks: list[dict]) -> str:
    """One line per (replicas, policy): the Ray run against its model-free replay."""
    lines = ["simulation vs Ray (modelled clock, the model's replies replayed):"]
    for c in checks:
        a = c["agreement"]
        lines.append(
            f"  {c['replicas']} replicas {c['policy']:<17} same replica "
            f"{a['same_replica']}/{a['requests']}, "
            f"same cached tokens {a['same_cached_tokens']}/{a['requests']}, missing "
            f"{a['missing']}: " + ("agree" if a["all_agree"] else "DISAGREE")
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ray", action="store_true", help="also run real engines as Ray actors")
    ap.add_argument(
        "--smoke", action="store_true", help="small sizes (the chat workload's smoke size)"
    )
    ap.add_argument("--num-blocks", type=int, default=96, help="KV blocks of 16 tokens per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "routing.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    workloads = [L.chat_workload(args.smoke, args.seed), L.sys512_workload(seed=args.seed)]
    rows = []
    for wl in workloads:
        print(
            f"simulating {wl.name}: 1, 2, 4 replicas x {len(ALL_POLICIES)} policies ...", flush=True
        )
        rows += B.sweep(wl, (1, 2, 4), ALL_POLICIES, num_blocks=args.num_blocks).to_dict("records")
    print("kv_aware weight sweep on 4 replicas ...", flush=True)
    weights = B.weight_sweep(
        workloads[0], 4, (0, 0.25, 1, 4, 16), num_blocks=args.num_blocks
    ).to_dict("records")
    print(table(rows))
    out = {
        "mode": "simulation",
        "num_blocks": args.num_blocks,
        "smoke": args.smoke,
        "seed": args.seed,
        "rows": rows,
        "weight_sweep": weights,
        "python": platform.python_version(),
    }
    if args.ray:
        if not ray_available():
            out["ray"] = {"error": "Ray is not installed (pip install -e .[cluster])"}
        else:
            t1 = time.perf_counter()
            start_ray(num_cpus=2)
            wl = L.chat_workload(True, args.seed)
            ray_rows, checks = [], []
            for n in (1, 2) if args.smoke else (1, 2, 4):
                print(f"Ray: {n} replica(s) x {len(ALL_POLICIES)} policies ...", flush=True)
                # a host tier on every actor stages what pull fetches (the other policies never fill
                # it)
                handles = ray_replicas(n, num_blocks=args.num_blocks, tier_blocks=args.num_blocks)
                for p in ALL_POLICIES:
                    ray_rows.append(
                        {
                            **run_fleet(wl, handles, p, clock="measured").summary(),
                            "workload": wl.name,
                        }
                    )
                    real = run_fleet(wl, handles, p, clock="model")
                    sim = simulate(
                        wl,
                        n,
                        p,
                        num_blocks=args.num_blocks,
                        replies=real.replies,
                        tier_blocks=args.num_blocks if p == "pull" else None,
                    )
                    checks.append({"replicas": n, "policy": p, "agreement": agree(real, sim)})
                import ray

                for h in handles:
                    ray.kill(h.actor)
            print(table(ray_rows))
            print(agreement_lines(checks))
            out["ray"] = {
                "rows": ray_rows,
                "agreement": checks,
                "seconds": time.perf_counter() - t1,
            }
    out["seconds"] = time.perf_counter() - t0
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path} in {out['seconds']:.1f} s")


if __name__ == "__main__":
    main()
