"""A small load generator for OpenAI-compatible servers (kvlab serve or vllm serve), loopback only.

``run_clients`` runs ``concurrency`` client coroutines that take jobs from one list until it is
empty or a deadline passes; each job is one streaming ``/v1/completions`` request (server-sent
events) whose token ids (``return_token_ids``), first-token time, cached tokens and finish reason
are recorded. A client can disconnect after its first chunk (fault rounds) and honours 503 +
``Retry-After`` by retrying. ``start_kvlab`` / ``start_vllm`` start a server on a free loopback
port; ``wait_healthy`` waits for it. Used by ``scripts/load_test.py`` and
``scripts/serve_bench.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

__all__ = [
    "Result",
    "check_loopback",
    "free_port",
    "percentile",
    "run_clients",
    "start_kvlab",
    "start_vllm",
    "stop",
    "wait_healthy",
]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Result:
    """One request's outcome as its client saw it."""

    index: int  # the job's position in the job list
    status: int = 0  # HTTP status of the last attempt (0: no answer at all)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft: float | None = None  # send -> first chunk, seconds (the successful attempt)
    latency: float | None = None  # send -> [DONE]
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    retries: int = 0  # 503s answered with Retry-After and retried
    done: bool = False  # saw data: [DONE]
    disconnected: bool = False  # the client hung up on purpose


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash if its host is a loopback address; else ``ValueError``."""
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(
            f"{url}: the load generator only talks to loopback servers ({', '.join(LOOPBACK)})"
        )
    return url.rstrip("/")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(http: httpx.AsyncClient, base: str, body: dict, key: str | None, res: Result,
               disconnect_after_first: bool) -> bool:
    """One attempt; True when it is final (not a 503 to retry)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    async with http.stream("POST", base + "/v1/completions", json=body, headers=headers) as resp:
        res.status = resp.status_code
        if resp.status_code == 503:
            await resp.aread()
            await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
            return False
        if resp.status_code != 200:
            res.error = (await resp.aread()).decode(errors="replace")[:300]
            return True
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                res.done, res.latency = True, time.perf_counter() - t0
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = chunk["error"].get("message")
                continue
            for choice in chunk.get("choices") or []:
                if res.ttft is None:
                    res.ttft = time.perf_counter() - t0
                res.token_ids += choice.get("token_ids") or []
                res.text += choice.get("text") or ""
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
            usage = chunk.get("usage")
            if usage:
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0
                )
            if disconnect_after_first and res.ttft is not None:
                res.disconnected = True
                break  # leaving the block closes the connection
    return True


async def _client(
    http: httpx.AsyncClient,
    base: str,
    jobs: list[dict],
    next_job: Callable[[], int | None],
    key_for: Callable[[dict], str | None],
    results: list[Result],
    max_retries: int,
) -> None:
    while (i := next_job()) is not None:
        job = jobs[i]
        res = Result(i)
        body = {k: v for k, v in job.items() if not k.startswith("_")}
        try:
            while not await _one(
                http, base, body, key_for(job), res, job.get("_disconnect", False)
            ):
                res.retries += 1
                if res.retries > max_retries:
                    res.error = "503 after every retry"
                    break
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
        results.append(res)


async def run_clients(
    base: str,
    jobs: list[dict],
    concurrency: int,
    key_for: Callable[[dict], str | None],
    deadline: float,
    max_retries: int = 30,
) -> tuple[list[Result], float]:
    """Run ``jobs`` (completion bodies; ``_disconnect: True`` hangs up after the first chunk) on
    ``concurrency`` streaming clients until done or ``deadline`` (``time.monotonic``); ``(results,
    seconds)``.

    Jobs not started by the deadline get no result.
    """
    base = check_loopback(base)
    pending = iter(range(len(jobs)))

    def next_job() -> int | None:
        return None if time.monotonic() > deadline else next(pending, None)

    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as http:
        await asyncio.gather(*(_client(http, base, jobs, next_job, key_for, results, max_retries)
                               for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


# --- servers --------------------------------------------------------------------------------------
def start_kvlab(port: int, args: Sequence[str] = (), env: dict[str, str] | None = None,
                log: str | os.PathLike | None = None) -> subprocess.Popen:
    """``python -m kvlab.serve --port PORT ARGS`` (this interpreter; 127.0.0.1)."""
    root = Path(__file__).resolve().parents[2]
    full_env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(
        [sys.executable, "-m", "kvlab.serve", "--port", str(port), *args],
        env=full_env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def start_vllm(
    python: str | os.PathLike,
    model_dir: str | os.PathLike,
    port: int,
    block_size: int = 32,
    extra: Sequence[str] = (),
    log: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """vLLM's OpenAI server on CPU with prefix caching and prompt-token details (the issue's command
    line)."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enforce-eager",
        "--block-size",
        str(block_size),
        "--dtype",
        "float32",
        "--enable-prompt-tokens-details",
        "--gpu-memory-utilization",
        "0.3",
        *extra,
    ]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def wait_healthy(base: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> float:
    """Wait until ``GET /health`` answers 200; return the seconds it took. Raises if the process
    exits."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {proc.returncode} before it was healthy"
            )
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{base} was not healthy after {timeout:.0f} s")
        time.sleep(0.25)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate a server process (SIGTERM, then SIGKILL after ``timeout``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
