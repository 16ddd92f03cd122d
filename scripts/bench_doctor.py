"""How fast is the prefix-cache doctor? Time it on a 10,000-request log of ~1,000-token prompts.

    python scripts/bench_doctor.py [--requests 10000] [--unique] [--smoke]

Writes the log (``kvlab.lessons.doctor_log.make_log``, the same generator notebook 08 uses, sized up) to
``build/bench/doctor_log.jsonl``, runs ``python -m kvlab.doctor`` on it in a fresh process (so the
tokenizer load and every import are counted), and writes the wall time, the doctor's own phase times
and the prompt sizes to ``build/bench/doctor.json``. ``--unique`` instead makes every prompt a
different single-message text (no piece of it repeats: the tokenizer's worst case).
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
    from kvlab.lessons.doctor_log import SENTENCES, make_log

    if unique:
        rng = random.Random(seed)
        words = " ".join(SENTENCES).split()
        return [{"prompt": f"Request {i}: " + " ".join(rng.choice(words) for _ in range(330)), "user": f"u{i % 500}"}
                for i in range(requests)]
    convs = int(requests / 2.9) + 20  # about 3 turns per conversation with turns=(1, 5); cut to size below
    log, _ = make_log(support_conversations=int(convs * 0.7), coding_conversations=convs - int(convs * 0.7),
                      users=max(120, convs // 4), doc_sentences=2, seed=seed)
    if len(log) < requests:
        raise RuntimeError(f"the generator made {len(log)} requests, fewer than {requests}")
    return log[:requests]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--unique", action="store_true", help="every prompt different (worst case for the tokenizer)")
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
    cmd = [sys.executable, "-m", "kvlab.doctor", str(path), "--block-size", "16", "32", "64",
           "--capacity-blocks", str(args.capacity_blocks), "--tenant-field", "tenant", "--out", str(report), "--quiet"]
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
    result = {"requests": summary["requests"], "prompt_tokens_mean": lens["mean"], "prompt_tokens_total": lens["total"],
              "unique": args.unique, "wall_seconds": round(wall, 2), "peak_memory_mb": round(peak_mb),
              "cpus": os.cpu_count(), "load_average_1min_after": round(os.getloadavg()[0], 2),
              "phases": {k: round(v, 2) for k, v in summary["timings"].items()},
              "tokenizer_pieces": summary.get("tokenizer", {}),
              "hit_rate_as_logged": summary["baseline"].get("capacity", summary["baseline"]["unbounded"])["hit_rate"],
              "hit_rate_all_fixes": summary["chain"][-1].get("capacity_hit_rate", summary["chain"][-1]["unbounded_hit_rate"]),
              "culprits": [c["title"] for c in summary["culprits"] if c["kept"]]}
    name = "doctor_unique.json" if args.unique else "doctor.json"
    (OUT / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"{result['requests']} requests, mean {result['prompt_tokens_mean']:.0f} tokens: "
          f"{wall:.1f} s wall for `python -m kvlab.doctor` (tokenizer load and imports included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
