"""Build the C++ speed paths now, once per machine: ``python -m kvlab.engine.speed``.

``scripts/setup.sh`` runs it. Prints one line per build (built or found, with seconds, or why not)
and exits 1 if one could not be built; the engine and ``kvlab serve`` run without a path that is
not built, and say why.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from . import fused_ops, paged_kernel
from .cpp_build import build_directory, build_failure

LOADS = {"paged_kernel": paged_kernel.load, "fused_ops": fused_ops.load}


def _build(name: str) -> tuple[str, str | None, float]:
    """Build (or find) one extension in this process: ``(name, why not or None, seconds)``."""
    t0 = time.perf_counter()
    why = build_failure(LOADS[name])
    return name, why, time.perf_counter() - t0


def main() -> int:
    """Build (or find) each extension, side by side (each compile keeps one core busy); 0 when all
    are there."""
    failed = 0
    with ProcessPoolExecutor(max_workers=len(LOADS)) as pool:
        for done in as_completed([pool.submit(_build, name) for name in LOADS]):
            name, why, seconds = done.result()
            if why is None:
                print(f"kvlab: {name} ready in {build_directory()} ({seconds:.1f} s)", flush=True)
            else:
                failed += 1
                print(f"kvlab: {name} not built: {why}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
