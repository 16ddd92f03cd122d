"""Execute the notebook series headless with papermill; write executed notebooks, HTML and timings.

    python scripts/run_notebooks.py [--smoke 1] [--model ID_OR_PATH] [--device auto] [--only 00,01]

Each notebook runs in a fresh kernel in its own process, with parameters SMOKE, SEED, DEVICE (and
MODEL when given), from the ``notebooks/`` folder. Outputs go to ``build/notebooks/``:
``NN_slug.ipynb`` (executed), ``NN_slug.html``, ``timings.csv`` (wall seconds, peak memory of the
kernel, status) and ``index.html``; ``--out DIR`` writes them elsewhere (e.g. a run on another
model). One line is printed per notebook; the exit code is non-zero when any notebook fails.

``--strip`` instead removes outputs and execution counts from the committed notebooks; ``--lab-css
DIR`` writes JupyterLab's custom CSS that draws Chinese with the shipped font
(``scripts/setup.sh``, ``make lab``).

The HTML handout works offline: its widget snapshots (sliders, progress bars) are drawn by the
``@jupyter-widgets/html-manager`` bundle and require.js, which ``--fetch-widgets`` (run by
``scripts/setup.sh``) fetches once from the npm registry into ``build/vendor/widgets/``; each run
copies them into ``<out>/_widgets/`` and points the HTML there. Without that folder the HTML falls
back to the public CDNs (and says so).
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "build" / "notebooks"
WIDGETS = ROOT / "build" / "vendor" / "widgets"
# Pinned npm packages behind the offline handout: the widget renderer matching ipywidgets 8, and its
# loader.
WIDGET_PACKAGES = {"@jupyter-widgets/html-manager@1.0.15": "dist/", "requirejs@2.3.8": "require.js"}


def notebooks(only: str | None = None) -> list[Path]:
    """The series in order; ``only`` is a comma-separated list of number prefixes or names."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))  # 04b sorts after 04
    if only:
        keys = [k.strip() for k in only.split(",") if k.strip()]
        paths = [p for p in paths if any(p.name.startswith(k) or p.stem == k for k in keys)]
    return paths


def parameters(smoke: bool, seed: int, device: str, model: str | None) -> dict:
    """The papermill parameters for one run."""
    params = {"SMOKE": smoke, "SEED": seed, "DEVICE": device}
    if model:
        params["MODEL"] = model
    return params


def _sign(path: str) -> None:
    """Trust the executed notebook in this user's Jupyter, so JupyterLab renders its stored widget
    state.

    An untrusted notebook shows its sliders as plain text; a copy handed to another machine needs
    ``jupyter trust`` there (docs/workshop.md).
    """
    try:
        import nbformat
        from nbformat.sign import NotebookNotary

        NotebookNotary().sign(nbformat.read(path, as_version=4))
    except Exception as e:  # never fail a run over the trust database
        print(f"note: could not sign {path}: {e}", file=sys.stderr)


# The widget-cell stall (issue 36), and the two changes to the headless client that end it.
#
# The cause: nbclient waits for a cell's ``execute_reply`` with one long ``poll`` on the shell
# socket (up to the cell timeout), through pyzmq's asyncio integration, which is woken by zmq's
# edge-triggered ``ZMQ_FD``. Any other call on that socket -- a send, or a read of ``zmq.EVENTS`` --
# can consume the edge; when it does, the reply sits in the socket and the poll sleeps until its
# timeout, after which a final ``zmq_poll(0)`` finds the reply and the cell "completes" after
# exactly the cell timeout with no error (what 03 and 05 showed; jupyter/nbclient#312,
# zeromq/pyzmq#2173). The series triggers it through ``widgets.interactive_output``: nbclient mimics
# a front end for the ``Output`` widget it draws into and, for every output captured, sends the
# widget's state back to the kernel as a ``comm_msg`` on that same shell socket while the poll is
# pending.
#
# The fix: (1) the Output-widget mimic keeps captured outputs on the client side and writes nothing
# to the kernel (the saved widget state the handout draws is built from the client's own copy, so it
# is unchanged; no cell reads ``Output.outputs`` back in the kernel); (2) every wait on a kernel
# socket is sliced into polls of ``POLL_SLICE_S``, each ending in a real ``zmq_poll``, so a lost
# wakeup from any other trigger costs at most one slice, never the cell timeout. Numbers:
# ``scripts/soak_notebooks.py``.
POLL_SLICE_S = 0.25


def kernel_manager_class() -> type:
    """nbclient's kernel manager, whose client waits on its shell and IOPub sockets in short
    slices."""
    from queue import Empty

    from jupyter_client.asynchronous.client import AsyncKernelClient
    from jupyter_client.channels import AsyncZMQSocketChannel
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import Type

    class SlicedPollChannel(AsyncZMQSocketChannel):
        async def get_msg(self, timeout: float | None = None) -> dict:
            """The next message; ``Empty`` after ``timeout`` seconds (None: wait for ever), in
            slices."""
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = (
                    POLL_SLICE_S
                    if deadline is None
                    else max(0.0, min(POLL_SLICE_S, deadline - time.monotonic()))
                )
                if await self.socket.poll(int(left * 1000)):
                    return await self._recv()
                if deadline is not None and time.monotonic() >= deadline:
                    raise Empty

    class SlicedPollClient(AsyncKernelClient):
        shell_channel_class = Type(SlicedPollChannel)
        iopub_channel_class = Type(SlicedPollChannel)

    class SlicedPollKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.client_factory = SlicedPollClient

    return SlicedPollKernelManager


def widget_registry() -> dict:
    """nbclient's widget registry with an Output-widget mimic that never writes to the kernel (see
    above)."""
    from nbclient.output_widget import OutputWidget

    class HeadlessOutputWidget(OutputWidget):
        def sync_state(self) -> None:
            """Keep the captured outputs on the client side only (see ``widget_registry``)."""

    return {"@jupyter-widgets/output": {"OutputModel": HeadlessOutputWidget}}


def slowest_cell(nb_path: str | Path) -> dict:
    """The slowest code cell of an executed notebook: index, first source line, seconds (from
    papermill)."""
    import nbformat

    best = {"cell": None, "first_line": "", "seconds": 0.0}
    try:
        nb = nbformat.read(nb_path, as_version=4)
    except (OSError, ValueError):  # no executed copy (the kernel never started): nothing to report
        return best
    for i, cell in enumerate(nb.cells):
        seconds = (cell.metadata.get("papermill") or {}).get("duration") or 0.0
        if cell.cell_type == "code" and seconds >= best["seconds"]:
            lines = [ln for ln in cell.source.splitlines() if ln.strip()] or [""]
            best = {"cell": i, "first_line": lines[0][:80], "seconds": round(float(seconds), 1)}
    return best


def _execute_here(nb: str, out: str, params_json: str, cell_limit: int) -> None:
    """Child-process entry: run papermill, then report the kernel's peak RSS on stdout's last line.

    A cell running past ``cell_limit`` seconds is stopped and fails the notebook by name.
    """
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError

    error = None
    try:
        pm.execute_notebook(nb, out, parameters=json.loads(params_json), kernel_name="python3",
                            cwd=str(NOTEBOOKS), progress_bar=False, execution_timeout=cell_limit,
                            log_output=False, widget_registry=widget_registry(),
                            kernel_manager_class=kernel_manager_class())
    except CellTimeoutError:
        error = "timeout"
    except Exception as e:  # papermill raises PapermillExecutionError with the failing cell
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    slow = slowest_cell(out)
    # the stopped cell is the slowest: every other one finished inside the limit
    if error == "timeout":
        error = (
            f"cell {slow['cell']} of the executed copy ran past the per-cell limit of "
            f"{cell_limit} s: {slow['first_line']!r}"
        )
    _sign(out)
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the kernel, KiB on Linux
    print(json.dumps({"peak_mb": round(peak_kb / 1024, 1), "error": error, "slowest": slow}))


def _show(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# Per-cell limits far below the notebook timeout, so a stalled cell fails the run by name (issue
# 36). SMOKE's 120 s leaves room for 06's vLLM cell (which waits for vLLM's engine start: 57 s seen
# on a loaded 2-core machine).
CELL_LIMIT = {False: 180, True: 120}


def run_one(
    nb: Path, params: dict, timeout: float, out_dir: Path = OUT, cell_limit: int | None = None
) -> dict:
    """Execute one notebook in a fresh process and kernel; return a timings row.

    ``cell_limit`` (seconds; default 180, or 120 in SMOKE) stops a cell that runs longer and marks
    the notebook failed, naming the cell.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / nb.name
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    if cell_limit is None:
        cell_limit = CELL_LIMIT[bool(params.get("SMOKE"))]
    cell_limit = int(min(timeout, cell_limit))
    cmd = [
        sys.executable,
        __file__,
        "--_execute",
        str(nb),
        str(out),
        json.dumps(params),
        str(cell_limit),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
        wall = time.perf_counter() - t0
        try:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            info = {"peak_mb": None, "error": f"runner crashed: {proc.stderr.strip()[-500:]}"}
    except subprocess.TimeoutExpired:
        wall = time.perf_counter() - t0
        info = {"peak_mb": None, "error": f"timed out after {timeout:.0f} s"}
    slow = info.get("slowest") or {"cell": None, "first_line": "", "seconds": None}
    row = {"notebook": nb.name, "status": "ok" if not info["error"] else "failed",
           "wall_s": round(wall, 1), "peak_mem_mb": info["peak_mb"], "error": info["error"] or "",
           "slowest_cell": slow["cell"], "slowest_cell_s": slow["seconds"],
           "slowest_cell_line": slow["first_line"], "output": str(out)}
    row.update({k: params[k] for k in ("SMOKE", "DEVICE")})
    row["MODEL"] = params.get("MODEL", "bundled")
    return row


def fetch_widgets(dest: Path = WIDGETS) -> bool:
    """Fetch the pinned widget renderer and require.js from the npm registry into ``dest``; True
    when there."""
    if (dest / "embed-amd.js").is_file() and (dest / "require.js").is_file():
        return True
    if shutil.which("npm") is None:
        print(
            "widgets: npm not found; the HTML handout will load its widget renderer from a CDN",
            file=sys.stderr,
        )
        return False
    with tempfile.TemporaryDirectory() as tmp:
        packed = subprocess.run(["npm", "pack", "--silent", *WIDGET_PACKAGES], cwd=tmp,
                                capture_output=True, text=True)
        if packed.returncode != 0:
            print(f"widgets: npm pack failed: {packed.stderr.strip()[-300:]}", file=sys.stderr)
            return False
        staging = Path(tmp) / "widgets"
        staging.mkdir()
        for tgz, keep in zip(packed.stdout.split(), WIDGET_PACKAGES.values()):
            with tarfile.open(Path(tmp) / tgz) as tar:
                for m in tar.getmembers():
                    name = m.name.removeprefix("package/")
                    if m.isfile() and name.startswith(keep) and not name.endswith(".map"):
                        m.name = Path(name).name
                        tar.extract(m, staging, filter="data")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(staging, dest)
    print(f"widgets: fetched {', '.join(WIDGET_PACKAGES)} into {_show(dest)}")
    return True


def local_widgets(out_dir: Path, source: Path = WIDGETS) -> dict[str, str]:
    """Copy the vendored renderer next to the HTML; the exporter settings that point at it ({} if
    absent)."""
    if not (source / "embed-amd.js").is_file():
        return {}
    target = out_dir / "_widgets"
    if not (target / "embed-amd.js").is_file():
        shutil.copytree(source, target, dirs_exist_ok=True)
    return {"require_js_url": "_widgets/require.js", "widget_renderer_url": "_widgets/embed-amd.js"}


# JupyterLab's HTML template without its MathJax and Mermaid blocks, the scripts it would load from
# a CDN: the series writes no TeX and no Mermaid diagrams (tests/lessons/test_notebooks.py checks
# the TeX). ``html_head_css`` (after the theme's CSS) holds a marker that ``to_html`` replaces with
# the page's CJK font (issue 40).
FONT_MARKER = "<!-- kvlab: CJK font -->"
NO_MATHJAX = ("{% extends 'lab/index.html.j2' %}"
              "{% block html_head_js_mathjax %}{% endblock html_head_js_mathjax %}"
              "{% block html_head_js_mermaidjs %}{% endblock html_head_js_mermaidjs %}"
              "{% block html_head_css %}" + FONT_MARKER + "{% endblock html_head_css %}")


def notebook_title(nb, default: str) -> str:
    """The text of a notebook's first markdown heading, without its markdown (links, emphasis, code
    marks)."""
    import re

    for cell in nb.cells:
        heading = (
            re.search(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", cell.source, re.M)
            if cell.cell_type == "markdown"
            else None
        )
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            return re.sub(r"[*_`]", "", text).strip() or default
    return default


def to_html(executed: Path, widgets: dict[str, str] | None = None) -> Path:
    """Render an executed notebook to HTML next to it (widget scripts from ``widgets`` URLs when
    given).

    The page is titled by the notebook's first markdown heading, leaves out papermill's injected
    parameters cell, and embeds the subset of the shipped CJK font
    (``data/fonts/kvlab-cjk-sans.otf``, OFL) holding just the CJK characters on the page, as a data
    URL: Chinese text reads on a machine without a CJK font, and the file stands alone
    (``make_cjk_font.font_face_css``).
    """
    import re

    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    from make_cjk_font import font_face_css

    nb = nbformat.read(executed, as_version=4)
    # papermill's injected "# Parameters" cell repeats the parameters cell above it: not on the page
    nb.cells = [
        c for c in nb.cells if "injected-parameters" not in c.get("metadata", {}).get("tags", [])
    ]
    # the template's <title> (in memory only)
    nb.metadata["title"] = notebook_title(nb, Path(executed).stem)
    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"kvlab.html.j2": NO_MATHJAX})],
                            template_file="kvlab.html.j2", **(widgets or {}))
    body, _ = exporter.from_notebook_node(nb)
    # The theme's font stacks, each to get the CJK face first: the last definition on the page wins.
    stacks = {m.group(1): m.group(2).strip() for m in re.finditer(
        r"(--jp-(?:ui|content|code)-font-family(?:-default)?)\s*:\s*([^;{}]+);", body)
        if not m.group(2).strip().startswith("var(")}
    # the page, and the widget state it draws
    page_text = html.unescape(body) + json.dumps(nb, ensure_ascii=False)
    css, lacking = font_face_css(page_text, stacks)
    if lacking:
        print(
            f"fonts: {executed.name}: {len(lacking)} CJK characters not in "
            "data/fonts/kvlab-cjk-sans.otf "
            f"({''.join(lacking)}): run scripts/make_cjk_font.py",
            file=sys.stderr,
        )
    body = body.replace(FONT_MARKER, f'<style type="text/css">\n{css}</style>' if css else "", 1)
    target = executed.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return target


# JupyterLab 4's font stacks (its light and dark themes), when the installed theme's CSS cannot be
# read
LAB_STACKS = {
    "--jp-ui-font-family": "system-ui, -apple-system, blinkmacsystemfont, 'Segoe UI', helvetica, "
    "arial, sans-serif, 'Apple Color Emoji', 'Segoe UI Emoji', 'Segoe UI Symbol'",
    "--jp-code-font-family-default": "menlo, consolas, 'DejaVu Sans Mono', monospace",
}
LAB_STACKS["--jp-content-font-family"] = LAB_STACKS["--jp-ui-font-family"]


def lab_css(dest: Path) -> Path:
    """JupyterLab's custom CSS for ``make lab``: Chinese drawn with the shipped font on a machine
    without a CJK font.

    Writes ``dest/custom.css`` with an ``@font-face`` on ``dest/kvlab-cjk-sans.otf`` (a copy of
    data/fonts', OFL, whose text is copied beside it), covering CJK code points only, and put first
    in the theme's ui, content and code font stacks (``:root:root`` outranks the theme's
    ``:root``). Jupyter serves the folder at ``/custom/`` when it is
    ``<JUPYTER_CONFIG_DIR>/custom`` and the server runs with ``--LabApp.custom_css=True``.
    """
    import re

    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    from make_cjk_font import CJK_RANGES, FAMILY
    from make_cjk_font import OUT as FONT

    theme = (
        Path(sys.prefix) / "share/jupyter/lab/themes/@jupyterlab/theme-light-extension/index.css"
    )
    found = dict(re.findall(r"(--jp-(?:ui|content|code)-font-family(?:-default)?)\s*:\s*([^;{}]+);",
                            theme.read_text(encoding="utf-8"))) if theme.is_file() else {}
    stacks = {k: found.get(k, v).strip() for k, v in LAB_STACKS.items()}
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FONT, dest / FONT.name)
    shutil.copyfile(FONT.with_name("OFL.txt"), dest / "OFL.txt")
    ranges = ",".join(f"U+{lo:X}-{hi:X}" for lo, hi in CJK_RANGES)
    overrides = "".join(f"\n  {k}: '{FAMILY}', {v};" for k, v in stacks.items())
    css = (
        f"/* kvlab (scripts/run_notebooks.py --lab-css): {FAMILY}, a subset of Noto Sans CJK SC "
        "under the SIL Open\n"
        f"   Font License 1.1 (OFL.txt beside this file), for the CJK characters only. */\n"
        f"@font-face {{\n  font-family: '{FAMILY}';\n  font-style: normal;\n  font-weight: "
        "normal;\n"
        f"  font-display: block;\n  unicode-range: {ranges};\n  src: url('{FONT.name}') "
        f"format('opentype');\n}}\n"
        f":root:root {{{overrides}\n}}\n"
    )
    (dest / "custom.css").write_text(css, encoding="utf-8")
    return dest / "custom.css"


def write_report(rows: list[dict], out_dir: Path = OUT) -> None:
    """timings.csv and an index.html listing every notebook by its title, linked to its page."""
    fields = [
        "notebook",
        "status",
        "wall_s",
        "peak_mem_mb",
        "slowest_cell",
        "slowest_cell_s",
        "slowest_cell_line",
        "SMOKE",
        "DEVICE",
        "MODEL",
        "error",
    ]
    with open(out_dir / "timings.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    import nbformat

    def title(r: dict) -> str:
        for path in (r.get("output"), NOTEBOOKS / r["notebook"]):
            if path and Path(path).is_file():
                return notebook_title(nbformat.read(path, as_version=4), Path(r["notebook"]).stem)
        return Path(r["notebook"]).stem

    def row(r: dict) -> str:
        page = html.escape(Path(r["notebook"]).with_suffix(".html").name)
        name = html.escape(title(r))
        link = f"<a href='{page}'>{name}</a>" if r["status"] == "ok" else name
        return (
            f"<tr class='{html.escape(r['status'])}'><td>{link}<div "
            f"class='file'>{html.escape(r['notebook'])}</div></td>"
            f"<td>{r['status']}</td><td class='n'>{r['wall_s']}</td><td "
            f"class='n'>{r['peak_mem_mb']}</td>"
            f"<td>{html.escape(r['error'])}</td></tr>"
        )

    style = (
        "body{font-family:system-ui,-apple-system,'Segoe UI',helvetica,arial,'kvlab CJK "
        "Sans',sans-serif;"
        "max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}h1{font-weight:600}"
        "table{border-collapse:collapse;width:100%}th,td{padding:.45rem .6rem;border-bottom:1px "
        "solid #ddd;"
        "text-align:left;vertical-align:top}th{background:#f4f4f4}a{color:#0b5cad;text-decoration:none;"
        "font-weight:500}a:hover{text-decoration:underline}.file{color:#777;font-size:.8rem}"
        ".n{text-align:right;font-variant-numeric:tabular-nums}tr:not(.ok) td{background:#fff3f3}"
    )
    body = (
        "<h1>kvlab: the executed series</h1><table><tr><th>notebook</th><th>status</th><th "
        "class='n'>wall s</th>"
        "<th class='n'>peak MB</th><th>error</th></tr>"
        + "\n".join(row(r) for r in rows)
        + "</table>"
    )
    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    from make_cjk_font import font_face_css

    # the titles' CJK characters, embedded as on every page
    font, _ = font_face_css(html.unescape(body), {})
    (out_dir / "index.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>kvlab: the executed "
        "series</title>"
        f"<style>{font}{style}</style></head><body>{body}</body></html>\n",
        encoding="utf-8",
    )


def strip_outputs(paths: list[Path]) -> None:
    """Remove outputs and execution counts from notebooks in place."""
    import nbformat

    for p in paths:
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
            cell.metadata.pop("papermill", None)
        nb.metadata.pop("papermill", None)
        nbformat.write(nb, p)
        print(f"stripped {p.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", type=int, default=0, help="1 = SMOKE mode (small sizes)")
    ap.add_argument(
        "--model", default=None, help="HF id or local path (default: the bundled model)"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per notebook")
    ap.add_argument(
        "--cell-limit",
        type=int,
        default=None,
        help="seconds one cell may run before the notebook fails (default 180, 120 with --smoke 1)",
    )
    ap.add_argument("--only", default=None, help="e.g. 00,03")
    ap.add_argument("--out", default=None, help="output folder (default: build/notebooks)")
    ap.add_argument("--no-html", action="store_true")
    ap.add_argument("--strip", action="store_true", help="strip outputs from notebooks/ and exit")
    ap.add_argument("--fetch-widgets", action="store_true",
                    help="fetch the offline widget renderer into build/vendor/widgets and exit")
    ap.add_argument(
        "--lab-css",
        type=Path,
        default=None,
        metavar="DIR",
        help="write JupyterLab's custom.css (the shipped CJK font) into DIR and exit (make lab)",
    )
    ap.add_argument("--_execute", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._execute:
        _execute_here(*args._execute[:3], int(args._execute[3]))
        return 0
    if args.fetch_widgets:
        return 0 if fetch_widgets() else 1
    if args.lab_css:
        print(f"wrote {lab_css(args.lab_css)}")
        return 0
    paths = notebooks(args.only)
    if args.strip:
        strip_outputs(paths)
        return 0
    if not paths:
        print("no notebooks matched", file=sys.stderr)
        return 2
    params = parameters(bool(args.smoke), args.seed, args.device, args.model)
    out_dir = Path(args.out).resolve() if args.out else OUT
    print(f"executing {len(paths)} notebook(s) with {params} -> {_show(out_dir)}/", flush=True)
    widgets = {}
    if not args.no_html:
        out_dir.mkdir(parents=True, exist_ok=True)
        widgets = local_widgets(out_dir) if fetch_widgets() else {}
        if not widgets:
            print(
                "widgets: no local renderer; the HTML needs the network to draw sliders",
                file=sys.stderr,
            )
    rows = []
    for nb in paths:
        row = run_one(nb, params, args.timeout, out_dir, args.cell_limit)
        if row["status"] == "ok" and not args.no_html:
            to_html(Path(row["output"]), widgets)
        rows.append(row)
        print(
            f"{row['status']:6s} {row['notebook']:40s} {row['wall_s']:7.1f} s  "
            f"peak {row['peak_mem_mb']} MB  slowest cell {row['slowest_cell']} "
            f"{row['slowest_cell_s']} s  "
            f"{row['error']}",
            flush=True,
        )
    write_report(rows, out_dir)
    failed = [r["notebook"] for r in rows if r["status"] != "ok"]
    print(f"{len(rows) - len(failed)}/{len(rows)} ok; report: {_show(out_dir / 'index.html')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
