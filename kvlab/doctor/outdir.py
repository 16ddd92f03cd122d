"""Where the doctor writes its report, made safe: it never writes over any file (rules in
docs/doctor.md)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

MANIFEST = "kvlab_doctor_manifest.json"
OUTPUT_NAME = re.compile(r"(report\.html|summary\.json|(hit_rates|divergence|fixes)\.png"
                         r"|fixed/(all_fixes|\d{2}_[a-z0-9-]+)\.jsonl)")
LEGACY_KEYS = {"source", "model", "malformed", "table"}  # a summary.json written by the doctor


class OutDirError(ValueError):
    """``--out`` cannot be used: what is wrong and what to do instead."""


def _files(out: Path) -> list[str]:
    """Every entry under ``out`` (relative, '/'-separated; folders end with '/'), symlinks not
    followed."""
    names = []
    for root, dirs, files in os.walk(out):
        rel = Path(root).relative_to(out)
        names += [(rel / d).as_posix() + "/" for d in dirs] + [(rel / f).as_posix() for f in files]
    return names


def _manifest(out: Path) -> list[str] | None:
    """The files the manifest lists (checked against ``OUTPUT_NAME``); None when there is no
    manifest."""
    m = out / MANIFEST
    if not m.exists() and not m.is_symlink():
        return None
    if m.is_symlink() or not m.is_file():
        raise OutDirError(f"--out {out}: {MANIFEST} is not a plain file")
    try:
        listed = json.loads(m.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OutDirError(
            f"--out {out}: unreadable {MANIFEST} ({e}): delete the folder or choose another"
        ) from e
    if not isinstance(listed, list) or not all(
        isinstance(f, str) and OUTPUT_NAME.fullmatch(f) for f in listed
    ):
        raise OutDirError(
            f"--out {out}: {MANIFEST} lists files the doctor never writes: delete the folder "
            "or choose another"
        )
    return listed


def _legacy(out: Path, names: list[str]) -> list[str] | None:
    """The files of a report an earlier kvlab wrote (no manifest): only doctor names, its
    summary.json."""
    files = [f for f in names if not f.endswith("/")]
    folders = [f for f in names if f.endswith("/")]  # none, or fixed/
    if (
        "summary.json" not in files
        or folders not in ([], ["fixed/"])
        or not all(map(OUTPUT_NAME.fullmatch, files))
    ):
        return None
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return files if isinstance(summary, dict) and LEGACY_KEYS <= summary.keys() else None


def check_out_dir(out: str | Path, inputs: Iterable[str | Path] = ()) -> list[str]:
    """Raise OutDirError if the doctor may not write its report to ``out``; return the earlier run's
    files to delete."""
    out = Path(out)
    parent = next((p for p in out.parents if p.exists()), None)
    held = next((p for p in inputs if Path(p).resolve().is_relative_to(out.resolve())), None)
    for wrong, why in (
        (out.is_symlink() and not out.exists(), " is a broken symlink"),
        (
            out.exists() and not out.is_dir(),
            " is a file, not a folder: give a folder for the report",
        ),
        (parent is not None and not parent.is_dir(), f": {parent} is a file, not a folder"),
        (
            held is not None,
            f" holds the input {held}: write the report to another folder "
            "(the doctor never writes where its input is)",
        ),
    ):
        if wrong:
            raise OutDirError(f"--out {out}{why}")
    if not out.exists():
        return []
    names = [f for f in _files(out) if f != MANIFEST]
    listed = _manifest(out)
    if listed is None and not names:
        return []
    listed = _legacy(out, names) if listed is None else listed
    if listed is None:
        raise OutDirError(
            f"--out {out} is a folder with files the doctor did not write (no {MANIFEST}): "
            "give a new or empty folder"
        )
    if (out / "fixed").is_symlink():
        raise OutDirError(
            f"--out {out}: fixed/ is a symlink; the doctor deletes nothing through one"
        )
    if folders := [f for f in listed if (out / f).is_dir() and not (out / f).is_symlink()]:
        raise OutDirError(
            f"--out {out}: {folders[0]} is a folder now; the doctor wrote a file there"
        )
    if clash := [f for f in names if f not in listed and OUTPUT_NAME.fullmatch(f.rstrip("/"))]:
        raise OutDirError(
            f"--out {out}: {clash[0]} was not written by the doctor but has the name of one of its "
            "files: move it or choose another folder"
        )
    return listed


def clear(out: Path, stale: list[str]) -> None:
    """Make ``out`` if new, delete the earlier run's files in it (symlinks themselves, never what
    they point to)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in stale:
        (out / f).unlink(missing_ok=True)
    fixed = out / "fixed"
    if fixed.is_dir() and not fixed.is_symlink() and not any(fixed.iterdir()):
        fixed.rmdir()


def write_manifest(out: Path) -> None:
    """Record the doctor's files under ``out`` (after ``clear``: this run's) by a rename, never
    through a path."""
    files = sorted(f for f in _files(out) if OUTPUT_NAME.fullmatch(f))
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"written_by": "kvlab.doctor", "files": files}, f, indent=1)
    os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the report's other files are readable too
    os.replace(tmp, out / MANIFEST)
