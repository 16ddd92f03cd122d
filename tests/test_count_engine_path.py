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


@pytest.fixture(scope="module")
def measured():
    return C.measure()


@pytest.mark.timeout(120)
def test_one_generate_is_profiled(measured):
    m = measured
    assert "kvlab/engine/engine.py:Engine.step" in m["functions"]
    assert "kvlab/cache/block_manager.py:BlockManager.allocate" in m["functions"]
    # every counted file is one the call entered (or a base class's), and none is also listed as
    # imported but not run
    assert set(m["files"]) >= {f.split(":")[0] for f in m["functions"]}
    assert not set(m["files"]) & set(m["imported_not_run"])
    assert m["num_files"] == len(m["files"]) and m["code_lines"] == sum(m["files"].values())


# what the teaching path measured when this ceiling was set (issue 51: 73 functions, 15 files,
# 2,026 code lines; the goals, 45 / 14 / 1,600, are not met). The path may shrink; it may not grow
# unnoticed: a change that adds to it raises the ceiling here and says why in its commit. The lines
# leave room for a small fix.
CEILING = {"num_functions": 73, "num_files": 15, "code_lines": 2050}


def test_the_teaching_path_does_not_grow_past_its_ceiling(measured):
    m = measured
    grew = {k: (m[k], v) for k, v in CEILING.items() if m[k] > v}
    assert not grew, (
        f"one Engine.generate now reaches past the ceiling (measured, ceiling): {grew}; "
        f"functions entered: {m['functions']}"
    )
