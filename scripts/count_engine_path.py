"""Measure the teaching path (issue 51): the kvlab functions one ``Engine.generate`` enters, and
their files.

    .venv/bin/python scripts/count_engine_path.py                  # one row a file
    .venv/bin/python scripts/count_engine_path.py --json out.json

Everything is counted from a profile, not from a list of files: ``sys.setprofile`` over one
``Engine.generate`` of two prompts (8 new tokens each, greedy) on the bundled model, default
``EngineConfig`` (the teaching path: no speed path), after a warm-up call on the same engine.

- **functions**: distinct ``(file, qualified name)`` entered under ``kvlab/`` (comprehensions and
  generator expressions are left out: Python 3.11 gives them code objects of their own, 3.12 inlines
  most);
- **files**: the files of those functions, plus the files that define a base class of an object
  whose method was entered (a reader of a class reads its bases: a mixin is part of the path even
  when none of its own methods ran);
- **code lines**: of those files, whole, without blank lines, comments and docstrings (issue 37's
  measure).

Goals (issue 51): <= 45 functions, <= 14 files, <= 1,600 code lines.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOALS = {"functions": 45, "files": 14, "code_lines": 1600}
INLINE = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>")


def code_lines(source: str) -> int:
    """Lines of ``source`` that are not blank, not a comment and not inside a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for i, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#") and i not in docstrings
    )


def profile_generate(max_tokens: int = 8) -> tuple[set[str], set[str]]:
    """``(functions, base-class files)`` that one ``Engine.generate`` enters, relative to the
    repository."""
    import torch

    from kvlab.engine import Engine, SamplingParams
    from kvlab.engine.models import load_model

    torch.manual_seed(0)
    model, tok = load_model(device="cpu")
    engine = Engine(model, tok, num_blocks=64)
    prompts = ["The passphrase is", "Once upon a time"]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # warm-up: lazy imports and first-call set-up are not the path
    engine.generate(prompts, sp)
    kvlab = str(ROOT / "kvlab")
    functions: set[str] = set()
    classes: set[type] = set()

    def profiler(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(kvlab):
            return
        name = getattr(code, "co_qualname", code.co_name)
        if name.endswith(INLINE):
            return
        rel = Path(code.co_filename).relative_to(ROOT)
        functions.add(f"{rel}:{name}")
        if code.co_argcount:
            first = frame.f_locals.get(code.co_varnames[0])
            if code.co_varnames[0] in ("self", "cls") and first is not None:
                classes.add(first if isinstance(first, type) else type(first))

    sys.setprofile(profiler)
    try:
        engine.generate(prompts, sp)
    finally:
        sys.setprofile(None)
    bases = set()
    for cls in classes:
        for base in cls.__mro__:
            try:
                path = Path(inspect.getsourcefile(base) or "")
            except TypeError:
                continue
            if str(path).startswith(kvlab):
                bases.add(str(path.relative_to(ROOT)))
    return functions, bases


def kvlab_imports(rel: str) -> set[str]:
    """The kvlab modules (files, relative to the repository) that file ``rel`` imports, at any
    depth of its code (lazy imports too)."""
    path = ROOT / rel
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = node.module.split(".") if node.module else []
        elif (node.module or "").startswith("kvlab"):
            base, parts = ROOT, node.module.split(".")
        else:
            continue
        for name in [None] + [a.name for a in node.names]:
            target = base.joinpath(*parts, *([name] if name else []))
            for cand in (target.with_suffix(".py"), target / "__init__.py"):
                if cand.is_file() and cand != path:
                    found.add(str(cand.relative_to(ROOT)))
    return found


def measure() -> dict:
    """Functions, files (with their code lines) and totals of the profiled ``generate``; beside
    them, the kvlab modules those files import whose code the call does not run (data classes,
    errors, constants, the branches of other requests)."""
    functions, bases = profile_generate()
    files = sorted({f.split(":")[0] for f in functions} | bases)
    lines = {rel: code_lines((ROOT / rel).read_text()) for rel in files}
    imported = sorted(set().union(*map(kvlab_imports, files)) - set(files))
    return {
        "functions": sorted(functions),
        "files": lines,
        "num_functions": len(functions),
        "num_files": len(files),
        "code_lines": sum(lines.values()),
        "imported_not_run": {rel: code_lines((ROOT / rel).read_text()) for rel in imported},
        "goals": GOALS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the measurement as JSON to this path")
    args = ap.parse_args()
    print("profiling one Engine.generate on the bundled model (about 10 s) ...", flush=True)
    m = measure()
    by_file: dict[str, list[str]] = {}
    for f in m["functions"]:
        rel, name = f.split(":")
        by_file.setdefault(rel, []).append(name)
    print("  code  funcs  file (functions entered)")
    for rel, n in m["files"].items():
        names = by_file.get(rel, [])
        shown = ", ".join(names) if names else "(a base class only)"
        print(f"{n:6d} {len(names):6d}  {rel}: {shown}")
    verdict = {
        k: "met" if m[k2] <= v else "NOT met"
        for (k, v), k2 in zip(GOALS.items(), ("num_functions", "num_files", "code_lines"))
    }
    print(
        f"\none Engine.generate enters {m['num_functions']} kvlab functions (goal <= "
        f"{GOALS['functions']}: "
        f"{verdict['functions']}) in {m['num_files']} files (goal <= {GOALS['files']}: "
        f"{verdict['files']}) "
        f"holding {m['code_lines']:,} code lines (goal <= {GOALS['code_lines']:,}: "
        f"{verdict['code_lines']})"
    )
    other = m["imported_not_run"]
    print(
        f"not counted: {len(other)} kvlab modules those files import, none of whose code this call "
        f"runs ({sum(other.values()):,} code lines): " + ", ".join(other)
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(m, indent=1))


if __name__ == "__main__":
    main()
