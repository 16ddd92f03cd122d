"""scripts/count_engine_path.py (issue 51's ruler): its line count, its import reader and one
profiled ``generate``."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import count_engine_path as C  # noqa: E402


def test_code_lines_skip_blanks_comments_and_docstrings():
    src = (
        '"""Module doc\nover two lines."""\n\n# a comment\nx = 1\n\n\n'
        'def f():\n    """Doc."""\n    return x\n'
    )
    assert C.code_lines(src) == 3


def test_imports_are_read_relative_absolute_and_lazy():
    found = C.kvlab_imports("kvlab/engine/scheduler.py")
    # from ..cache.block_manager import cdiv; from .scheduler_output import ...; .sequence
    assert {"kvlab/cache/block_manager.py", "kvlab/engine/scheduler_output.py",
            "kvlab/engine/sequence.py"} <= found
    assert "kvlab/engine/scheduler.py" not in found


@pytest.mark.timeout(120)
def test_one_generate_is_profiled():
    m = C.measure()
    assert "kvlab/engine/engine.py:Engine.step" in m["functions"]
    assert "kvlab/cache/block_manager.py:BlockManager.allocate" in m["functions"]
    # every counted file is one the call entered (or a base class's), and none is also listed as
    # imported but not run
    assert set(m["files"]) >= {f.split(":")[0] for f in m["functions"]}
    assert not set(m["files"]) & set(m["imported_not_run"])
    assert m["num_files"] == len(m["files"]) and m["code_lines"] == sum(m["files"].values())
