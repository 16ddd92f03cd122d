"""Run one job in the vLLM interpreter and write its result as JSON (started by
``kvlab.vllm.bridge``).

    <vllm-venv>/bin/python worker.py JOB.json RESULT.json

Standalone on purpose: it imports only the standard library and vLLM, because it runs in vLLM's own
venv where kvlab is not installed. Jobs (``job["kind"]``):

- ``info``: vLLM's version.
- ``generate``: the prompts (token ids) through ``vllm.LLM`` with prefix caching at ``block_size``:
  generated ids, ``num_cached_tokens`` per request, the prefix-cache counters
  (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, tokens) and timings: start-up, the
  first run (``cold``), a second run after ``reset_prefix_cache()`` (``warm``, unless ``warm`` is
  false), a third without reset (``warm_cached``); optionally TTFT of prompt pairs (the first with
  an empty cache, the second sharing its prefix).
- ``many``: a list of jobs, run one after the other in this one process.
- ``workload``: all prompts at once, several times, prefix caching on and off (or isolated by a
  per-request ``cache_salt`` on the same engine): wall seconds, TTFT.
- ``kv_events``: replay block-manager operations (``alloc`` a prompt, ``append`` a decoded token,
  ``free``, ``reset``) on vLLM's own ``KVCacheManager`` with ``enable_kv_cache_events=True`` and
  return, after each operation, the events ``take_events()`` gave (the scheduler publishes exactly
  these, batched per step).
- ``block_pool``: replay a block-manager trace on vLLM's own ``KVCacheManager`` (``vllm.v1.core``),
  the same steps as ``kvlab.engine.trace_replay.replay_trace`` (which
  ``kvlab.lessons.traces.replay`` runs): seconds, hit tokens, cached tokens per request.

Within one ``many`` job, a job whose engine settings equal the previous job's reuses its ``LLM``
(prefix cache reset) rather than starting another: on a CPU, vLLM's start-up is the largest cost.

vLLM starts an engine process, so everything runs under ``if __name__ == "__main__":``. Errors are
written to RESULT.json as ``{"error": ..., "traceback": ...}``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


def _counters(llm) -> dict:
    """Prefix-cache counters (tokens) from ``llm.get_metrics()``; empty if stats are off."""
    out = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - metrics are optional extras
        return out
    names = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}
    for m in metrics:
        if m.name in names:
            out[names[m.name]] = out.get(names[m.name], 0) + int(getattr(m, "value", 0))
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def _run_prompts(llm, prompts, sp, arrival):
    """Generate; ``sequential`` submits one request at a time, ``batch`` all at once."""
    from vllm.inputs import TokensPrompt

    reqs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    t0 = time.perf_counter()
    if arrival == "batch":
        outs = llm.generate(reqs, sp, use_tqdm=False)
    else:
        outs = [llm.generate([r], sp, use_tqdm=False)[0] for r in reqs]
    seconds = time.perf_counter() - t0
    return outs, seconds


# One engine kept across the jobs of a ``many`` job: a job whose engine settings equal the previous
# job's reuses it (prefix cache reset first) instead of paying vLLM's start-up again.
_ENGINE: list = [None, None]  # [settings key, LLM]


def _llm_kwargs(job: dict, caching: bool = True) -> dict:
    """``vllm.LLM``'s arguments for a ``generate`` or ``workload`` job."""
    return dict(
        model=job["model"],
        tokenizer=job.get("tokenizer") or job["model"],
        dtype=job.get("dtype", "float32"),
        block_size=job["block_size"],
        enable_prefix_caching=caching,
        enforce_eager=job.get("enforce_eager", True),
        disable_log_stats=False,
        seed=job.get("seed", 0),
        max_model_len=job.get("max_model_len"),
        max_num_seqs=job.get("max_num_seqs", 16),
        max_num_batched_tokens=job.get("max_num_batched_tokens"),
        skip_tokenizer_init=job.get("skip_tokenizer_init", False),
        **job.get("llm_kwargs", {}),
    )


def _llm(kwargs: dict):
    """(LLM, start-up seconds, reused): the kept engine when ``kwargs`` equal its settings, else a
    new one."""
    from vllm import LLM

    key = json.dumps(kwargs, sort_keys=True)
    if _ENGINE[0] == key:
        _ENGINE[1].reset_prefix_cache()
        return _ENGINE[1], 0.0, True
    _drop_engine()
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    _ENGINE[:] = [key, llm]
    return llm, time.perf_counter() - t0, False


def _drop_engine() -> None:
    if _ENGINE[1] is not None:
        _ENGINE[:] = [None, None]
        import gc

        gc.collect()


def generate(job: dict) -> dict:
    """The ``generate`` job (see the module docstring)."""
    from vllm import SamplingParams

    llm, startup, reused = _llm(_llm_kwargs(job))
    sp = SamplingParams(
        max_tokens=job["max_tokens"],
        temperature=0.0,
        ignore_eos=job.get("ignore_eos", False),
        stop_token_ids=job.get("stop_token_ids") or None,
        detokenize=False,
    )
    prompts, arrival = job["prompts"], job.get("arrival", "sequential")
    before = _counters(llm)
    outs, cold = _run_prompts(llm, prompts, sp, arrival)
    counters = _delta(_counters(llm), before)
    result = {
        "vllm_version": __import__("vllm").__version__,
        "output_ids": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "prefix_cache": counters,
        "timings": {"startup_s": startup, "cold_s": cold, "reused_engine": reused},
    }
    if job.get("repeat", True):
        if job.get("warm", True):  # the warm pass only times a rerun on an empty cache
            llm.reset_prefix_cache()
            _, warm = _run_prompts(llm, prompts, sp, arrival)
            result["timings"]["warm_s"] = warm
        before = _counters(llm)
        again, warm_cached = _run_prompts(llm, prompts, sp, arrival)
        result["timings"]["warm_cached_s"] = warm_cached
        result["warm_cached"] = {
            "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in again],
            "prefix_cache": _delta(_counters(llm), before),
            "output_ids_equal": [list(o.outputs[0].token_ids) for o in again]
            == result["output_ids"],
        }
    if job.get("ttft_pairs"):
        result["ttft"] = ttft(llm, job["ttft_pairs"], job.get("ttft_repeats", 3))
    return result


def workload(job: dict) -> dict:
    """The ``workload`` job: all prompts at once, ``repeats`` times, prefix caching on and/or off.

    Per mode: wall seconds and mean time to first token (vLLM's own ``first_token_latency``) of
    every repetition, the prefix cache reset before each, and the tokens and cached-token counts of
    the last one. ``isolation``: ``"caching_off"`` (default) runs the isolated mode on a second
    engine with prefix caching off; ``"salt"`` runs it on the same engine with a distinct
    ``cache_salt`` per request, so no request can hit another's blocks (vLLM's per-tenant
    isolation), one engine start instead of two.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [list(p) for p in job["prompts"]]
    sp = SamplingParams(
        max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )
    salt = job.get("isolation", "caching_off") == "salt"
    out = {
        "vllm_version": __import__("vllm").__version__,
        "modes": {},
        "isolation": "salt" if salt else "caching_off",
    }
    for caching in job.get("caching", [True, False]):
        llm, startup, reused = _llm(
            _llm_kwargs(
                {"max_num_seqs": max(len(prompts), 1), "skip_tokenizer_init": True, **job},
                caching or salt,
            )
        )
        llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[0])],
            SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        walls, ttfts = [], []
        for rep in range(job.get("repeats", 3)):
            if caching or not salt:
                reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            else:
                reqs = [
                    TokensPrompt(prompt_token_ids=p, cache_salt=f"isolated-{rep}-{i}")
                    for i, p in enumerate(prompts)
                ]
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(reqs, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
            lat = [
                o.metrics.first_token_latency
                for o in outs
                if getattr(o, "metrics", None) is not None
            ]
            ttfts.append(statistics.mean(lat) if lat else float("nan"))
        out["modes"]["shared" if caching else "isolated"] = {
            "startup_s": startup, "reused_engine": reused, "wall_s": walls, "ttft_s": ttfts,
            "output_ids": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs]}
    return out


def ttft(llm, pairs, repeats: int) -> dict:
    """Time to first token (one-token requests, wall time): ``a`` on an empty cache, then ``b``
    after it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)

    def run(ids):
        return llm.generate([TokensPrompt(prompt_token_ids=list(ids))], one, use_tqdm=False)[0]

    run(pairs[0][0])  # warm-up: the first request after start-up pays one-off costs
    full, cached, hits = [], [], []
    for _ in range(repeats):
        for a, b in pairs:
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            run(a)
            t1 = time.perf_counter()
            out = run(b)
            t2 = time.perf_counter()
            full.append(t1 - t0)
            cached.append(t2 - t1)
            hits.append(int(out.num_cached_tokens or 0))
    return {"uncached_s": statistics.median(full), "cached_s": statistics.median(cached),
            "uncached_all": full, "cached_all": cached, "num_cached_tokens": hits}


# ------------------------------------------------------------------------ block pool microbenchmark

def _kv_cache_manager(num_blocks: int, block_size: int, **kwargs):
    """vLLM's KVCacheManager for one full-attention group (no tensors are made: shapes do not
    matter).

    vLLM keeps block 0 as its "null block", so it gets one block more than kvlab for the same
    capacity.
    """
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
    )
    config = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return KVCacheManager(config, max_model_len=1 << 20, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_caching=True, **kwargs)


def _request(req_id: str, prompt: list[int], max_tokens: int, hasher):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=hasher,
    )


def block_pool_replay(
    trace: list[dict], num_blocks: int, block_size: int, max_running: int
) -> dict:
    """``kvlab.engine.trace_replay.replay_trace`` (``reserve=True``) on vLLM's KVCacheManager, step
    for step.

    kvlab's replay runs its real ``Scheduler``; this loop takes the same steps by hand (kvlab is not
    importable here): a ready request queues when the free blocks, less those promised to the
    running ones, cover its prompt and reply; each step first writes one token of K/V for every
    running request (the token it generated last), then admits the queued ones, then every scheduled
    request "generates" its next reply token and one that has them all is freed. K/V is written for
    the prompt and every reply token but the last, as in an engine. ``cached_tokens`` must equal
    kvlab's, request for request.
    """
    from collections import deque

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    manager = _kv_cache_manager(num_blocks, block_size)
    cdiv = lambda n: -(-n // block_size)  # noqa: E731
    need = lambda r: cdiv(len(r["prompt"]) + len(r["output"]) - 1)  # noqa: E731
    ids = {r["req_id"] for r in trace}
    ready = deque(r for r in trace if r.get("after") is None or r["after"] not in ids)
    blocked: dict[str, list[dict]] = {}
    for r in trace:
        if r.get("after") is not None and r["after"] in ids:
            blocked.setdefault(r["after"], []).append(r)
    queued: deque = deque()  # the scheduler's waiting queue
    # req_id -> [trace row, vllm Request, tokens generated], admission order
    running: dict[str, list] = {}
    cached, steps, queries, hits, table_blocks = {}, 0, 0, 0, 0
    pool = manager.block_pool
    t0 = time.perf_counter()
    while ready or queued or running:
        while ready and len(running) + len(queued) < max_running:
            promised = sum(
                need(r) - cdiv(req.num_computed_tokens) for r, req, _ in running.values()
            )
            free = pool.get_num_free_blocks() - promised
            if free - sum(need(r) for r in queued) < need(ready[0]):
                break
            queued.append(ready.popleft())
        steps += 1
        for r, req, gen in running.values():  # decodes: K/V of the token generated last
            req.append_output_token_ids(r["output"][gen - 1])
            if manager.allocate_slots(req, 1) is None:
                raise RuntimeError("no block for a decode step")
            req.num_computed_tokens += 1
        while queued:  # admissions: every queued request fits (its blocks were promised)
            r = queued.popleft()
            req = _request(r["req_id"], r["prompt"], len(r["output"]), hasher)
            blocks, n_hit, _ = manager.get_computed_blocks(req)
            n = len(r["prompt"])
            if manager.allocate_slots(req, n - n_hit, n_hit, blocks) is None:
                raise RuntimeError(f"vLLM refused {r['req_id']}: pool too small")
            req.num_computed_tokens = n
            cached[r["req_id"]] = n_hit
            queries += n
            hits += n_hit
            running[r["req_id"]] = [r, req, 0]
        for rid, state in list(running.items()):  # every scheduled request generates one token
            state[2] += 1
            r, req, gen = state
            if gen == len(r["output"]):
                table_blocks += cdiv(req.num_computed_tokens)
                manager.free(req)
                del running[rid]
                ready.extend(blocked.pop(rid, ()))
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "steps": steps,
        "query_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "table_blocks": table_blocks,
        "cached_tokens": cached,
        "num_free_blocks": pool.get_num_free_blocks(),
    }


def _event_json(event) -> dict:
    """A vLLM KV event as JSON: its kind, hashes as hex (bytes) or str (int), tokens, block size."""
    def h(x):
        return None if x is None else (x.hex() if isinstance(x, (bytes, bytearray)) else str(x))

    kind = type(event).__name__
    out = {"kind": kind}
    if kind in ("BlockStored", "BlockRemoved"):
        out["block_hashes"] = [h(x) for x in event.block_hashes]
    if kind == "BlockStored":
        out.update(parent_block_hash=h(event.parent_block_hash), token_ids=list(event.token_ids),
                   block_size=event.block_size)
    return out


def kv_events(job: dict) -> dict:
    """The ``kv_events`` job: operations on vLLM's KVCacheManager with KV events on; the events
    after each."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    bs = job["block_size"]
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(bs, hash_fn)
    manager = _kv_cache_manager(job["num_blocks"], bs, enable_kv_cache_events=True)
    reqs, out = {}, []
    for op in job["ops"]:
        kind = op["op"]
        if kind == "alloc":
            req = _request(op["id"], list(op["prompt"]), 1 << 10, hasher)
            blocks, n_hit, _ = manager.get_computed_blocks(req)
            n = len(op["prompt"])
            if manager.allocate_slots(req, n - n_hit, n_hit, blocks) is None:
                raise RuntimeError(f"vLLM refused {op['id']}: pool too small")
            req.num_computed_tokens = n
            reqs[op["id"]] = req
        elif kind == "append":
            req = reqs[op["id"]]
            req.append_output_token_ids(op["token"])
            if manager.allocate_slots(req, 1) is None:
                raise RuntimeError("no block for a decode step")
            req.num_computed_tokens += 1
        elif kind == "free":
            manager.free(reqs.pop(op["id"]))
        elif kind == "reset":
            if not manager.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache refused")
        else:
            raise ValueError(f"unknown op {kind!r}")
        out.append([_event_json(e) for e in (manager.take_events() or [])])
    return {"events": out, "vllm_version": vllm.__version__}


def block_pool(job: dict) -> dict:
    """The ``block_pool`` job: ``reps`` replays on fresh managers, median seconds."""
    import vllm

    runs = [
        block_pool_replay(
            job["trace"], job["num_blocks"], job["block_size"], job.get("max_running", 16)
        )
        for _ in range(job.get("reps", 3))
    ]
    last = runs[-1]
    last["seconds_all"] = [r["seconds"] for r in runs]
    last["seconds"] = statistics.median(last["seconds_all"])
    last["vllm_version"] = vllm.__version__
    return last


def run(job: dict) -> dict:
    """One job by its ``kind``; ``many`` runs a list of jobs in this one process."""
    kind = job.get("kind", "generate")
    if kind == "many":
        return {"results": [run(j) for j in job["jobs"]]}
    if kind == "info":
        import vllm

        return {"vllm_version": vllm.__version__, "python": sys.version.split()[0]}
    if kind == "generate":
        return generate(job)
    if kind == "block_pool":
        return block_pool(job)
    if kind == "kv_events":
        return kv_events(job)
    if kind == "workload":
        return workload(job)
    raise ValueError(f"unknown job kind {kind!r}")


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller as JSON
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)



if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
