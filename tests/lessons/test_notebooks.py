"""Every notebook: committed clean, has a parameters cell, and runs headless in SMOKE mode."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import run_notebooks  # noqa: E402

NOTEBOOKS = run_notebooks.notebooks()
REQUIRED = ("MODEL", "DEVICE", "SMOKE", "SEED")


def test_the_series_is_there():
    names = [p.name for p in NOTEBOOKS]
    assert names and names[0].startswith("00_"), names


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_clean_with_parameters_cell(nb):
    cells = json.loads(nb.read_text())["cells"]
    outputs = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not outputs, (
        f"{nb.name}: cells {outputs} have committed outputs; run `make clean-notebooks`"
    )
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{nb.name}: needs exactly one cell tagged 'parameters'"
    from papermill.translators import PythonTranslator

    cell = {"source": "".join(tagged[0]["source"])}
    parsed = {p.name for p in PythonTranslator.inspect(cell)}  # what papermill can override
    missing = [name for name in REQUIRED if name not in parsed]
    assert not missing, (
        f"{nb.name}: papermill finds no {missing} in the parameters cell "
        "(a comment with '=' or ';'?)"
    )


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_kernel_display_name_is_the_one_setup_installs(nb):
    """Another display name marks the notebook modified on open in JupyterLab (closing asks to
    save)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    spec = json.loads(nb.read_text())["metadata"]["kernelspec"]
    assert f'--name {spec["name"]} --display-name "{spec["display_name"]}"' in setup


def test_html_loads_the_widget_renderer_from_the_local_copy(tmp_path):
    import nbformat

    vendor = tmp_path / "vendor"
    vendor.mkdir()
    for name in ("embed-amd.js", "require.js"):
        (vendor / name).write_text("// stub")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    nb.metadata["widgets"] = {
        "application/vnd.jupyter.widget-state+json": {
            "version_major": 2,
            "version_minor": 0,
            "state": {},
        }
    }
    out = tmp_path / "out"
    out.mkdir()
    nbformat.write(nb, out / "x.ipynb")
    widgets = run_notebooks.local_widgets(out, vendor)
    body = run_notebooks.to_html(out / "x.ipynb", widgets).read_text()
    assert (out / "_widgets" / "embed-amd.js").is_file() and (
        out / "_widgets" / "require.js"
    ).is_file()
    assert "'_widgets/embed-amd.js'" in body and 'src="_widgets/require.js"' in body
    assert "unpkg.com" not in body and "cdn.jsdelivr" not in body and "require.min.js" not in body
    # no vendored copy: the CDN defaults
    assert run_notebooks.local_widgets(out, tmp_path / "missing") == {}
    assert not re.findall(r'<script[^>]+src="https?://', body), (
        "the handout loads a script from the network"
    )
    assert "cdnjs" not in body and "mathjax" not in body.lower()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_writes_no_tex(nb):
    """The HTML handout leaves MathJax out (it would load from a CDN): a notebook with TeX needs it
    shipped first."""
    cells = json.loads(nb.read_text())["cells"]
    tex = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
           and re.search(r"(?<![\\`])\$[^$`\n]+\$|\$\$|\\\(|\\\[", "".join(c["source"]))]
    assert not tex, (
        f"{nb.name}: markdown cells {tex} hold TeX, which the offline handout cannot render"
    )


@pytest.mark.notebook
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_headless_in_smoke_mode(nb, tmp_path):
    params = run_notebooks.parameters(smoke=True, seed=0, device="cpu", model=None)
    row = run_notebooks.run_one(nb, params, timeout=600, out_dir=tmp_path)
    assert row["status"] == "ok", (
        f"{nb.name} failed after {row['wall_s']} s: {row['error']} (executed copy: {row['output']})"
    )


def _tiny_notebook(path: Path, *sources: str) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    params = nbformat.v4.new_code_cell("SMOKE = True")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, *(nbformat.v4.new_code_cell(s) for s in sources)]
    nbformat.write(nb, path)
    return path


def test_a_cell_past_the_per_cell_limit_fails_the_notebook_by_name(tmp_path):
    nb = _tiny_notebook(
        tmp_path / "stall.ipynb", "x = 1", "import time\ntime.sleep(60)  # a stalled cell", "y = 2"
    )
    params = run_notebooks.parameters(smoke=True, seed=0, device="cpu", model=None)
    row = run_notebooks.run_one(nb, params, timeout=120, out_dir=tmp_path / "out", cell_limit=3)
    assert row["status"] == "failed", row
    assert (
        "cell 3 of the executed copy ran past the per-cell limit of 3 s" in row["error"]
        and "import time" in row["error"]
    ), row
    assert row["wall_s"] < 60, row  # stopped at the limit, not when the sleep ended


def test_timings_name_the_slowest_cell_and_widget_state_is_saved(tmp_path):
    slider = ("import ipywidgets as widgets\nfrom IPython.display import display\n"
              "s = widgets.IntSlider(value=2, min=1, max=5)\n"
              "display(s, widgets.interactive_output(lambda k: print('k =', k), {'k': s}))")
    nb = _tiny_notebook(tmp_path / "ok.ipynb", "import time\ntime.sleep(1.5)", slider, slider)
    params = run_notebooks.parameters(smoke=True, seed=0, device="cpu", model=None)
    row = run_notebooks.run_one(nb, params, timeout=120, out_dir=tmp_path / "out")
    assert row["status"] == "ok", row
    assert (
        row["slowest_cell"] == 2
        and row["slowest_cell_s"] >= 1.5
        and row["slowest_cell_line"] == "import time"
    )
    run_notebooks.write_report([row], tmp_path / "out")
    assert "slowest_cell_s" in (tmp_path / "out" / "timings.csv").read_text().splitlines()[0]
    # the Output widgets' captured text is in the saved widget state the handout draws
    state = json.loads(Path(row["output"]).read_text())["metadata"]["widgets"]
    outputs = [
        m["state"]["outputs"]
        for m in state["application/vnd.jupyter.widget-state+json"]["state"].values()
        if m["model_name"] == "OutputModel"
    ]
    assert [o[0]["text"] for o in outputs] == ["k = 2\n", "k = 2\n"], outputs
