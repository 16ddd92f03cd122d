"""Concurrency stress test of the paged engine with tenants: shared == isolated, token for token.

    python scripts/stress.py [--requests 1000] [--policy public-prefix] [--model PATH] [--seed 0]

A random workload (``kvlab.lessons.nb07_security.stress_workload``: mixed tenants, heavily
overlapping prefixes, random lengths, arrivals over time, greedy and seeded sampling) runs through
one engine whose pool is small enough that blocks are evicted and sequences preempted. Every output
is compared with the same request generated alone by transformers' ``model.generate``
(``kvlab.engine.reference.hf_generate``); the runner is notebook 07's
(``kvlab.lessons.nb07_security.stress_test``). The last line is ``requests=<n> mismatches=<m>
cross_tenant_hits=<h> leaked_blocks=<b>``; the exit code is 0 only when mismatches and leaked
blocks are 0 and, under a salting policy, cross-tenant hits are 0 too.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvlab.engine.models import load_model
from kvlab.engine.tenants import POLICIES
from kvlab.lessons import nb07_security as S


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--policy", choices=POLICIES, default="public-prefix")
    ap.add_argument(
        "--model", default=None, help="model path or HF id (default: the bundled model)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=48,
        help="pool size in blocks of 16 tokens (small = pressure)",
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device="cpu", dtype="float32")
    t0 = time.perf_counter()
    workload = S.stress_workload(tok, args.requests, seed=args.seed)
    # progress: each phase takes minutes at --requests 1000
    print(f"reference: {len(workload[0])} requests, each generated alone by transformers ...",
          flush=True)
    reference = S.isolated_outputs(model, tok, workload[0])
    t1 = time.perf_counter()
    print(f"engine: the same requests through one engine ({args.policy}, {args.num_blocks} "
          "blocks) ...", flush=True)
    rep = S.stress_test(
        model,
        tok,
        workload,
        reference,
        policy=args.policy,
        seed=args.seed,
        num_blocks=args.num_blocks,
    )
    print(f"policy={rep.policy} evictions={rep.evictions} preemptions={rep.preemptions} "
          f"public_hits={rep.public_hits} hit_rate={rep.hit_rate:.3f} "
          f"reference={t1 - t0:.1f}s engine={rep.seconds:.1f}s")
    if rep.mismatched:
        print(f"mismatched requests (first 10): {rep.mismatched[:10]}")
    print(rep.line())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
