"""The lesson layers run one way (d2l's model): library <- teaching floor <- kvlab/built <-
per-notebook lessons.

- ``kvlab/built/*.py`` (what the notebooks write) imports the library and the teaching floor only,
  never a per-notebook lessons module (``kvlab.lessons.nb05_table36``, ``solutions``, ...);
- the teaching floor (``FLOOR``) imports neither ``kvlab.built`` nor a per-notebook lessons module;
- a built module imports no private (``_name``) from another built module: what a later notebook
  needs is public.

Every import counts, also one inside a function: a lazy import is still an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILT = ROOT / "kvlab" / "built"
LESSONS = ROOT / "kvlab" / "lessons"
FLOOR = {"passphrase", "traces", "workloads", "timing", "common", "build"}


def imported(path: Path, root: Path = ROOT) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every import in ``path``; ``name`` None for ``import x``.

    ``from kvlab.lessons import nb05_table36`` gives ``("kvlab.lessons.nb05_table36", None)``, so a
    lessons module imported either way reads the same; ``from kvlab.lessons.common import verdict``
    gives ``("kvlab.lessons.common", "verdict")``. Relative imports are resolved against the package
    of ``path``.
    """
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                if base in ("kvlab.lessons", "kvlab.built"):
                    out.append((f"{base}.{a.name}", None))
                else:
                    out.append((base, a.name))
    return out


def lessons_module(module: str) -> str | None:
    """``kvlab.lessons.nb05_table36.x`` -> ``nb05_table36``; None outside kvlab.lessons."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvlab", "lessons"] else None


def built_modules() -> list[Path]:
    return sorted(p for p in BUILT.glob("nb*.py"))


def test_the_helper_reads_every_form_of_import(tmp_path):
    pkg = tmp_path / "kvlab" / "lessons"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from kvlab.lessons import nb05_table36 as T\nimport kvlab.lessons.rope\n"
                 "def f():\n    from kvlab.built.nb04 import _twins\n    from . import solutions\n")
    got = imported(f, root=tmp_path)
    assert ("kvlab.lessons.nb05_table36", None) in got and ("kvlab.lessons.rope", None) in got
    assert ("kvlab.built.nb04", "_twins") in got and ("kvlab.lessons.solutions", None) in got


def test_the_floor_exists():
    missing = sorted(m for m in FLOOR if not (LESSONS / f"{m}.py").is_file())
    assert not missing, f"teaching floor modules missing: {missing}"


@pytest.mark.parametrize("path", built_modules(), ids=lambda p: p.name)
def test_built_imports_only_the_floor_of_lessons(path):
    above = sorted({m for m, _ in imported(path) if (x := lessons_module(m)) and x not in FLOOR})
    assert not above, (
        f"kvlab/built/{path.name} imports per-notebook lessons {above}: "
        "built sits below them; move what "
        f"it needs into the notebook's export cells or the teaching floor {sorted(FLOOR)}"
    )


@pytest.mark.parametrize("name", sorted(FLOOR))
def test_the_floor_imports_neither_built_nor_per_notebook_lessons(name):
    path = LESSONS / f"{name}.py"
    edges = sorted(
        {
            m
            for m, _ in imported(path)
            if m.startswith("kvlab.built") or ((x := lessons_module(m)) and x not in FLOOR)
        }
    )
    assert not edges, (
        f"the teaching floor's {name}.py imports {edges}: the floor sits below kvlab/built"
    )


@pytest.mark.parametrize("path", built_modules(), ids=lambda p: p.name)
def test_built_modules_share_only_public_names(path):
    private = sorted(
        {
            f"{m}.{n}"
            for m, n in imported(path)
            if m.startswith("kvlab.built") and n and n.startswith("_")
        }
    )
    assert not private, (
        f"kvlab/built/{path.name} imports private names {private}: "
        "make them public in their notebook"
    )
