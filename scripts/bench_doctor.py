"""How fast is the prefix-cache doctor? Time it on a 10,000-request log of ~1,000-token prompts.

    python scripts/bench_doctor.py [--requests 10000] [--unique] [--smoke]

Writes the log (``kvlab.doctor.sample_log.make_log``, the same generator notebook 08 uses, sized
up) to ``build/bench/doctor_log.jsonl``, runs ``python -m kvlab.doctor`` on it in a fresh process
(so the tokenizer load and every import are counted), and writes the wall time, the doctor's own
phase times and the prompt sizes to ``build/bench/doctor.json``. ``--unique`` instead makes every
prompt a different single-message text (no piece of it repeats: the tokenizer's worst case).

It then times the two capacity replays of the doctor on the same tokenized log at block size 16 (the
``replay_paths`` entry): the fast LRU path (``kvlab.doctor.replay.replay``, one request at a time)
and the reference on kvlab's real ``Scheduler`` + ``BlockManager`` (``replay_block_manager``), and
checks they agree. The doctor runs one capacity replay per block size and one per fix it keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "bench"


def make(requests: int, unique: bool, seed: int = 0) -> list[dict]:
    """A chat log of about ``requests`` requests (two apps, multi-turn), or unique plain prompts."""
    sys.path.insert(0, str(ROOT))
    from kvlab.doctor.sample_log import SENTENCES, make_log

    if unique:
        rng = random.Random(seed)
        words = " ".join(SENTENCES).split()
        return [
            {
                "prompt": f"Request {i}: " + " ".join(rng.choice(words) for _ in range(330)),
                "user": f"u{i % 500}",
            }
            for i in range(requests)
        ]
    # about 3 turns per conversation with turns=(1, 5); cut to size below
    convs = int(requests / 2.9) + 20
    log, _ = make_log(
        support_conversations=int(convs * 0.7),
        coding_conversations=convs - int(convs * 0.7),
        users=max(120, convs // 4),
        doc_sentences=2,
        seed=seed,
    )
    if len(log) < requests:
        raise RuntimeError(f"the generator made {len(log)} requests, fewer than {requests}")
    return log[:requests]


def replay_paths(path: Path, capacity_blocks: int, block_size: int = 16) -> dict:
    """Seconds of the fast LRU replay and of the real-Scheduler reference on the log, and whether
    they agree."""
    from kvlab.doctor.logio import read_log
    from kvlab.doctor.prepare import prepare
    from kvlab.doctor.replay import block_chains, replay, replay_block_manager
    from kvlab.doctor.tokenization import PromptEncoder

    prep = prepare(read_log(path)[0], PromptEncoder())
    salts = [None if r.get("tenant") is None else str(r.get("tenant")) for r in prep.records]
    t0 = time.perf_counter()
    fast = replay(
        block_chains(prep.tokens, block_size, salts), prep.lengths, block_size, capacity_blocks
    )
    t1 = time.perf_counter()
    ref = replay_block_manager(prep.tokens, block_size, capacity_blocks, salts, check=False)
    t2 = time.perf_counter()
    return {
        "block_size": block_size,
        "capacity_blocks": capacity_blocks,
        "fast_lru_seconds": round(t1 - t0, 3),
        "scheduler_seconds": round(t2 - t1, 3),
        "speedup": round((t2 - t1) / max(t1 - t0, 1e-9), 1),
        "equal": fast.per_request == ref.per_request,
        "hit_rate": round(fast.hit_rate, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument(
        "--unique",
        action="store_true",
        help="every prompt different (worst case for the tokenizer)",
    )
    ap.add_argument("--smoke", action="store_true", help="1,000 requests")
    ap.add_argument("--capacity-blocks", type=int, default=20_000)
    args = ap.parse_args(argv)
    n = 1000 if args.smoke else args.requests
    OUT.mkdir(parents=True, exist_ok=True)
    log = make(n, args.unique)
    path = OUT / ("doctor_log_unique.jsonl" if args.unique else "doctor_log.jsonl")
    with open(path, "w") as f:
        for r in log:
            f.write(json.dumps(r) + "\n")
    report = OUT / ("doctor_report_unique" if args.unique else "doctor_report")
    cmd = [
        sys.executable,
        "-m",
        "kvlab.doctor",
        str(path),
        "--block-size",
        "16",
        "32",
        "64",
        "--capacity-blocks",
        str(args.capacity_blocks),
        "--tenant-field",
        "tenant",
        "--out",
        str(report),
        "--quiet",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 1
    summary = json.loads((report / "summary.json").read_text())
    lens = summary["prompt_tokens"]
    result = {
        "requests": summary["requests"],
        "prompt_tokens_mean": lens["mean"],
        "prompt_tokens_total": lens["total"],
        "unique": args.unique,
        "wall_seconds": round(wall, 2),
        "peak_memory_mb": round(peak_mb),
        "cpus": os.cpu_count(),
        "load_average_1min_after": round(os.getloadavg()[0], 2),
        "phases": {k: round(v, 2) for k, v in summary["timings"].items()},
        "tokenizer_pieces": summary.get("tokenizer", {}),
        "hit_rate_as_logged": summary["baseline"].get("capacity", summary["baseline"]["unbounded"])[
            "hit_rate"
        ],
        "hit_rate_all_fixes": summary["chain"][-1].get(
            "capacity_hit_rate", summary["chain"][-1]["unbounded_hit_rate"]
        ),
        "culprits": [c["title"] for c in summary["culprits"] if c["kept"]],
    }
    result["replay_paths"] = replay_paths(path, args.capacity_blocks)
    name = "doctor_unique.json" if args.unique else "doctor.json"
    (OUT / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"{result['requests']} requests, mean {result['prompt_tokens_mean']:.0f} tokens: "
          f"{wall:.1f} s wall for `python -m kvlab.doctor` (tokenizer load and imports included)")
    rp = result["replay_paths"]
    print(f"capacity replay at block size 16: fast LRU {rp['fast_lru_seconds']} s, real Scheduler "
          f"{rp['scheduler_seconds']} s ({rp['speedup']}x), equal: {rp['equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
