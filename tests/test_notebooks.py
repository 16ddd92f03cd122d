"""Every notebook: committed clean, has a parameters cell, and runs headless in SMOKE mode."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    outputs = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not outputs, f"{nb.name}: cells {outputs} have committed outputs; run `make clean-notebooks`"
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{nb.name}: needs exactly one cell tagged 'parameters'"
    from papermill.translators import PythonTranslator

    cell = {"source": "".join(tagged[0]["source"])}
    parsed = {p.name for p in PythonTranslator.inspect(cell)}  # what papermill can override
    missing = [name for name in REQUIRED if name not in parsed]
    assert not missing, f"{nb.name}: papermill finds no {missing} in the parameters cell (a comment with '=' or ';'?)"


@pytest.mark.notebook
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_headless_in_smoke_mode(nb, tmp_path):
    params = run_notebooks.parameters(smoke=True, seed=0, device="cpu", model=None)
    row = run_notebooks.run_one(nb, params, timeout=600, out_dir=tmp_path)
    assert row["status"] == "ok", f"{nb.name} failed after {row['wall_s']} s: {row['error']} (executed copy: {row['output']})"
