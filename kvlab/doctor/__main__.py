"""python -m kvlab.doctor LOG [options]: why is my prefix-cache hit rate low?

Examples:
    python -m kvlab.doctor requests.jsonl --out doctor_report/
    python -m kvlab.doctor requests.jsonl --model smollm2 --block-size 16 32 64 --capacity-blocks \
8192
    python -m kvlab.doctor requests.jsonl --kv-gib 20 --kv-config Qwen2.5-7B-Instruct \
--tenant-field tenant
    python -m kvlab.doctor requests.jsonl --vllm-metrics metrics.txt   # curl \
http://server:8000/metrics > metrics.txt

LOG is JSONL, one request a line: {"messages": [...], "user": ..., "tenant": ..., "session": \
...}, {"prompt": "..."}
or {"token_ids": [...]}. Malformed lines are listed with their line number (lines end at \\n \
only) and skipped.
--out DIR must be new, empty or the doctor's earlier report (it deletes the files its \
kvlab_doctor_manifest.json
lists); anything else, or a folder holding an input, is refused before the analysis. It never \
writes over a file.

exit status:
  0  the report was made (at least one request replayed; malformed lines skipped and listed)
  1  nothing to replay: the log is empty or every line is malformed (the summary lists them; \
--out still written)
  2  bad arguments: a missing log, --model path or --out refused, an invalid number, an \
unreadable input
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys

EXIT_OK, EXIT_NOTHING, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    ap = argparse.ArgumentParser(prog="python -m kvlab.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("log", help="JSONL request log")
    add(
        "--model",
        help="tokenizer and chat template: 'smollm2', a local Hugging Face folder or a cached hub "
        "id (default: the bundled kvlab-passphrase-qwen2)",
    )
    add("--block-size", type=int, nargs="+", default=[16, 32, 64], metavar="N",
        help="KV block sizes to replay (the first one is used for the culprits); default 16 32 64")
    cap = ap.add_mutually_exclusive_group()
    cap.add_argument(
        "--capacity-blocks",
        type=int,
        metavar="N",
        help="a finite cache of N blocks of the first block size (the same KV memory for the "
        "others; at most 10^9 blocks of any size)",
    )
    cap.add_argument(
        "--kv-gib",
        type=float,
        metavar="G",
        help="a finite cache of G GiB of K/V, sized with a model config (--kv-config, else "
        "--model; its layers, heads and sizes must be positive integers)",
    )
    add(
        "--kv-config",
        help="the served model's config for --kv-gib: a folder, a config.json, or a shipped name "
        "(e.g. Qwen2.5-7B-Instruct)",
    )
    add("--kv-dtype", default="bfloat16", help="K/V dtype for --kv-gib (default bfloat16)")
    add(
        "--tenant-field",
        metavar="FIELD",
        help="the request field naming the tenant: requests are replayed with "
        "per-tenant cache salts",
    )
    add(
        "--vllm-metrics",
        metavar="FILE",
        help="a Prometheus text dump of vLLM's or kvlab serve's /metrics, shown "
        "beside the replayed numbers",
    )
    add(
        "--concurrency",
        type=int,
        default=1,
        help="requests running at once in the replay (their blocks cannot be evicted); default 1",
    )
    add(
        "--out",
        metavar="DIR",
        help="write report.html, PNG figures, summary.json and fixed logs into this folder: a "
        "new or empty one, or the doctor's own earlier report (its files are replaced; see above)",
    )
    add(
        "--sample",
        type=int,
        default=400,
        help="request pairs diffed to find the culprits (default 400)",
    )
    add("--seed", type=int, default=0)
    add("--alone", action="store_true", help="also measure each fix alone on the log as logged")
    add("--no-fixed-logs", action="store_true", help="do not write the rewritten logs")
    add("--quiet", action="store_true", help="print only where the report went")
    return ap


def _fail(msg: str, status: int = EXIT_USAGE) -> int:
    print(f"kvlab doctor: {msg}", file=sys.stderr)
    return status


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (checked before any work), or None."""
    from ..inputs import file_kind
    from .core import input_paths
    from .outdir import OutDirError, check_out_dir
    from .tokenization import check_model
    log_kind = file_kind(args.log)
    metrics_kind = file_kind(args.vllm_metrics) if args.vllm_metrics is not None else None
    problems = [  # a folder, /dev/null, a FIFO: said as what it is, never "no such file"
        (
            log_kind is not None,
            f"no such file: {args.log}"
            if log_kind == "no such file"
            else f"the log {args.log} is {log_kind}, not a regular file",
        ),
        (
            metrics_kind is not None,
            f"--vllm-metrics: no such file: {args.vllm_metrics}"
            if metrics_kind == "no such file"
            else f"--vllm-metrics {args.vllm_metrics} is {metrics_kind}, not a regular file",
        ),
        (any(b < 1 for b in args.block_size), "block sizes must be positive"),
        (
            args.capacity_blocks is not None and args.capacity_blocks < 1,
            "--capacity-blocks must be at least 1",
        ),
        (
            args.kv_gib is not None and not (math.isfinite(args.kv_gib) and args.kv_gib > 0),
            "--kv-gib must be a positive number",
        ),
        (
            args.concurrency < 1 or args.sample < 0,
            "--concurrency must be at least 1 and --sample at least 0",
        ),
        (args.out is not None and not args.out.strip(), "--out needs a folder name"),
    ]
    if problem := next((msg for bad, msg in problems if bad), None):
        return problem
    try:
        check_model(args.model)
        if args.out is not None:
            check_out_dir(
                args.out, input_paths(args.log, args.model, args.kv_config, args.vllm_metrics)
            )
    except (FileNotFoundError, OutDirError) as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the doctor; exit 0 with a report, 1 when nothing could be replayed, 2 on bad arguments
    (see --help)."""
    args = build_parser().parse_args(argv)
    if problem := check_args(args):
        return _fail(problem)
    from ..inputs import InputFileError
    from .core import diagnose, write_report
    from .report import nothing_why
    try:
        # the log, --model and every option named as in diagnose
        options = inspect.signature(diagnose).parameters
        d = diagnose(
            block_sizes=tuple(args.block_size),
            **{k: v for k, v in vars(args).items() if k in options},
        )
    # a missing file is named as such, anything else with its type
    except (OSError, ValueError, KeyError) as e:
        return _fail(
            str(e)
            if isinstance(e, (FileNotFoundError, InputFileError))
            else f"{type(e).__name__}: {e}"
        )
    if args.out is not None:
        try:
            paths = write_report(d, args.out, fixed=not args.no_fixed_logs)
        except (OSError, ValueError) as e:
            return _fail(f"cannot write the report to {args.out}: {e}")
    if not args.quiet:
        print(d.summary())
    if args.out is not None:
        print(f"report: {paths['report.html']}  (summary.json, figures and fixed logs beside it)")
    return (
        EXIT_OK if d.requests else _fail(f"nothing to replay: {nothing_why(d.lines)}", EXIT_NOTHING)
    )


if __name__ == "__main__":
    sys.exit(main())
