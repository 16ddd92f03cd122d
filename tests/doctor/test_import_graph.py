"""kvlab.doctor has no import circle: every import in its modules (top level, in functions, under
TYPE_CHECKING) is an edge, and the graph is acyclic; and each module imports alone."""

import ast
import subprocess
import sys
from pathlib import Path

import kvlab.doctor

PKG = Path(kvlab.doctor.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in the file)."""
    files = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1]
                        + ([base] if base else [])
                    )
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            else:
                continue
            graph[mod].update(t for t in targets if t in files and t != mod)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_doctor_has_no_import_circle():
    graph = import_graph(PKG)
    assert "kvlab.doctor.report" in graph["kvlab.doctor.core"]  # the graph sees the imports
    # relative imports two levels up too
    assert "kvlab.doctor.prepare" in graph["kvlab.doctor.culprits.base"]
    assert find_cycle(graph) is None, find_cycle(graph)
    # the renderers read a dict, nothing else of the doctor
    assert graph["kvlab.doctor.report"] == set()


def test_each_doctor_module_imports_alone():
    mods = sorted(m for m in import_graph(PKG) if m != "kvlab.doctor.__main__")
    code = (
        "import importlib, subprocess, sys\n"
        "for m in sys.argv[1:]:\n"
        "    r = subprocess.run([sys.executable, '-c', f'import {m}'],"
        " capture_output=True, text=True)\n"
        "    print(m, r.returncode, r.stderr.strip().splitlines()[-1:] )\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *mods],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=PKG.parent.parent,
    ).stdout
    assert [line for line in out.splitlines() if " 0 " not in line] == [] and len(
        out.splitlines()
    ) == len(mods)
