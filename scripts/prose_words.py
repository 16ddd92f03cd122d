"""Count the markdown prose a participant reads on the workshop path, per notebook and in total.

    python scripts/prose_words.py [--all] [--outputs build/notebooks] [--limit 8000]

Which notebooks are on the path: the bold notebook numbers (``**03**``) in the table under
"## The path" of ``docs/workshop.md``. What counts:

- markdown cells only; code cells, and fenced code blocks inside markdown, are not prose;
- a word is a whitespace-separated token holding a letter or digit (table rules, ``|``, ``·`` and
  ``→`` alone do not count); inline code such as ``len(prefix)`` counts as one word;
- CJK: each Han, kana or Hangul character counts as one word (the usual count for Chinese text),
  and the non-CJK rest of a token counts once more if it holds a letter or digit, so ``位置编码``
  is 4 words and ``(RoPE位置)`` is 3;
- text inside ``<details>`` blocks is collapsed on the page: it is counted apart ("details") and is
  not part of the limit, which is about what a participant reads in class.

``--outputs DIR`` also counts the words of printed output (streams and plain-text results, not
images or HTML) in the executed copies found in DIR. It also checks the path table's minutes: rows
from 0 to at most 150 with a break, and every build stub (``def my_…`` raising
``NotImplementedError``) of a path notebook named in a row of its notebook ("build `my_…`") with
its minutes. Exit code 1 when the path's prose exceeds ``--limit`` or the table does not add up.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WORKSHOP = ROOT / "docs" / "workshop.md"
LIMIT = 8000

CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
WORDLIKE = re.compile(r"[^\W_]")  # a letter or digit, any script
DETAILS = re.compile(r"<details\b.*?</details>", re.S | re.I)
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)


def count_words(text: str) -> int:
    """Words in ``text``: tokens with a letter or digit; each CJK character is one word."""
    n = 0
    for token in text.split():
        cjk = len(CJK.findall(token))
        rest = CJK.sub("", token)
        n += cjk + (1 if WORDLIKE.search(rest) else 0)
    return n


def split_prose(markdown: str) -> tuple[str, str]:
    """(text on the page, text inside <details> blocks) of one markdown cell, code fences
    removed."""
    markdown = FENCE.sub(" ", markdown)
    details = " ".join(DETAILS.findall(markdown))
    return DETAILS.sub(" ", markdown), details


def notebook_prose(path: Path) -> dict:
    """Words of one notebook's markdown cells: on the page and inside <details>."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    page = details = 0
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        shown, hidden = split_prose(src)
        page += count_words(shown)
        details += count_words(re.sub(r"<[^>]+>", " ", hidden))
    return {"notebook": path.stem, "prose": page, "details": details}


def output_words(path: Path) -> int:
    """Words of printed output (streams, text/plain results without an image) in an executed
    notebook."""
    n = 0
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                n += count_words("".join(out.get("text", "")))
            elif "data" in out and "image/png" not in out["data"]:
                n += count_words("".join(out["data"].get("text/plain", "")))
    return n


def path_keys(workshop: Path = WORKSHOP) -> list[str]:
    """Notebook numbers in bold in the path table of the workshop doc, in order, e.g. ['00', '01',
    ...]."""
    text = workshop.read_text(encoding="utf-8")
    match = re.search(r"^## The path\b.*?(?=^## )", text, re.S | re.M)
    if not match:
        raise SystemExit(f"{workshop}: no '## The path' section")
    rows = [line for line in match.group(0).splitlines() if line.startswith("|")]
    keys = [k for line in rows for k in re.findall(r"\*\*(\d\d[a-z]?)\*\*", line)]
    if not keys:
        raise SystemExit(f"{workshop}: the path table names no notebook in bold (**03**)")
    return list(dict.fromkeys(keys))


def path_rows(workshop: Path = WORKSHOP) -> list[dict]:
    """The rows of the path table: ``start``, ``end`` (minutes), ``notebook`` (key, or 'break' /
    'wrap-up'; a row without one continues the notebook above), ``stubs`` (the ``my_…`` functions
    it builds) and ``ex`` minutes."""
    text = workshop.read_text(encoding="utf-8")
    match = re.search(r"^## The path\b.*?(?=^## )", text, re.S | re.M)
    if not match:
        raise SystemExit(f"{workshop}: no '## The path' section")
    rows, current = [], None
    for line in match.group(0).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        span = re.fullmatch(r"(\d+)[–-](\d+)", cells[0]) if line.startswith("|") else None
        if not span:
            continue
        key = re.search(r"\*\*(\d\d[a-z]?)\*\*", cells[1])
        current = key.group(1) if key else (cells[1].split()[0] if cells[1] else current)
        ex = cells[-1]
        rows.append(
            {
                "start": int(span.group(1)),
                "end": int(span.group(2)),
                "notebook": current,
                "stubs": re.findall(r"build `(my_\w+)`", cells[2]),
                "ex": int(ex) if ex.isdigit() else 0,
            }
        )
    return rows


def notebook_stubs(path: Path) -> list[str]:
    """The build stubs of a notebook: ``def my_…`` functions in code cells whose body raises
    NotImplementedError."""
    found = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code":
            continue
        for m in re.finditer(r"^def (my_\w+)\(.*?(?=^\S|\Z)", src, re.S | re.M):
            if "raise NotImplementedError" in m.group(0):
                found.append(m.group(1))
    return found


def budget_problems(workshop: Path = WORKSHOP) -> list[str]:
    """What is wrong with the path table's minutes and stubs (empty when nothing): the rows must
    run on from 0 without gaps to at most 150 minutes with a break, and list every path notebook's
    stubs, each with its minutes."""
    rows, problems = path_rows(workshop), []
    if not rows or rows[0]["start"] != 0:
        problems.append("the path table does not start at minute 0")
    problems += [
        f"minute {a['end']} is followed by a row starting at {b['start']}"
        for a, b in zip(rows, rows[1:])
        if a["end"] != b["start"]
    ]
    problems += [
        f"row {r['start']}–{r['end']} ends before it starts" for r in rows if r["end"] <= r["start"]
    ]
    if rows and rows[-1]["end"] > 150:
        problems.append(f"the path takes {rows[-1]['end']} minutes, more than 150")
    if not any(r["notebook"] == "break" for r in rows):
        problems.append("no break in the path table")
    listed = {(r["notebook"], s) for r in rows for s in r["stubs"]}
    for r in rows:
        if r["stubs"] and r["ex"] <= 0:
            problems.append(f"{r['notebook']} {', '.join(r['stubs'])}: no minutes in the ex column")
    for key in path_keys(workshop):
        stubs = notebook_stubs(notebook_for(key))
        problems += [
            f"{key}: stub {s} is not in the path table" for s in stubs if (key, s) not in listed
        ]
        problems += [
            f"{key}: the table lists {s}, the notebook has no such stub"
            for k, s in sorted(listed)
            if k == key and s not in stubs
        ]
    return problems


def notebook_for(key: str) -> Path:
    """The notebook file whose name starts with ``key_``."""
    found = sorted(NOTEBOOKS.glob(f"{key}_*.ipynb"))
    if len(found) != 1:
        raise SystemExit(
            f"notebook {key}: expected one notebooks/{key}_*.ipynb, found {len(found)}"
        )
    return found[0]


def count_path(keys: list[str] | None = None) -> list[dict]:
    """One row per notebook on the path (or ``keys``): its prose and details words."""
    return [notebook_prose(notebook_for(k)) for k in (keys or path_keys())]


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 1 when the path's prose is over the limit."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true", help="also list the notebooks off the path")
    ap.add_argument(
        "--outputs", type=Path, help="folder of executed copies: count their printed output too"
    )
    ap.add_argument(
        "--limit", type=int, default=LIMIT, help=f"words of path prose allowed (default {LIMIT})"
    )
    args = ap.parse_args(argv)
    keys = path_keys()
    rows = count_path(keys)
    if args.all:
        on_path = {notebook_for(k).stem for k in keys}
        rows += [
            notebook_prose(p)
            for p in sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
            if p.stem not in on_path
        ]
    on = {notebook_for(k).stem for k in keys}
    print(
        f"{'notebook':42s} {'path':>4s} {'prose':>6s} {'details':>7s}"
        + (f" {'output':>7s}" if args.outputs else "")
    )
    for r in rows:
        line = (
            f"{r['notebook']:42s} {'yes' if r['notebook'] in on else '':>4s} {r['prose']:6d} "
            f"{r['details']:7d}"
        )
        if args.outputs:
            executed = args.outputs / f"{r['notebook']}.ipynb"
            line += f" {output_words(executed) if executed.exists() else '-':>7}"
        print(line)
    total = sum(r["prose"] for r in rows if r["notebook"] in on)
    hidden = sum(r["details"] for r in rows if r["notebook"] in on)
    print(
        f"path ({', '.join(keys)}): {total} words of prose (limit {args.limit}), {hidden} more in "
        "collapsed <details>"
    )
    rows = path_rows()
    stubs = [(r["notebook"], s, r["ex"]) for r in rows if r["stubs"] for s in r["stubs"][:1]]
    print(
        f"path table: {rows[-1]['end']} minutes, {sum(len(r['stubs']) for r in rows)} build stubs "
        f"in {sum(r['ex'] for r in rows)} exercise minutes: "
        + ", ".join(f"{k} {s} {m}" for k, s, m in stubs)
    )
    problems = budget_problems()
    for p in problems:
        print(f"workshop.md: {p}")
    return 0 if total <= args.limit and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
