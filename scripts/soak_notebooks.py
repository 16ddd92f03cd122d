"""Run notebooks headless many times in a row and count stalled cells (issue 36). Not part of CI.

    # the whole series in SMOKE mode, 20 times
    python scripts/soak_notebooks.py --runs 20
    # just the notebooks with the worst record
    python scripts/soak_notebooks.py --runs 5 --only 03,05
    # a generated notebook of 40 widget cells
    python scripts/soak_notebooks.py --synthetic 40 --runs 10
    # ... with nbclient as it comes
    python scripts/soak_notebooks.py --synthetic 40 --runs 3 --client stock

A *stall* is a cell that ran for ``--stall-s`` seconds or more (default: the runner's per-cell
limit in SMOKE, 120 s, for the series; 10 s for the synthetic notebook), or a notebook that failed.
The synthetic notebook isolates the pattern the series uses (a slider driving
``widgets.interactive_output`` that draws a matplotlib figure); each of its cells takes well under
a second when nothing stalls. ``--client`` picks which of the runner's two changes to nbclient are
on (``run_notebooks.widget_registry``, ``run_notebooks.kernel_manager_class``): ``stock`` (neither;
how the stall is reproduced), ``quiet-output``, ``sliced`` or ``both`` (what ``make run`` uses).
Prints one line per run and a summary; exits non-zero when any stall was seen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_notebooks  # noqa: E402

WIDGET_CELL = """\
slider = widgets.IntSlider(value=3, min=1, max=9, continuous_update=False)

def show(k):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(k))
    plt.show()
    print("k", k)

display(slider, widgets.interactive_output(show, {"k": slider}))"""


def synthetic_notebook(path: Path, cells: int) -> Path:
    """A notebook of ``cells`` slider + interactive_output cells."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import ipywidgets as widgets\nimport matplotlib.pyplot as plt\nfrom IPython.display "
            "import display"
        )
    )
    nb.cells += [nbformat.v4.new_code_cell(WIDGET_CELL) for _ in range(cells)]
    nbformat.write(nb, path)
    return path


CLIENTS = ("stock", "quiet-output", "sliced", "both")


def run_synthetic(path: Path, out: Path, cell_timeout: int, client: str) -> list[float]:
    """Execute the synthetic notebook once in this process; the duration of each widget cell."""
    import papermill as pm

    extra = {}
    if client in ("quiet-output", "both"):
        extra["widget_registry"] = run_notebooks.widget_registry()
    if client in ("sliced", "both"):
        extra["kernel_manager_class"] = run_notebooks.kernel_manager_class()
    nb = pm.execute_notebook(str(path), str(out), kernel_name="python3", progress_bar=False,
                             execution_timeout=cell_timeout, log_output=False, **extra)
    return [float(c.metadata.papermill.duration or 0.0) for c in nb.cells[1:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument(
        "--only", default=None, help="notebooks to soak, e.g. 03,05 (default: the whole series)"
    )
    ap.add_argument("--smoke", type=int, default=1)
    ap.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="a cell this slow counts as a stall (default: the SMOKE per-cell limit; 10 s for "
             "--synthetic)",
    )
    ap.add_argument("--synthetic", type=int, default=0, metavar="CELLS",
                    help="soak a generated notebook of CELLS widget cells instead of the series")
    ap.add_argument(
        "--client",
        choices=CLIENTS,
        default="both",
        help="with --synthetic: which of the runner's changes to nbclient are on (stock reproduces "
             "the stall)",
    )
    ap.add_argument(
        "--cell-timeout", type=int, default=20, help="with --synthetic: seconds per cell"
    )
    args = ap.parse_args(argv)
    stall_s = (
        args.stall_s
        if args.stall_s is not None
        else (10.0 if args.synthetic else float(run_notebooks.CELL_LIMIT[True]))
    )

    stalls, cells, walls, slowest = 0, 0, [], (0.0, "")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        nb = synthetic_notebook(tmp / "widgets.ipynb", args.synthetic) if args.synthetic else None
        for run in range(1, args.runs + 1):
            t0 = time.perf_counter()
            if nb is not None:
                durations = run_synthetic(nb, tmp / "out.ipynb", args.cell_timeout, args.client)
                slow = [round(d, 1) for d in durations if d >= stall_s]
                cells += len(durations)
                stalls += len(slow)
                note = (
                    f"{len(durations)} widget cells, max {max(durations):.2f} s, "
                    f"stalled: {slow or 'none'}"
                )
            else:
                params = run_notebooks.parameters(bool(args.smoke), 0, "cpu", None)
                bad = []
                for path in run_notebooks.notebooks(args.only):
                    row = run_notebooks.run_one(
                        path, params, timeout=1800, out_dir=tmp / f"run{run}"
                    )
                    cells += 1
                    cell_s = row["slowest_cell_s"] or 0.0
                    slowest = max(
                        slowest, (cell_s, f"{row['notebook']} cell {row['slowest_cell']}")
                    )
                    if row["status"] != "ok" or cell_s >= stall_s:
                        bad.append(
                            f"{row['notebook']} (cell {row['slowest_cell']}, {cell_s} s) "
                            f"{row['error']}"
                        )
                stalls += len(bad)
                note = f"{cells // run} notebooks, stalled or failed: {bad or 'none'}"
            walls.append(time.perf_counter() - t0)
            print(f"run {run:3d}/{args.runs}: {walls[-1]:7.1f} s  {note}", flush=True)
    unit = f"widget cells (client: {args.client})" if nb is not None else "notebook runs"
    print(
        f"soak: {stalls} stall(s) in {cells} {unit} over {args.runs} runs "
        f"(run wall median {statistics.median(walls):.1f} s, min {min(walls):.1f}, max "
        f"{max(walls):.1f}; "
        f"stall = a cell of {stall_s:g} s or more{' or a failed notebook' if nb is None else ''})"
    )
    if nb is None:
        print(f"soak: the slowest cell seen: {slowest[0]} s ({slowest[1]})")
    return 1 if stalls else 0


if __name__ == "__main__":
    sys.exit(main())
