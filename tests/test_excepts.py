"""Every broad ``except`` in kvlab either re-raises or says why it may swallow the error (issue 37).

Broad: a bare ``except:``, ``except Exception`` or ``except BaseException`` (alone or in a tuple).
Said why: a comment on the ``except`` line, on comment lines just above it or at the start of its
body, that is more than a lint code (``# noqa: BLE001`` alone names no reason). Re-raises: a
``raise`` statement directly in the handler's body.
"""

import ast
import re
from pathlib import Path

import kvlab

PKG = Path(kvlab.__file__).resolve().parent
BROAD = {"Exception", "BaseException"}


def _names(node: ast.expr | None) -> set[str]:
    if node is None:
        return {"(bare)"}
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts))
    return {node.id} if isinstance(node, ast.Name) else set()


def _reason(line: str) -> bool:
    comment = line.partition("#")[2]
    comment = re.sub(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?", "", comment).strip(" -:")
    return len(comment.split()) >= 2


def unexplained_broad_excepts(root: Path = PKG) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.ExceptHandler):
                continue
            names = _names(node.type)
            if not names & (BROAD | {"(bare)"}):
                continue
            if any(isinstance(s, ast.Raise) for s in node.body):
                continue
            here, first = lines[node.lineno - 1], lines[node.body[0].lineno - 1]
            between = lines[node.lineno : node.body[0].lineno - 1]  # comment lines above the body
            above = []
            for ln in reversed(lines[: node.lineno - 1]):
                if not ln.strip().startswith("#"):
                    break
                above.append(ln)
            if any(_reason(ln) for ln in (here, first, *between, *above)):
                continue
            out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {here.strip()}")
    return out


def test_the_check_finds_a_silent_broad_except(tmp_path):
    (tmp_path / "a.py").write_text(
        "try:\n    f()\nexcept Exception:  # noqa: BLE001\n    pass\n"
        "try:\n    f()\nexcept (ValueError, BaseException):\n    x = 1\n"
        "try:\n    f()\nexcept Exception:  # a missing file is a miss here\n    pass\n"
        "try:\n    f()\nexcept BaseException:\n    g()\n    raise\n"
        "try:\n    f()\n# the caller gets None for a record that does not render\n"
        "except Exception:\n    pass\n"
        "try:\n    f()\nexcept ValueError:\n    pass\n"
    )
    found = unexplained_broad_excepts(tmp_path)
    assert [f.split(":")[1] for f in found] == ["3", "7"], found


def test_every_broad_except_in_kvlab_reraises_or_says_why():
    assert unexplained_broad_excepts() == []
