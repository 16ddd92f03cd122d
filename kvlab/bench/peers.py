"""The headline experiment (workload ``sys512``): kvlab's engine against transformers, shared vs
isolated.

Systems, each run shared (prefix reused) and isolated, all on one model in one process:

* ``kvlab``: the paged engine, prefix caching on / off, every request submitted at once;
* ``HF generate_batch``: transformers' paged continuous batching, ``allow_block_sharing`` on / off;
  it registers a block for sharing only after the forward that computed it, so requests that arrive
  together share nothing; a second variant caps each step at one prompt so later requests can hit;
* ``HF manual reuse``: kvlab.prefix's loop on a transformers ``DynamicCache``: the prefix's K/V
  computed once and copied per request (shared) or every prompt from scratch (isolated), one request
  at a time;
* ``HF generate``: ``model.generate`` (isolated only), one request at a time and as one batch.

TTFT of a request is measured from the moment the workload is handed to the system: for the systems
that take all requests at once it includes waiting for the batch's prefills; for the one-at-a-time
systems it is the request's own time to first token (queueing behind earlier requests excluded).
Throughput is generated tokens per wall second of the whole workload. Repetitions are interleaved
(one of each system, then again) and the median is kept, so a busy machine slows all alike.

The ideal TTFT ratio is ``kvlab.bench.workload.ideal_prefill_fraction``: uncached prompt tokens over
all. The ideal KV bytes count whole blocks: the prefix's full blocks once, everything else per
request.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvlab.bench.workload import Workload, ideal_prefill_fraction, sys512
from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import model_device_dtype, synchronize
from kvlab.prefix import continue_from_cache

__all__ = [
    "SYSTEMS",
    "engine_speed",
    "goals",
    "kv_ideal_bytes",
    "measure_sys512",
    "prefill_padding",
    "ratios",
    "run_generate_batch",
    "run_hf_generate",
    "run_hf_manual",
    "run_kvlab",
    "sweep",
]


def _result(system: str, mode: str, ttfts: Sequence[float], wall: float, outputs: list[list[int]],
            **extra: Any) -> dict[str, Any]:
    tokens = sum(map(len, outputs))
    return {
        "system": system,
        "mode": mode,
        "ttft_s": statistics.mean(ttfts),
        "ttft_max_s": max(ttfts),
        "wall_s": wall,
        "tokens": tokens,
        "throughput": tokens / wall,
        "outputs": outputs,
        **extra,
    }


# ----------------------------------------------------------------------------- the systems

# extra EngineConfig fields of every kvlab engine the benchmark builds (scripts/bench.py
# --packed-linear sets accelerator=kvlab.engine.speed.SpeedPaths(packed_linear=True))
ENGINE_OPTIONS: dict[str, Any] = {}


def bench_engine(
    model: Any, workload: Workload, caching: bool, block_size: int, new_tokens: int
) -> Engine:
    """kvlab's engine sized for ``workload``: every request and ``new_tokens`` each fit at once."""
    num_blocks = sum(cdiv(len(p) + new_tokens, block_size) for p in workload.prompts) + 4
    return Engine(
        model,
        None,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=caching,
        max_num_seqs=max(len(workload), 1),
        max_num_batched_tokens=max(2048, workload.prompt_tokens),
        **ENGINE_OPTIONS,
    )


def run_kvlab(
    model: Any, workload: Workload, caching: bool, block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, Any]:
    """kvlab's engine: all requests at once, prefix caching on (shared) or off (isolated)."""
    n = workload.max_tokens
    engine = bench_engine(model, workload, caching, block_size, new_tokens=n)
    device, _ = model_device_dtype(model)
    t0 = time.perf_counter()
    outs = engine.generate(workload.prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    synchronize(device)
    wall = time.perf_counter() - t0
    return _result(
        "kvlab",
        "shared" if caching else "isolated",
        [o.ttft for o in outs],
        wall,
        [o.output_ids for o in outs],
        peak_kv_bytes=engine.peak_kv_bytes,
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        bytes_per_block=engine.store.bytes_per_block,
    )


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@torch.no_grad()
def run_hf_generate(model: Any, workload: Workload, batched: bool) -> dict[str, Any]:
    """``model.generate`` greedy, isolated: one request at a time, or all as one batch (equal
    lengths: no pads)."""
    device, _ = model_device_dtype(model)
    n = workload.max_tokens
    groups = [workload.prompts] if batched else [[p] for p in workload.prompts]
    if batched and len({len(p) for p in workload.prompts}) != 1:
        raise ValueError("the batched run needs prompts of one length (no padding)")
    ttfts, outputs = [], []
    t0 = time.perf_counter()
    for group in groups:
        ids = torch.tensor(group, device=device)  # (B, T)
        clock = _FirstTokenClock()
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
        ttfts += [clock.first - start] * len(group)
        outputs += out[:, ids.shape[1]:].tolist()
    synchronize(device)
    return _result(
        "HF generate (batch)" if batched else "HF generate (one by one)",
        "isolated",
        ttfts,
        time.perf_counter() - t0,
        outputs,
    )


@torch.no_grad()
def run_hf_manual(model: Any, workload: Workload, shared: bool) -> dict[str, Any]:
    """kvlab.prefix's loop on a DynamicCache, one request at a time: prefix K/V computed once and
    copied, or not."""
    from transformers import DynamicCache

    device, _ = model_device_dtype(model)
    p, n = workload.shared_prefix_tokens, workload.max_tokens
    ttfts, outputs = [], []
    t0 = time.perf_counter()
    prefix_cache, build = None, 0.0
    if shared:
        prefix_cache = model(
            input_ids=torch.tensor([workload.prompts[0][:p]], device=device),
            use_cache=True,
            logits_to_keep=1,
        ).cache
        synchronize(device)
        build = time.perf_counter() - t0
    for i, prompt in enumerate(workload.prompts):
        start = time.perf_counter()
        if shared:
            cache, skip = (
                copy.deepcopy(prefix_cache),
                p,
            )  # a request never writes into the shared cache
        else:
            cache, skip = DynamicCache(config=model.config), 0
        copied = time.perf_counter() - start
        gen, prefill, _, _ = continue_from_cache(
            model, cache, prompt[skip:], skip, max_new_tokens=n
        )
        ttfts.append(copied + prefill + (build if i == 0 else 0.0))
        outputs.append(gen)
    return _result(
        "HF manual reuse",
        "shared" if shared else "isolated",
        ttfts,
        time.perf_counter() - t0,
        outputs,
    )


_PREFIX_MATCH = re.compile(r"Found a prefix match of (\d+) tokens for request")


class _PrefixMatchLog(logging.Filter):
    """Collects the matched tokens of transformers' "Found a prefix match of N tokens" debug lines;
    passes on only the records the logger showed before (at ``shown_from`` and above)."""

    def __init__(self, shown_from: int) -> None:
        super().__init__()
        self.shown_from = shown_from
        self.found: list[int] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.shown_from:
            return True
        m = _PREFIX_MATCH.search(record.getMessage())
        if m:
            self.found.append(int(m.group(1)))
        return False


@contextlib.contextmanager
def _count_prefix_matches() -> Iterator[list[int]]:
    """Record the tokens transformers' continuous-batching cache finds already cached, per hit, from
    its debug log.

    ``PagedAttentionCache.search_prefix_match`` logs each match at DEBUG on the
    ``ContinuousBatchingLogger`` logger; a filter on that logger (standard ``logging``, nothing
    patched) collects the counts and drops the debug lines. Its level is restored afterwards.
    """
    log = logging.getLogger("ContinuousBatchingLogger")
    collector, level = _PrefixMatchLog(log.getEffectiveLevel()), log.level
    log.addFilter(collector)
    log.setLevel(logging.DEBUG)
    try:
        yield collector.found
    finally:
        log.setLevel(level)
        log.removeFilter(collector)


@torch.no_grad()
def run_generate_batch(
    model: Any,
    workload: Workload,
    sharing: bool,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_batch_tokens: int | None = None,
) -> dict[str, Any]:
    """transformers' ``generate_batch`` (paged continuous batching), block sharing on or off.

    Returns ``{"error": ...}`` instead of raising when it cannot run here.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    n = workload.max_tokens
    num_blocks = sum(cdiv(len(p) + n, block_size) for p in workload.prompts) + 4
    gen_config = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    cb_config = ContinuousBatchingConfig(
        page_size=block_size,
        num_blocks=num_blocks,
        allow_block_sharing=sharing,
        max_batch_tokens=max_batch_tokens,
    )
    name = "HF generate_batch" + ("" if max_batch_tokens is None else " (one prefill per step)")
    try:
        with _count_prefix_matches() as found:
            t0 = time.perf_counter()
            out = model.generate_batch(workload.prompts, generation_config=gen_config,
                                       continuous_batching_config=cb_config, record_timestamps=True,
                                       warmup=False, progress_bar=False)
            wall = time.perf_counter() - t0
        results = list(out.values())
        if len(results) != len(workload) or any(not r.timestamps for r in results):
            raise RuntimeError(f"generate_batch returned {len(results)} of {len(workload)} results")
    except Exception as e:  # report why, do not hide it
        return {
            "system": name,
            "mode": "shared" if sharing else "isolated",
            "error": f"{type(e).__name__}: {e}",
        }
    return _result(
        name,
        "shared" if sharing else "isolated",
        [r.timestamps[0] - r.created_time for r in results],
        wall,
        [list(r.generated_tokens) for r in results],
        cached_tokens=sum(found),
    )


# ----------------------------------------------------------------------------- one measurement

def _one(workload: Workload) -> int:
    """A step budget that fits one prompt plus a decode token for every request: prefills run one by
    one."""
    return max(map(len, workload.prompts)) + len(workload)


SYSTEMS: dict[str, Callable[[Any, Workload], dict[str, Any]]] = {
    "kvlab/shared": lambda m, w: run_kvlab(m, w, True),
    "kvlab/isolated": lambda m, w: run_kvlab(m, w, False),
    "HF generate_batch/shared": lambda m, w: run_generate_batch(m, w, True),
    "HF generate_batch/isolated": lambda m, w: run_generate_batch(m, w, False),
    "HF generate_batch (one prefill per step)/shared": lambda m, w: run_generate_batch(
        m, w, True, max_batch_tokens=_one(w)
    ),
    "HF generate_batch (one prefill per step)/isolated": lambda m, w: run_generate_batch(
        m, w, False, max_batch_tokens=_one(w)
    ),
    "HF manual reuse/shared": lambda m, w: run_hf_manual(m, w, True),
    "HF manual reuse/isolated": lambda m, w: run_hf_manual(m, w, False),
    "HF generate (batch)/isolated": lambda m, w: run_hf_generate(m, w, True),
    "HF generate (one by one)/isolated": lambda m, w: run_hf_generate(m, w, False),
}


def kv_ideal_bytes(
    workload: Workload, bytes_per_block: int, block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, int]:
    """Block-granular KV bytes at the peak: every request's blocks, the prefix's full blocks once
    when shared."""
    n = workload.max_tokens
    per_request = [
        cdiv(len(p) + n - 1, block_size) for p in workload.prompts
    ]  # K/V of all but the last token
    hits = [
        min(workload.shared_prefix_tokens // block_size, (len(p) - 1) // block_size)
        for p in workload.prompts[1:]
    ]
    return {
        "isolated": sum(per_request) * bytes_per_block,
        "shared": (sum(per_request) - sum(hits)) * bytes_per_block,
    }


def measure_sys512(
    model: Any,
    workload: Workload,
    repeats: int = 3,
    systems: Sequence[str] | None = None,
    progress: bool = False,
):
    """Run every system ``repeats`` times (interleaved, after a tiny warm-up each); medians per
    system and mode.

    Returns ``(table, detail)``: a DataFrame (TTFT, wall, throughput, KV bytes, cached tokens,
    agreement with HF generate's tokens) and the raw results of the last repetition by system key.
    ``progress``: a line per timed run.
    """
    import pandas as pd

    keys = list(SYSTEMS) if systems is None else list(systems)
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    tiny = sys512(
        model.config.vocab_size, num_requests=2, prefix_tokens=32, suffix_tokens=4, max_tokens=2
    )
    for k in keys:  # warm-up on a tiny workload: first-call costs, not timed
        t0 = time.perf_counter()
        SYSTEMS[k](model, tiny)
        if progress:
            print(f"  warm-up (not timed): {k} {time.perf_counter() - t0:.1f} s", flush=True)
    for i in range(repeats):
        for k in keys:
            t0 = time.perf_counter()
            runs[k].append(SYSTEMS[k](model, workload))
            if progress:  # a line per run: one system can take minutes on real weights
                print(f"  {workload.name} repetition {i + 1}/{repeats}: {k} "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    reference = next(
        (
            r[-1]["outputs"]
            for k, r in sorted(runs.items(), key=lambda kv: "one" not in kv[0])
            if k.startswith("HF generate (")
        ),
        None,
    )  # HF generate's tokens: one by one, else batched
    rows, detail = [], {}
    for k in keys:
        last = runs[k][-1]
        detail[k] = last
        if "error" in last:
            rows.append({"system": last["system"], "mode": last["mode"], "error": last["error"]})
            continue
        med = lambda f, rs=runs[k]: statistics.median(r[f] for r in rs)  # noqa: E731
        agree = float("nan")
        if reference is not None:
            pairs = [(a, b) for a, b in zip(reference, last["outputs"])]
            agree = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(
                len(a) for a, _ in pairs
            )
        rows.append(
            {
                "system": last["system"],
                "mode": last["mode"],
                "TTFT (ms)": med("ttft_s") * 1e3,
                "wall (s)": med("wall_s"),
                "throughput (tok/s)": med("throughput"),
                "peak KV (MiB)": last.get("peak_kv_bytes", float("nan")) / 2**20,
                "cached tokens": last.get("cached_tokens", float("nan")),
                "token agreement with HF generate": agree,
                "error": "",
            }
        )
    return pd.DataFrame(rows), detail


def vllm_rows(result: dict, reference: Sequence[Sequence[int]] | None = None) -> list[dict]:
    """Rows for ``measure_sys512``'s table from ``kvlab.vllm.bridge.run_vllm_workload`` (medians of
    its repetitions).

    ``reference``: HF generate's tokens per request, for the agreement column.
    """
    rows = []
    for mode, r in result["modes"].items():
        tokens = sum(map(len, r["output_ids"]))
        wall = statistics.median(r["wall_s"])
        agree = float("nan")
        if reference is not None:
            pairs = list(zip(reference, r["output_ids"]))
            agree = sum(x == y for a, b in pairs for x, y in zip(a, b)) / sum(
                len(a) for a, _ in pairs
            )
        rows.append(
            {
                "system": "vLLM",
                "mode": mode,
                "TTFT (ms)": 1e3 * statistics.median(r["ttft_s"]),
                "wall (s)": wall,
                "throughput (tok/s)": tokens / wall,
                "peak KV (MiB)": float("nan"),
                "cached tokens": sum(r["num_cached_tokens"]),
                "token agreement with HF generate": agree,
                "error": "",
            }
        )
    return rows


def ratios(table: Any, workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE):
    """Per system: TTFT shared/isolated beside the ideal, and throughput shared/isolated."""
    import pandas as pd

    ideal = ideal_prefill_fraction(workload, block_size)
    rows = []
    for system in table["system"].unique():
        d = table[(table.system == system) & (table["error"] == "")].set_index("mode")
        if {"shared", "isolated"} <= set(d.index):
            r = d.loc["shared", "TTFT (ms)"] / d.loc["isolated", "TTFT (ms)"]
            rows.append(
                {
                    "system": system,
                    "TTFT shared/isolated": r,
                    "ideal": ideal,
                    "x ideal": r / ideal,
                    "throughput shared/isolated": d.loc["shared", "throughput (tok/s)"]
                    / d.loc["isolated", "throughput (tok/s)"],
                }
            )
    return pd.DataFrame(rows)


def goals(
    table: Any,
    ratio_table: Any,
    workload: Workload,
    bytes_per_block: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
):
    """The issue's goals, each with the measured value and whether it is met."""
    import pandas as pd

    # a goal whose systems did not run (``systems`` picked a subset) is left out
    t = table.set_index(["system", "mode"])
    r = ratio_table.set_index("system") if "system" in ratio_table else ratio_table
    ideal_kv = kv_ideal_bytes(workload, bytes_per_block, block_size)
    rows = []
    if "kvlab" in r.index:  # kvlab ran shared and isolated
        ours = r.loc["kvlab"]
        peers = r.drop(index="kvlab")
        rows += [
            {
                "goal": "TTFT shared/isolated within 1.5x of the ideal",
                "measured": f"{ours['TTFT shared/isolated']:.3f} "
                f"= {ours['x ideal']:.2f}x the ideal {ours['ideal']:.3f}",
                "met": bool(ours["x ideal"] <= 1.5),
            },
            {
                "goal": "TTFT ratio no worse than any peer's",
                "measured": ", ".join(
                    f"{s}: {v:.3f}" for s, v in peers["TTFT shared/isolated"].items()
                )
                or "no peer ran",
                "met": bool((ours["TTFT shared/isolated"] <= peers["TTFT shared/isolated"]).all()),
            },
            {
                "goal": "throughput with / without prefix caching >= 2",
                "measured": f"{ours['throughput shared/isolated']:.2f}",
                "met": bool(ours["throughput shared/isolated"] >= 2),
            },
        ]
    gb = ("HF generate_batch", "shared")
    if gb in t.index and t.loc[gb, "error"] == "" and ("kvlab", "shared") in t.index:
        rel = t.loc[("kvlab", "shared"), "throughput (tok/s)"] / t.loc[gb, "throughput (tok/s)"]
        rows.append(
            {
                "goal": "kvlab throughput / HF generate_batch >= 1.0 (both shared)",
                "measured": f"{rel:.2f}",
                "met": bool(rel >= 1.0),
            }
        )
    for mode in ("shared", "isolated"):
        if ("kvlab", mode) not in t.index:
            continue
        got = t.loc[("kvlab", mode), "peak KV (MiB)"] * 2 ** 20
        rows.append(
            {
                "goal": f"KV bytes {mode} equal to the block-granular ideal",
                "measured": f"{got / 2**20:.2f} MiB vs ideal {ideal_kv[mode] / 2**20:.2f} MiB",
                "met": bool(abs(got - ideal_kv[mode]) < 1),
            }
        )
    return pd.DataFrame(rows)


def prefill_padding(
    workload: Workload, block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, dict[str, int]]:
    """Query rows of the one-step prefill: real, and as attended after kvlab's grouping and padding.

    kvlab's paged attention groups a step's prefills by query length (``group_by_query_length``) and
    pads within a group, so this says how much attention work the padding adds, shared and isolated.
    """
    from kvlab.engine.paged_attention import group_by_query_length

    hits = [0] + [
        min(workload.shared_prefix_tokens // block_size, (len(p) - 1) // block_size) * block_size
        for p in workload.prompts[1:]
    ]

    def rows(queries: list[int]) -> dict[str, int]:
        groups = group_by_query_length(queries)
        return {"real query rows": sum(queries),
                "padded query rows": sum(max(queries[i] for i in g) * len(g) for g in groups)}

    return {"shared": rows([len(p) - h for p, h in zip(workload.prompts, hits)]),
            "isolated": rows([len(p) for p in workload.prompts])}


# ----------------------------------------------------------------------------- sweep and figures

def sweep(
    model: Any,
    vocab_size: int,
    prefix_lens: Sequence[int],
    request_counts: Sequence[int],
    suffix_tokens: int = 32,
    max_tokens: int = 32,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: bool = False,
):
    """kvlab shared vs isolated over a grid of prefix lengths and request counts (one run each)."""
    import pandas as pd

    grid = [(p, r) for p in prefix_lens for r in request_counts]
    if progress:
        from tqdm.auto import tqdm

        grid = tqdm(grid, desc="prefix x requests")
    rows = []
    for p, r in grid:
        wl = sys512(
            vocab_size,
            num_requests=r,
            prefix_tokens=p,
            suffix_tokens=suffix_tokens,
            max_tokens=max_tokens,
        )
        sh, iso = run_kvlab(model, wl, True, block_size), run_kvlab(model, wl, False, block_size)
        rows.append(
            {
                "prefix tokens": p,
                "requests": r,
                "TTFT shared (ms)": sh["ttft_s"] * 1e3,
                "TTFT isolated (ms)": iso["ttft_s"] * 1e3,
                "TTFT ratio": sh["ttft_s"] / iso["ttft_s"],
                "ideal": ideal_prefill_fraction(wl, block_size),
                "throughput ratio": sh["throughput"] / iso["throughput"],
                "KV shared (MiB)": sh["peak_kv_bytes"] / 2**20,
                "KV isolated (MiB)": iso["peak_kv_bytes"] / 2**20,
            }
        )
    return pd.DataFrame(rows)


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def linear_peak_flops(hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype,
                      tokens: int = 2048, repeats: int = 3) -> float:
    """The machine's GEMM peak here: the best FLOP/s on the model's own large shapes of ``F.linear``
    and, where it runs, oneDNN's prepacked GEMM (``kvlab.engine.speed.packed_linear``) -- the floor
    is the fastest GEMM available, not only the one the eager path uses."""
    from kvlab.engine.speed.packed_linear import packed_linear_available

    packed = packed_linear_available(device, dtype) is None
    best = 0.0
    for n_in, n_out in ((hidden, intermediate), (intermediate, hidden), (hidden, hidden)):
        x = torch.randn(tokens, n_in, device=device, dtype=dtype)
        w = torch.randn(n_out, n_in, device=device, dtype=dtype)
        s = _best_seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w), device, repeats)
        best = max(best, 2 * tokens * n_in * n_out / s)
        if packed:
            wp = torch.ops.mkldnn._reorder_linear_weight(w, None)
            s = _best_seconds(
                lambda x=x, wp=wp: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], ""),
                device,
                repeats,
            )
            best = max(best, 2 * tokens * n_in * n_out / s)
    return best


@torch.no_grad()
def memory_bandwidth(device: torch.device, nbytes: int = 256 * 2 ** 20, repeats: int = 3) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device, repeats)


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache in bytes (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
        if size and size[-1] in units and size[:-1].isdigit():
            sizes.append(int(size[:-1]) * units[size[-1]])
        elif size.isdigit():
            sizes.append(int(size))
    return max(sizes) if sizes else None


@torch.no_grad()
def read_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of a streaming read at the current torch thread count: the best of ``repeats`` sums
    over a buffer of ``nbytes`` (default: 8 times the last-level cache, at least 256 MiB, so no pass
    hits in cache).

    A sum reads every byte once and writes nothing: the rate a decode step's weight and K/V reads
    can reach. (A copy's bytes / 2 is lower: the copy also writes, and each written line is read
    first.)
    """
    if nbytes is None:
        llc = last_level_cache_bytes() if device.type == "cpu" else None
        nbytes = max(256 * 2 ** 20, 8 * (llc or 0))
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / _best_seconds(lambda: x.sum(), device, repeats)


def _linear_params(model: Any) -> tuple[int, int]:
    """Weights of the decoder's linear layers (the blocks), and of the LM head."""
    head = model.get_output_embeddings().weight
    body = sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m.weight is not head)
    return body, head.numel()


def prefill_flops(
    model: Any, prompt_lengths: Sequence[int], cached: Sequence[int] | None = None
) -> float:
    """Model FLOPs of prefilling prompts (matmuls of every layer for the computed tokens, causal
    attention, one LM-head row each)."""
    from kvlab.engine.models import kv_shape

    body, head = _linear_params(model)
    cfg = model.config
    heads, layers = cfg.num_attention_heads, cfg.num_hidden_layers
    head_dim = kv_shape(cfg)["head_dim"]
    cached = [0] * len(prompt_lengths) if cached is None else list(cached)
    total = 0.0
    for n, c in zip(prompt_lengths, cached):
        new = n - c
        attended = sum(range(c + 1, n + 1))  # query at position p attends p + 1 keys
        total += (
            2 * body * new + 2 * head + layers * heads * 4 * head_dim * attended
        )  # QK^T and PV: 2 x 2 x D each
    return total


@torch.no_grad()
def hf_decode_step(model: Any, workload: Workload, steps: int = 8) -> float:
    """Median seconds of one decode step of transformers' own static batch (``DynamicCache``, SDPA)
    on the workload's prompts."""
    device, _ = model_device_dtype(model)
    ids = torch.tensor(workload.prompts, device=device)  # (B, T): equal lengths, no padding
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, tok, n, times = out.cache, out.logits[:, -1].argmax(-1, keepdim=True), ids.shape[1], []
    for i in range(steps):
        pos = torch.full_like(tok, n + i)
        t0 = time.perf_counter()
        out = model(input_ids=tok, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def kvlab_steps(
    model: Any,
    workload: Workload,
    caching: bool,
    steps: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> dict[str, float]:
    """One prefill step of all prompts (seconds) and the median decode step after it, in kvlab's
    engine."""
    device, _ = model_device_dtype(model)
    engine = bench_engine(model, workload, caching, block_size, new_tokens=steps + 2)
    for p in workload.prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()  # every prompt in one step (the budget holds them all)
    synchronize(device)
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"prefill_s": prefill, "decode_step_s": statistics.median(times),
            "cached_tokens": sum(s.num_cached_tokens or 0 for s in engine.scheduler.running)}


def engine_speed(
    model: Any,
    workload: Workload,
    repeats: int = 3,
    steps: int = 8,
    bandwidth: Callable[[], float] | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """kvlab's prefill and decode against the machine's peaks and against HF's own decode step, in
    one run.

    - prefill efficiency: model FLOPs of the isolated prefill / its time, over the peak FLOP/s of
      the best GEMM (``linear_peak_flops``) on the model's shapes measured now on the same threads;
    - decode step: kvlab's median step over 16 running sequences vs transformers' static-batch step
      on the same prompts, and vs the weight-bytes bound (bytes of weights a step must read / the
      read bandwidth, the best of ``bandwidth()``'s samples, default ``read_bandwidth``).
    Repetitions are interleaved; medians kept. ``progress``: a line per repetition.
    """
    device, dtype = model_device_dtype(model)
    cfg = model.config
    if bandwidth is None:
        def bandwidth() -> float:
            return read_bandwidth(device)
    peaks, bandwidths, iso, hf = [], [], [], []
    for i in range(
        repeats
    ):  # the machine's peaks are measured between the runs, so they see the same load
        peaks.append(linear_peak_flops(cfg.hidden_size, cfg.intermediate_size, device, dtype))
        bandwidths.append(bandwidth())
        iso.append(kvlab_steps(model, workload, caching=False, steps=steps))
        hf.append(hf_decode_step(model, workload, steps=steps))
        if progress:
            print(
                f"  engine speed {i + 1}/{repeats}: read {bandwidths[-1] / 1e9:.1f} GB/s, decode "
                f"step {1e3 * iso[-1]['decode_step_s']:.1f} ms (HF {1e3 * hf[-1]:.1f} ms)",
                flush=True,
            )
    peak, bandwidth = max(peaks), max(bandwidths)
    prefill_s = statistics.median(r["prefill_s"] for r in iso)
    decode_s = statistics.median(r["decode_step_s"] for r in iso)
    hf_s = statistics.median(hf)
    flops = prefill_flops(model, [len(p) for p in workload.prompts])
    body, head = _linear_params(model)
    weight_bytes = (body + head) * torch.empty((), dtype=dtype).element_size()
    return {"linear peak (GFLOP/s)": peak / 1e9, "prefill (GFLOP/s)": flops / prefill_s / 1e9,
            "prefill efficiency": flops / prefill_s / peak, "prefill (s)": prefill_s,
            "decode step kvlab (ms)": 1e3 * decode_s, "decode step HF generate (ms)": 1e3 * hf_s,
            "decode kvlab / HF": decode_s / hf_s, "read bandwidth (GB/s)": bandwidth / 1e9,
            "weight-bytes bound (ms)": 1e3 * weight_bytes / bandwidth,
            "decode / weight-bytes bound": decode_s / (weight_bytes / bandwidth)}
