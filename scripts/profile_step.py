"""Profile one prefill step and one decode step of kvlab's engine on SmolLM2 (sys512), with
torch.profiler.

    .venv/bin/python scripts/profile_step.py            # SmolLM2-135M, float32, CPU, 2 threads
    .venv/bin/python scripts/profile_step.py --caching  # prefix cache on: the shared prefill, then
                                                        # decodes
    .venv/bin/python scripts/profile_step.py --smoke    # seconds: the bundled model, small sizes

It builds the engine ``kvlab.bench.peers.kvlab_steps`` builds (16 requests of a 512-token shared
prefix + 32 unique tokens), runs the prefill step of every prompt and one warm-up decode step, then
profiles one decode step (16 sequences) and, on a fresh engine, the prefill step. For each it
prints the top ops by self CPU time, the share of the step's wall time spent outside ATen ops
(Python and dispatch overhead) and, beside them, the weight-bytes bound of a decode step (bytes of
weights it reads / the streaming read bandwidth, ``kvlab.bench.peers.read_bandwidth``, as
scripts/bench.py) and the peak FLOP/s of the best GEMM (``F.linear`` or oneDNN's prepacked) on the
model's shapes (``kvlab.bench.peers``). The tables go to
``build/bench/profile_{decode,prefill}.txt``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab.bench import peers as B  # noqa: E402
from kvlab.bench.workload import sys512  # noqa: E402
from kvlab.engine import Engine, SamplingParams  # noqa: E402
from kvlab.engine.models import load_model  # noqa: E402
from kvlab.engine.speed import SpeedPaths  # noqa: E402


def make_engine(model, wl, caching: bool, steps: int, block_size: int = 16) -> Engine:
    """The engine ``kvlab_steps`` builds, with every prompt queued."""
    engine = B.bench_engine(model, wl, caching, block_size, new_tokens=steps + 4)
    for p in wl.prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    return engine


def profiled(step) -> tuple[float, float, str]:
    """Run ``step`` under the profiler: (wall seconds, seconds inside ATen ops, table of the top
    ops)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    # self: nested once
    aten = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e6
    table = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=45)
    return wall, aten, table


def timed(step, n: int) -> tuple[float, float]:
    """Median wall and CPU seconds (this process, all threads) of ``n`` unprofiled calls of
    ``step``.

    On a shared machine the CPU time is the steadier number: it leaves out the time other processes
    held the cores.
    """
    walls, cpus = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]


def loadavg() -> str:
    """The machine's 1/5/15-minute load average (``?`` where /proc is missing)."""
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a quick check in seconds: the bundled model, 2 requests x (32 + 8) tokens, 2 timed "
        "decode steps, one sample of each peak (a 16 MiB read buffer), 1 thread (flags given "
        "explicitly win)",
    )
    ap.add_argument("--model", default=None, help="default: smollm2 (--smoke: the bundled model)")
    ap.add_argument("--threads", type=int, default=None, help="default: 2 (--smoke: 1)")
    ap.add_argument(
        "--caching",
        action="store_true",
        help="prefix caching on: the shared prefill, and decodes over the shared prefix",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="decode steps timed unprofiled (median; default 6)"
    )
    ap.add_argument(
        "--packed-linear",
        action="store_true",
        help="prepacked GEMMs: oneDNN's, and kvlab's panel GEMM for few rows "
             "(SpeedPaths.packed_linear)",
    )
    ap.add_argument("--paged-kernel", action="store_true",
                    help="the C++ paged-attention kernel for decodes (SpeedPaths.paged_kernel)")
    ap.add_argument("--fused-layers", action="store_true",
                    help="a Llama run with fused prepacked GEMMs (SpeedPaths.fused_layers)")
    ap.add_argument(
        "--out",
        default=str(ROOT / "build" / "bench"),
        help="folder of profile_{decode,prefill}.txt",
    )
    args = ap.parse_args(argv)
    # the full run's and --smoke's defaults: a flag given explicitly wins
    for key, full, smoke in (("model", "smollm2", None), ("threads", 2, 1), ("steps", 6, 2)):
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    torch.set_num_threads(args.threads)
    paths = SpeedPaths(args.packed_linear, args.paged_kernel, args.fused_layers)
    if any(paths.on.values()):
        B.ENGINE_OPTIONS["accelerator"] = paths
    model, _ = load_model(args.model, device="cpu", dtype="float32")
    model.generation_config.eos_token_id = None
    sizes = {"num_requests": 2, "prefix_tokens": 32, "suffix_tokens": 8} if args.smoke else {}
    wl = sys512(model.config.vocab_size, **sizes)
    name = args.model or "the bundled model"
    cfg = model.config
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # the best of three: one reading on a busy machine can come out at half the peak (--smoke: one,
    # over a small read buffer: not a measurement)
    samples = 1 if args.smoke else 3
    read_bytes = {"nbytes": 16 * 2**20} if args.smoke else {}
    peak = max(
        B.linear_peak_flops(
            cfg.hidden_size, cfg.intermediate_size, torch.device("cpu"), torch.float32
        )
        for _ in range(samples)
    )
    bandwidth = max(B.read_bandwidth(torch.device("cpu"), **read_bytes) for _ in range(samples))
    body, head = B._linear_params(model)
    bound = (body + head) * 4 / bandwidth
    head_lines = [
        f"{name}: {cfg.num_hidden_layers} layers, float32, CPU, {torch.get_num_threads()} "
        f"threads; {wl.name}: {len(wl)} x ({wl.shared_prefix_tokens} + "
        f"{len(wl.prompts[0]) - wl.shared_prefix_tokens})",
        f"load average {loadavg()} (at the start)",
        f"GEMM peak {peak / 1e9:.1f} GFLOP/s; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"weight-bytes bound of a decode step {1e3 * bound:.1f} ms "
        f"({(body + head) * 4 / 2**20:.0f} MiB)",
    ]
    print("\n".join(head_lines), flush=True)

    with torch.no_grad():
        # prefill: a fresh engine each time (warm-up, then profiled, then timed)
        make_engine(model, wl, args.caching, args.steps).step()
        engine = make_engine(model, wl, args.caching, args.steps)
        wall, aten, table = profiled(engine.step)
        cached = [s.num_cached_tokens or 0 for s in engine.scheduler.running]
        flops = B.prefill_flops(model, [len(p) for p in wl.prompts], cached)
        # the step alone: the engine's construction (it packs the weights) is not timed
        pre_s, pre_cpu = timed(make_engine(model, wl, args.caching, args.steps).step, 1)
        pre = [
            f"prefill step ({'shared' if args.caching else 'isolated'}, "
            f"{wl.prompt_tokens - sum(cached)} of {wl.prompt_tokens} tokens computed): "
            f"{1e3 * wall:.0f} ms profiled; unprofiled {1e3 * pre_s:.0f} ms wall, "
            f"{1e3 * pre_cpu:.0f} ms CPU; {flops / pre_s / 1e9:.1f} GFLOP/s = "
            f"{flops / pre_s / peak:.2f} of the GEMM peak; outside ATen ops "
            f"{max(0.0, 1 - aten / wall):.1%}; load average {loadavg()}"
        ]
        print(pre[0], flush=True)
        (out / "profile_prefill.txt").write_text(
            "\n".join(head_lines + pre) + "\n\n" + table + "\n"
        )

        engine.step()  # warm-up decode
        wall, aten, table = profiled(engine.step)
        dec_s, dec_cpu = timed(engine.step, args.steps)
        dec = [
            f"decode step ({len(wl)} sequences): {1e3 * wall:.1f} ms profiled; unprofiled "
            f"{1e3 * dec_s:.1f} ms wall = {dec_s / bound:.2f}x the weight-bytes bound, "
            f"{1e3 * dec_cpu:.1f} ms CPU; "
            f"outside ATen ops {max(0.0, 1 - aten / wall):.1%}; load average {loadavg()}"
        ]
        print(dec[0], flush=True)
        (out / "profile_decode.txt").write_text("\n".join(head_lines + dec) + "\n\n" + table + "\n")
    print(f"\ndecode top ops:\n{table}")
    print(f"wrote {out / 'profile_decode.txt'} and {out / 'profile_prefill.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
