"""Write each notebook's exported cells into its generated module, ``kvlab/built/nbNN.py`` (issue
38).

    python scripts/export_notebooks.py           # regenerate kvlab/built/nb*.py
    python scripts/export_notebooks.py --check   # exit 1 (and say which modules) when one differs
                                                 # from its notebook

A notebook teaches a mechanism by writing it in a visible cell. A code cell whose first line is
``#| export`` (fast.ai's nbdev spelling of d2l's ``#@save``) is copied, in order, into the module
of its notebook (``01_qkv_and_kv_cache.ipynb`` -> ``kvlab/built/nb01.py``), which later notebooks,
the lesson modules and the tests import (a later notebook's export cell imports an earlier one's
module like any other). The modules are never edited by hand: CI runs ``--check``
(tests/lessons/test_export.py), and a module whose notebook no longer exports anything is reported
as stale. The import lines at the top of an exported cell are gathered, without repeats, at the top
of the module; the rest of each cell follows under a comment naming its notebook and cell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TARGET_DIR = ROOT / "kvlab" / "built"
MARKER = "#| export"
LINE_LENGTH = 100  # pyproject's [tool.ruff] line-length: the generated modules pass `ruff check`

HEADER = '''"""What notebook {name} writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""
'''


def module_name(notebook: str) -> str:
    """``01_qkv_and_kv_cache.ipynb`` -> ``nb01``; ``03b_reusing_the_middle.ipynb`` -> ``nb03b``."""
    return "nb" + notebook.split("_", 1)[0]


def exported_cells(notebooks_dir: Path = NOTEBOOKS) -> list[tuple[str, int, str]]:
    """``(notebook name, cell index, source without the marker line)`` of every export cell, in
    series order."""
    found = []
    for path in sorted(notebooks_dir.glob("[0-9][0-9]*_*.ipynb")):
        try:
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        except (
            ValueError,
            KeyError,
            TypeError,
        ) as e:  # not JSON, or no list of cells: name the file
            raise SystemExit(
                f"{path}: not a notebook this script can read ({type(e).__name__}: {e})"
            ) from None
        for i, cell in enumerate(cells):
            source = "".join(cell["source"])
            first, _, rest = source.partition("\n")
            if cell["cell_type"] == "code" and first.strip() == MARKER:
                found.append((path.name, i, rest.strip("\n")))
    return found


def _split_imports(source: str) -> tuple[list[str], str]:
    """The cell's leading import lines (blank lines and comments between them skipped) and the
    rest."""
    lines = source.splitlines()
    imports, k = [], 0
    while k < len(lines) and (
        not lines[k].strip() or lines[k].startswith(("import ", "from ", "#"))
    ):
        if lines[k].startswith(("import ", "from ")):
            imports.append(lines[k])
        k += 1
    return imports, "\n".join(lines[k:]).strip("\n")


def _merge_imports(lines: list[str]) -> list[str]:
    """One line per module, in ruff's isort order: ``import x`` lines first, then ``from x import
    a, B, C`` (names: constants, classes, then the rest), so the generated module passes ``ruff
    check``."""
    plain, froms = set(), {}
    # a comment after an import is dropped
    for line in (line.split("#")[0].strip() for line in lines):
        if line.startswith("import "):
            plain.add(line)
        else:
            module, _, names = line[len("from "):].partition(" import ")
            froms.setdefault(module, set()).update(n.strip() for n in names.split(","))

    def by_type(name: str) -> tuple:
        bare = name.split(" as ")[0]
        return (0 if bare.isupper() else 1 if bare[:1].isupper() else 2, bare.lower(), name)
    out = sorted(plain, key=lambda line: line.split()[1].lower())
    for m in sorted(froms, key=str.lower):
        names = sorted(froms[m], key=by_type)
        line = f"from {m} import {', '.join(names)}"
        out.append(
            line
            if len(line) <= LINE_LENGTH
            else f"from {m} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        )
    return out


def build_module(name: str, cells: list[tuple[int, str]]) -> str:
    """The text of the generated module of notebook ``name`` from its ``(cell index, source)``
    export cells."""
    imports: list[str] = ["from __future__ import annotations"]
    blocks = []
    for index, source in cells:
        cell_imports, body = _split_imports(source)
        imports += [line for line in cell_imports if line not in imports]
        blocks.append(f"# --- {name}, cell {index} ---\n{body}")
    merged = _merge_imports(imports[1:])
    stdlib = [line for line in merged if line.split()[1].split(".")[0] in sys.stdlib_module_names]
    others = [line for line in merged if line not in stdlib]
    groups = [[imports[0]], stdlib, [line for line in others if " kvlab" not in line],
              [line for line in others if " kvlab" in line]]
    head = "\n\n".join("\n".join(group) for group in groups if group)
    first = cells[0][1] if cells else ""
    after = (
        "\n\n\n"
        if _split_imports(first)[1].startswith(("def ", "class ", "@", "async def "))
        else "\n\n"
    )
    return HEADER.format(name=name) + "\n" + head + after + "\n\n\n".join(blocks) + "\n"


def build(notebooks_dir: Path = NOTEBOOKS) -> dict[str, str]:
    """``{module file name: text}`` of every generated module (``nb01.py``: notebook 01's export
    cells)."""
    by_notebook: dict[str, list[tuple[int, str]]] = {}
    for name, index, source in exported_cells(notebooks_dir):
        by_notebook.setdefault(name, []).append((index, source))
    return {
        module_name(name) + ".py": build_module(name, cells) for name, cells in by_notebook.items()
    }


def generated_files(target: Path | None = None) -> dict[str, str]:
    """``{file name: text}`` of the generated modules on disk (every ``nb*.py`` of the folder)."""
    target = TARGET_DIR if target is None else target
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(target.glob("nb*.py"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--check", action="store_true", help="compare instead of writing; exit 1 when they differ"
    )
    args = ap.parse_args(argv)
    want, have = build(), generated_files()
    where = TARGET_DIR.relative_to(ROOT)
    if args.check:
        stale = sorted(set(have) - set(want))
        differ = sorted(f for f in want if have.get(f) != want[f])
        for f in differ:
            print(f"{where}/{f} differs from its notebook's export cells", file=sys.stderr)
        for f in stale:
            print(f"{where}/{f} is generated from no notebook any more: delete it", file=sys.stderr)
        if differ or stale:
            print("run `python scripts/export_notebooks.py`", file=sys.stderr)
            return 1
        print(f"{where}/: {len(want)} modules agree with {len(exported_cells())} export cells")
        return 0
    TARGET_DIR.mkdir(exist_ok=True)
    for f in sorted(set(have) - set(want)):
        (TARGET_DIR / f).unlink()
        print(f"removed {where}/{f} (its notebook exports nothing now)")
    for f, text in want.items():
        if have.get(f) != text:
            (TARGET_DIR / f).write_text(text, encoding="utf-8")
            print(f"wrote {where}/{f}")
    print(f"{where}/: {len(want)} modules from {len(exported_cells())} export cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
