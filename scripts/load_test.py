"""Load- and fault-test an OpenAI-compatible server: kvlab serve (default) or vllm serve, loopback
only.

    python scripts/load_test.py                          # kvlab serve, bundled model, 64 x 2000
    python scripts/load_test.py --clients 16 --requests 200 --disconnects 50
    python scripts/load_test.py --target vllm             # vLLM (its venv) on SmolLM2
    python scripts/load_test.py --base-url http://127.0.0.1:8000  # a server already running here

Rounds (each bounded by its count and by --time-limit for the whole run; the script stops by
itself):

1. steady: N concurrent streaming clients x M greedy requests over mixed tenants and shared system
   prompts. Every request must be answered exactly once and equal its isolated run token for token.
2. disconnect: clients that hang up after their first chunk (long requests, mid-stream) mixed with
   well-behaved clients, whose outputs must stay correct.
3. burst: more simultaneous requests than the server admits (kvlab: batch + wait queue); the excess
  gets
   503 + Retry-After, nobody crashes, and well-behaved clients (which honour Retry-After) stay
   correct.
4. big-bodies (issue 53, N1): while one stream runs, waves of ~1 MB bodies (a 330,000-id prompt,
  chats of
   30k empty and 25k one-character messages), each refused with 400; prints the stream's max
   inter-token gap while they arrive (--big-bodies N of each per wave; 0 skips the round).

Afterwards no block may be leaked: kvlab's GET /debug/engine (invariants, leaked blocks, live
requests); for vLLM its /metrics (no running request, KV-cache usage 0). The isolated reference:
kvlab's engine in-process, one prompt at a time with prefix caching off; for vLLM, each distinct
prompt alone over HTTP with a cache_salt of its own before the load. Tenants: kvlab gets one API
key per tenant (isolation "tenant"); vLLM has a single key, so there a tenant is a cache_salt.
Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab.serve.loadgen import (  # noqa: E402
    check_loopback,
    free_port,
    percentile,
    run_clients,
    start_kvlab,
    start_vllm,
    stop,
    wait_healthy,
)


# --- workload -------------------------------------------------------------------------------------
def distinct_prompts(systems: int, questions: int) -> list[str]:
    """``systems`` passphrase system prompts x ``questions`` final questions (shared prefixes)."""
    from kvlab.lessons import passphrase as P

    out = []
    for ex in P.make_examples(systems, "heldout", start=500):
        asks = (P.ASK_ZH if ex.lang == "zh" else P.ASK_EN) + (
            P.CHAT_ZH if ex.lang == "zh" else P.CHAT_EN
        )
        out += [P.with_question(ex, q).prompt_text for q in asks[:questions]]
    return out


def make_jobs(
    n: int,
    prompts: list[str],
    tenants: list[str],
    max_tokens: int,
    seed: int,
    model: str,
    target: str,
    **extra,
) -> list[dict]:
    """``n`` streaming greedy completion bodies; ``_prompt`` and ``_tenant`` say which prompt and
    tenant."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        p, t = rng.randrange(len(prompts)), rng.choice(tenants)
        body = {
            "model": model,
            "prompt": prompts[p],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "_prompt": p,
            "_tenant": t,
            **extra,
        }
        if target == "vllm":
            body["cache_salt"] = t  # vLLM has one API key: a tenant is a salt there
        jobs.append(body)
    return jobs


def kvlab_reference(model_name: str | None, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy ids of each prompt run alone in-process (prefix caching off)."""
    from kvlab.engine import Engine, SamplingParams, load_model

    model, tok = load_model(model_name, device="cpu")
    engine = Engine(model, tok, enable_prefix_caching=False)
    return [
        engine.generate([p], SamplingParams(max_tokens=max_tokens))[0].output_ids for p in prompts
    ]


def http_reference(
    base: str, model: str, prompts: list[str], max_tokens: int, deadline: float
) -> list[list[int]]:
    """Greedy ids of each prompt alone over HTTP, each with a fresh cache_salt (no sharing, no
    batching)."""
    jobs = [
        {
            "model": model,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "cache_salt": f"ref-{secrets.token_hex(8)}",
        }
        for p in prompts
    ]
    results, _ = asyncio.run(run_clients(base, jobs, 1, lambda j: None, deadline))
    if len(results) != len(prompts) or not all(r.done for r in results):
        raise RuntimeError("the isolated reference run did not finish")
    return [r.token_ids for r in results]


# --- checks ---------------------------------------------------------------------------------------
def summarize(
    name: str, jobs: list[dict], results: list, seconds: float, ref: list[list[int]] | None
) -> dict:
    """Counts (answered, lost, wrong, 503s, disconnects), TTFT p50/p99 and throughput of one
    round."""
    seen = [r.index for r in results]
    behaved = [r for r in results if not jobs[r.index].get("_disconnect")]
    ok = [r for r in behaved if r.status == 200 and r.done and r.error is None]
    wrong = [r for r in ok if ref is not None and r.token_ids != ref[jobs[r.index]["_prompt"]]]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(len(r.token_ids) for r in ok)
    return {
        "round": name,
        "jobs": len(jobs),
        "started": len(results),
        "not_started": len(jobs) - len(results),
        "duplicates": len(seen) - len(set(seen)),
        "well_behaved": len(behaved),
        "answered": len(ok),
        "lost": len([r for r in behaved if not (r.status == 200 and r.done) and r.status != 503]),
        "refused_503": len([r for r in behaved if r.status == 503]),
        "retried_503": sum(r.retries for r in behaved if r.status == 200),
        "wrong": len(wrong),
        "disconnected": len([r for r in results if r.disconnected]),
        "errors": sorted({r.error for r in behaved if r.error})[:5],
        "seconds": seconds,
        "requests_per_s": len(ok) / seconds if seconds else None,
        "output_tokens_per_s": tokens / seconds if seconds else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 0.5)),
        "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def leak_check(base: str, target: str, timeout: float = 120, key: str | None = None) -> dict:
    """After the rounds: kvlab's /debug/engine (once idle; it needs an API key when keys are set),
    or vLLM's /metrics gauges."""
    deadline = time.monotonic() + timeout
    while True:
        if target == "kvlab":
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            rep = httpx.get(base + "/debug/engine", timeout=30, headers=headers).json()
            idle = rep["server_in_flight"] == 0 and rep["live_requests"] == 0
        else:
            m = scrape(base)
            rep = {
                k: v
                for k, v in m.items()
                if k
                in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                )
            }
            idle = not any(rep.values())
        if idle or time.monotonic() > deadline:
            rep["idle"] = idle
            return rep
        time.sleep(0.2)


def big_bodies(model: str, n: int) -> list[tuple[str, bytes]]:
    """Issue 53's N1 bodies, encoded once (the client's own JSON work must not show up as the
    server's gap): ``n`` of each of a ~1 MB token-id prompt, a chat of 30k empty messages and one
    of 25k one-character ones."""
    ids = {"model": model, "prompt": [5] * 330000, "max_tokens": 4}
    empty = {"model": model, "messages": [{"role": "user", "content": ""}] * 30000, "max_tokens": 4}
    short = {
        "model": model,
        "messages": [{"role": "user", "content": "x"}] * 25000,
        "max_tokens": 4,
    }
    return [(path, json.dumps(body).encode()) for _ in range(n)
            for path, body in (("/v1/completions", ids), ("/v1/chat/completions", empty),
                               ("/v1/chat/completions", short))]


STREAM_READER = """
import json, sys, time
import httpx
base, key, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
headers = {"Authorization": "Bearer " + key} if key else {}
with httpx.Client(timeout=600) as http, http.stream(
    "POST", base + "/v1/completions", json=body, headers=headers
) as r:
    for line in r.iter_lines():
        if line.startswith("data: {"):
            print(time.monotonic(), flush=True)
"""


async def big_body_round(base: str, model: str, key: str | None, n: int, stream_tokens: int = 400,
                         waves: int = 3) -> dict:
    """A running stream's inter-token gaps while ``waves`` x ``n`` of each N1 body arrive at once.

    The stream (greedy, ``ignore_eos``) is read by a process of its own, which stamps each chunk
    with the system-wide monotonic clock: the client's own work (sending 24 MB a wave) cannot delay
    the reading. After its first 20 chunks the waves are sent one after another. Returns the
    stream's max gap alone and while the bodies arrive, and the bodies' status codes.
    """
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    bodies = big_bodies(model, n)
    statuses: list[int] = []
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": stream_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    reader = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        STREAM_READER,
        base,
        key or "",
        json.dumps(body),
        stdout=asyncio.subprocess.PIPE,
    )
    arrivals: list[float] = []
    while len(arrivals) < 20 and (line := await reader.stdout.readline()):
        arrivals.append(float(line))
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        async def post(path: str, data: bytes) -> None:
            r = await http.post(
                base + path, content=data, headers={**headers, "Content-Type": "application/json"}
            )
            statuses.append(r.status_code)
        for _ in range(waves):
            await asyncio.gather(*(post(path, data) for path, data in bodies))
    end = time.monotonic()
    arrivals += [float(line) for line in (await reader.stdout.read()).split()]
    await reader.wait()
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:])]
    during = [g for g, t in gaps if start <= t <= end + 0.5]
    alone = [g for g, t in gaps if t < start]
    return {"round": "big-bodies", "bodies": len(bodies) * waves, "status_counts": {
                str(c): statuses.count(c) for c in sorted(set(statuses))},
            "stream_tokens": len(arrivals), "flood_seconds": round(end - start, 2),
            "stream_chunks_during_flood": len(during),
            "max_gap_alone_s": round(max(alone, default=0.0), 4),
            "max_gap_during_flood_s": round(max(during, default=0.0), 4),
            "max_gap_s": round(max((g for g, _ in gaps), default=0.0), 4)}


def scrape(base: str, key: str | None = None) -> dict[str, float]:
    """Prometheus series summed over labels: ``{name: value}`` (/metrics needs a key on a server
    with keys)."""
    out: dict[str, float] = {}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in httpx.get(base + "/metrics", timeout=30, headers=headers).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def print_round(s: dict) -> None:
    """One line per round."""
    print(
        f"  {s['round']:<10} jobs {s['jobs']:>5}  answered {s['answered']:>5}  lost {s['lost']}  "
        f"wrong {s['wrong']}  dup {s['duplicates']}  503 {s['refused_503']} "
        f"(+{s['retried_503']} retried)  disconnected "
        f"{s['disconnected']}  not started {s['not_started']}  TTFT p50 {s['ttft_p50_ms']} ms p99 "
        f"{s['ttft_p99_ms']} ms"
        f"  {s['requests_per_s'] or 0:.1f} req/s  {s['output_tokens_per_s'] or 0:.0f} tok/s  "
        f"({s['seconds']:.1f} s)"
    )
    for e in s["errors"]:
        print(f"    error: {e}")


# --- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=("kvlab", "vllm"), default="kvlab")
    p.add_argument(
        "--base-url", default=None, help="a running loopback server (else one is started here)"
    )
    p.add_argument(
        "--model", default=None, help="kvlab: 'smollm2' or none (bundled); vllm: always SmolLM2"
    )
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument(
        "--systems", type=int, default=16, help="distinct system prompts (shared prefixes)"
    )
    p.add_argument("--questions", type=int, default=5, help="questions per system prompt")
    p.add_argument(
        "--disconnects", type=int, default=200, help="clients that hang up mid-stream (0: no round)"
    )
    p.add_argument(
        "--burst",
        type=int,
        default=-1,
        help="simultaneous requests in the burst (-1: the server's "
        "admission limit + 64; 0: no round)",
    )
    p.add_argument(
        "--big-bodies",
        type=int,
        default=8,
        help="issue 53's N1 round: this many of each ~1 MB body (a token-id list, 30k empty and "
        "25k one-character chat messages) at once, three times, while a stream runs; its max "
        "inter-token gap is printed (0: no round)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=128)
    p.add_argument("--time-limit", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--out", default=str(ROOT / "build" / "bench" / "load.json"))
    return p.parse_args(argv)


def start_server(args, tmp: Path) -> tuple[str, object, list[str], str]:
    """Start the target on a free loopback port: (base url, process, API keys by tenant order,
    model name)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tenants = [f"tenant{i}" for i in range(args.tenants)]
    if args.target == "kvlab":
        keys = {f"key-{t}": t for t in tenants}
        (tmp / "keys.json").write_text(json.dumps(keys))
        a = [
            "--isolation",
            "tenant",
            "--api-keys",
            str(tmp / "keys.json"),
            "--enable-debug-endpoint",
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-waiting",
            str(args.max_waiting),
        ]
        if args.model:
            a += ["--model", args.model]
        proc = start_kvlab(
            port,
            a,
            env={"OMP_NUM_THREADS": "1", "KVLAB_SERVER_SECRET": secrets.token_hex(16)},
            log=tmp / "server.log",
        )
        return base, proc, list(keys), ""
    from kvlab.engine.smollm2 import ensure_smollm2
    from kvlab.vllm.bridge import vllm_python

    proc = start_vllm(vllm_python(), ensure_smollm2(), port, log=tmp / "server.log")
    return base, proc, [], ""


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print them, write the JSON; exit 1 if anything was lost, wrong or leaked."""
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.time_limit
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-load-"))
    proc, keys = None, []
    try:
        if args.base_url:
            base = check_loopback(args.base_url)
        else:
            base, proc, keys, _ = start_server(args, tmp)
            print(f"started {args.target} serve on {base} (log {tmp / 'server.log'})", flush=True)
        print(f"server healthy after {wait_healthy(base, proc, timeout=600):.1f} s", flush=True)
        model = httpx.get(
            base + "/v1/models",
            timeout=30,
            headers={"Authorization": f"Bearer {keys[0]}"} if keys else {},
        ).json()["data"][0]["id"]
        prompts = distinct_prompts(args.systems, args.questions)
        tenants = [f"tenant{i}" for i in range(args.tenants)]
        key_of = dict(zip(tenants, keys))
        t0 = time.monotonic()
        if args.target == "kvlab":
            ref = kvlab_reference(args.model, prompts, args.max_tokens)
        else:
            ref = http_reference(base, model, prompts, args.max_tokens, deadline)
        print(
            f"isolated reference: {len(prompts)} distinct prompts in {time.monotonic() - t0:.1f} s",
            flush=True,
        )

        def key_for(job: dict) -> str | None:
            return key_of.get(job["_tenant"])

        rounds = []
        jobs = make_jobs(args.requests, prompts, tenants, args.max_tokens, 0, model, args.target)
        res, secs = asyncio.run(run_clients(base, jobs, args.clients, key_for, deadline))
        rounds.append(summarize("steady", jobs, res, secs, ref))
        print_round(rounds[-1])

        if args.disconnects and time.monotonic() < deadline:
            drop = make_jobs(
                args.disconnects,
                prompts,
                tenants,
                200,
                1,
                model,
                args.target,
                ignore_eos=True,
                _disconnect=True,
            )
            good = make_jobs(
                args.disconnects, prompts, tenants, args.max_tokens, 2, model, args.target
            )
            mixed = [j for pair in zip(drop, good) for j in pair]
            res, secs = asyncio.run(run_clients(base, mixed, args.clients, key_for, deadline))
            rounds.append(summarize("disconnect", mixed, res, secs, ref))
            print_round(rounds[-1])

        burst = args.burst if args.burst >= 0 else args.max_num_seqs + args.max_waiting + 64
        if burst and time.monotonic() < deadline:
            flood = make_jobs(burst, prompts, tenants, 64, 3, model, args.target, ignore_eos=True)
            good = make_jobs(
                max(args.clients, 32), prompts, tenants, args.max_tokens, 4, model, args.target
            )

            async def both():
                return await asyncio.gather(
                    run_clients(base, flood, burst, key_for, deadline, max_retries=0),
                    run_clients(base, good, min(args.clients, 16), key_for, deadline),
                )

            (fres, fsecs), (gres, gsecs) = asyncio.run(both())
            flood_summary = summarize("burst", flood, fres, fsecs, None)
            rounds.append(flood_summary)
            print_round(flood_summary)
            rounds.append(summarize("burst-good", good, gres, gsecs, ref))
            print_round(rounds[-1])

        if args.big_bodies and time.monotonic() < deadline:
            big = asyncio.run(
                big_body_round(base, model, keys[0] if keys else None, args.big_bodies)
            )
            rounds.append(big)
            print(
                f"  big-bodies {big['bodies']} bodies of ~1 MB (ids, 30k empty / 25k 1-char "
                f"messages) in {big['flood_seconds']} s, status {big['status_counts']}: a running "
                f"stream's max inter-token gap {big['max_gap_during_flood_s']} s during them "
                f"({big['stream_chunks_during_flood']} chunks), "
                f"{big['max_gap_alone_s']} s alone",
                flush=True,
            )

        leaks = leak_check(base, args.target, key=keys[0] if keys else None)
        healthy = httpx.get(base + "/health", timeout=30).status_code == 200
        metrics = scrape(base, keys[0] if keys else None)
    finally:
        if proc is not None:
            stop(proc)
    prefix = "kvlab:" if args.target == "kvlab" else "vllm:"
    hits, queries = (
        metrics.get(prefix + "prefix_cache_hits_total", 0),
        metrics.get(prefix + "prefix_cache_queries_total", 0),
    )
    report = {
        "target": args.target,
        "model": model,
        "base_url": base,
        "clients": args.clients,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "tenants": args.tenants,
        "distinct_prompts": len(prompts),
        "rounds": rounds,
        "after": leaks,
        "healthy_after": healthy,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "seconds": time.monotonic() - t_start,
    }
    hit_rate = report["prefix_cache_hit_rate"]
    print(
        f"after: {json.dumps(leaks)}  healthy {healthy}  prefix-cache hit rate "
        f"{hit_rate if hit_rate is None else round(hit_rate, 3)}"
        f"  total {report['seconds']:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    bad = (
        any(r.get("lost") or r.get("wrong") or r.get("duplicates") for r in rounds)
        or not healthy
        or not leaks.get("idle")
    )
    if args.target == "kvlab":
        bad = (
            bad
            or leaks.get("leaked_blocks")
            or leaks.get("orphan_requests")
            or not leaks.get("invariants_ok")
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
