"""The ``kvlab`` command: ``kvlab serve | doctor | audit ...`` and ``kvlab --version``.

Each subcommand runs the package's own ``python -m kvlab.<name>`` module with the remaining
arguments, so ``kvlab doctor requests.jsonl`` and ``python -m kvlab.doctor requests.jsonl`` are the
same thing. A subcommand whose module is not in this kvlab (or whose extra is not installed) says so
and exits 2. Torch-free until a subcommand that needs torch runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
from pathlib import Path

# The allow-list: subcommand -> (module run as __main__, what it does, the extra it needs or None).
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "serve": ("kvlab.serve", "an HTTP server around the engine, with /metrics", "serve"),
    "doctor": (
        "kvlab.doctor",
        "why is my prefix-cache hit rate low? (a JSONL request log in, a report out)",
        None,
    ),
    "audit": (
        "kvlab.audit",
        "does an OpenAI-style endpoint share its prompt cache? (timing + KS test)",
        None,
    ),
}


def version_line() -> str:
    """'kvlab X.Y.Z (where it is imported from)'."""
    import kvlab

    return f"kvlab {kvlab.__version__} ({Path(kvlab.__file__).resolve().parent})"


def build_parser() -> argparse.ArgumentParser:
    """The top-level options; everything after the subcommand goes to the subcommand's module."""
    lines = [f"  {name:<8} {desc}  (python -m {mod})" for name, (mod, desc, _) in COMMANDS.items()]
    ap = argparse.ArgumentParser(
        prog="kvlab",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvlab: share or isolate the LLM KV cache of a common prefix.",
        epilog="commands:\n"
        + "\n".join(lines)
        + "\n\n`kvlab COMMAND --help` shows a command's own options.",
    )
    ap.add_argument("--version", action="version", version=version_line())
    ap.add_argument(
        "command",
        choices=sorted(COMMANDS),
        metavar="COMMAND",
        help="one of: " + ", ".join(COMMANDS),
    )
    ap.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the command")
    return ap


def missing_message(command: str, err: ModuleNotFoundError | None) -> str:
    """Why a subcommand cannot run: its module is absent from this kvlab, or a dependency is not
    installed."""
    module, _, extra = COMMANDS[command]
    if err is None or (err.name or "").split(".")[0] == "kvlab":
        return (f"kvlab {command}: {module} is not part of this kvlab ({version_line()}); "
                "install a kvlab that has it")
    hint = f"pip install 'kvlab[{extra}]'" if extra else f"pip install {err.name}"
    return (
        f"kvlab {command}: {module} needs the package {err.name!r}, which is not installed ({hint})"
    )


def run_command(command: str, args: list[str]) -> int:
    """Run ``python -m kvlab.<command> args...`` in this interpreter; return its exit status."""
    module = COMMANDS[command][0]
    try:
        spec = importlib.util.find_spec(module)
        # a package: needs __main__
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(module + ".__main__")
    except ModuleNotFoundError as e:  # the package is there but imports something not installed
        print(missing_message(command, e), file=sys.stderr)
        return 2
    if spec is None:
        print(missing_message(command, None), file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [f"kvlab {command}", *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] == "kvlab":
            raise
        print(missing_message(command, e), file=sys.stderr)
        return 2
    except SystemExit as e:  # the module's own sys.exit(main()): hand its status back
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        raise
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvlab`` console script."""
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        ap.print_help()
        return 2
    ns = ap.parse_args(argv)
    return run_command(ns.command, ns.args)


if __name__ == "__main__":
    sys.exit(main())
