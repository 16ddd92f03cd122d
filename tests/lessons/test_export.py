"""The notebook is the source: ``#| export`` cells -> kvlab/built/nbNN.py
(scripts/export_notebooks.py)."""

import io
import json
import shutil
import sys
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import export_notebooks  # noqa: E402


def test_the_generated_module_equals_what_the_notebooks_say():
    assert export_notebooks.generated_files() == export_notebooks.build(), (
        "kvlab/built/ is out of date: run `python scripts/export_notebooks.py`")
    assert export_notebooks.main(["--check"]) == 0


def test_an_edited_export_cell_is_caught(tmp_path):
    for nb in export_notebooks.NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(nb, tmp_path / nb.name)
    name, index, _ = export_notebooks.exported_cells(tmp_path)[0]
    nb = json.loads((tmp_path / name).read_text(encoding="utf-8"))
    nb["cells"][index]["source"].append("\nEDITED = True\n")
    (tmp_path / name).write_text(json.dumps(nb), encoding="utf-8")
    module = export_notebooks.module_name(name) + ".py"
    built = export_notebooks.build(tmp_path)
    assert "EDITED = True" in built[module]
    assert built[module] != export_notebooks.generated_files()[module]
    assert {f: t for f, t in built.items() if f != module} == {
        f: t for f, t in export_notebooks.generated_files().items() if f != module
    }, "only its notebook's module changes"


def test_check_fails_on_a_differing_or_stale_module(tmp_path, monkeypatch, capsys):
    target = tmp_path / "built"
    target.mkdir()
    for f, text in export_notebooks.build().items():
        (target / f).write_text(text, encoding="utf-8")
    monkeypatch.setattr(export_notebooks, "TARGET_DIR", target)
    monkeypatch.setattr(export_notebooks, "ROOT", tmp_path)
    assert export_notebooks.main(["--check"]) == 0
    (target / "nb99.py").write_text("x = 1\n", encoding="utf-8")
    assert export_notebooks.main(["--check"]) == 1
    assert "nb99.py is generated from no notebook" in capsys.readouterr().err
    (target / "nb99.py").unlink()
    first = sorted(target.glob("nb*.py"))[0]
    first.write_text(first.read_text(encoding="utf-8") + "# hand edit\n", encoding="utf-8")
    assert export_notebooks.main(["--check"]) == 1
    assert f"{first.name} differs" in capsys.readouterr().err


def test_a_broken_notebook_is_named_and_nothing_is_written(tmp_path):
    (tmp_path / "00_bad.ipynb").write_text('{"cells": [', encoding="utf-8")
    with pytest.raises(SystemExit, match="00_bad.ipynb: not a notebook"):
        export_notebooks.build(tmp_path)
    assert (tmp_path / "00_bad.ipynb").read_text(encoding="utf-8") == '{"cells": ['


def test_imports_are_gathered_once_at_the_top(tmp_path):
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None}
    cells = [
        dict(cell, source=["#| export\n", "import torch\n", "\n", "def f():\n", "    return 1\n"]),
        dict(
            cell,
            source=[
                "#| export\n",
                "import math\n",
                "import torch\n",
                "def g():\n",
                "    return 2\n",
            ],
        ),
        dict(cell, source=["not exported = 1\n"]),
    ]
    (tmp_path / "00_x.ipynb").write_text(json.dumps({"cells": cells}), encoding="utf-8")
    text = export_notebooks.build(tmp_path)["nb00.py"]
    assert text.count("import torch") == 1 and text.index("import math") < text.index(
        "import torch"
    )
    assert "# --- 00_x.ipynb, cell 0 ---\ndef f():" in text and "not exported" not in text
    namespace: dict = {}
    exec(compile(text, "built", "exec"), namespace)
    assert namespace["f"]() + namespace["g"]() == 3


def test_no_notebook_prints_source():
    """A notebook writes its mechanism in cells; none prints library source with
    inspect.getsource."""
    printing = [nb.name for nb in sorted(export_notebooks.NOTEBOOKS.glob("*.ipynb"))
                if "getsource" in nb.read_text(encoding="utf-8")]
    assert printing == [], f"these notebooks print source with inspect.getsource: {printing}"
    assert {name for name, _, _ in export_notebooks.exported_cells()}, "no notebook exports a cell"


# issue 50: kvlab/lessons + kvlab/built together (8,277 physical lines before it); experiment
# runners moved from the notebooks into kvlab/lessons, so the budget covers both layers. Counted in
# logical lines (statements, tokenize's NEWLINE tokens: what wrapping to 100 columns does not
# change; 4,648 when E501 was switched on, 6,952 physical lines then)
LESSON_LOGICAL_LINES = 4700


def logical_lines(source: str) -> int:
    """Statements of ``source`` as Python counts them: a wrapped call or string is one line."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(1 for t in tokens if t.type == tokenize.NEWLINE)


def test_logical_lines_ignore_wrapping():
    assert logical_lines("x = f(1,\n      2)\ny = 'a' 'b'\n") == 2
    assert logical_lines(
        'def f():\n    """doc\n    more"""\n    return (1 +\n            2)\n'
    ) == 3


def test_the_lesson_layers_stay_small():
    """kvlab/built (what the notebooks write) and kvlab/lessons (the floor, runners, figures,
    checkers) together stay within their budget of logical lines: cut, don't just move."""
    root = export_notebooks.ROOT / "kvlab"
    lines = {
        f"{p.parent.name}/{p.name}": logical_lines(p.read_text(encoding="utf-8"))
        for folder in ("lessons", "built")
        for p in sorted((root / folder).glob("*.py"))
    }
    assert sum(lines.values()) <= LESSON_LOGICAL_LINES, (
        f"kvlab/lessons + kvlab/built have {sum(lines.values())} logical lines "
        f"(budget {LESSON_LOGICAL_LINES}); largest: "
        f"{sorted(lines.items(), key=lambda kv: -kv[1])[:4]}"
    )


@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (64, 1e6), (128, 500000.0)])
def test_the_notebooks_rope_agrees_with_the_library_copy(head_dim, theta):
    """kvlab/engine/rope.py keeps its own copy (the library never imports lessons): the two must
    agree."""
    from kvlab.built import nb03 as built
    from kvlab.engine import rope as engine_rope

    assert torch.equal(
        built.inverse_frequencies(head_dim, theta), engine_rope.inverse_frequencies(head_dim, theta)
    )
    x = torch.randn(2, 3, 5, head_dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(built.rotate_half(x), engine_rope.rotate_half(x))
