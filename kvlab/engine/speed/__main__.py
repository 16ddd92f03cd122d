"""Build the C++ speed paths now, once per machine: ``python -m kvlab.engine.speed``.

``scripts/setup.sh`` runs it. Prints one line per build (built or found, with seconds, or why not)
and exits 1 if one could not be built; the engine and ``kvlab serve`` run without a path that is
not built, and say why.
"""

from __future__ import annotations

import sys
import time

from . import fused_ops, paged_kernel
from .cpp_build import build_directory, build_failure


def main() -> int:
    """Build (or find) each extension; 0 when all are there."""
    failed = 0
    for name, load in (("paged_kernel", paged_kernel.load), ("fused_ops", fused_ops.load)):
        t0 = time.perf_counter()
        why = build_failure(load)
        if why is None:
            print(f"kvlab: {name} ready in {build_directory()} ({time.perf_counter() - t0:.1f} s)")
        else:
            failed += 1
            print(f"kvlab: {name} not built: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
