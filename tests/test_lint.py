"""The repository's lint is part of the tests: ``ruff check`` (E501 at 100 columns included, no
per-file exceptions) on every Python path the project ships or runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["kvlab", "scripts", "tests", "data"]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in .[dev]")
def test_ruff_check_passes_on_every_python_path():
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_line_length_rule_has_no_exceptions():
    """E501 is selected, at 100 columns, and no path switches it off."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert config["line-length"] == 100
    assert "E" in config["lint"]["select"] and "E501" not in config["lint"].get("ignore", [])
    ignored = {p: r for p, r in config["lint"].get("per-file-ignores", {}).items() if "E501" in r}
    assert ignored == {}, f"E501 switched off for {sorted(ignored)}"
