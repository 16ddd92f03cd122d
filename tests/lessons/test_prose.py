"""The workshop path's prose: counted by scripts/prose_words.py and held under its limit."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import prose_words  # noqa: E402


def test_words_are_counted_with_cjk_characters_as_words():
    assert prose_words.count_words("the KV cache, `len(prefix)` | → ·") == 4
    assert prose_words.count_words("位置编码 (RoPE位置)") == 4 + 3


def test_details_and_code_fences_are_not_page_prose():
    page, hidden = prose_words.split_prose(
        "one two\n<details><summary>more</summary>three four</details>\n```python\nx = 1\n```\nfive"
    )
    assert prose_words.count_words(page) == 3
    assert "three four" in hidden


def test_the_path_comes_from_the_workshop_doc():
    keys = prose_words.path_keys()
    assert {"00", "01", "02", "03", "04", "05", "07"} <= set(keys), keys


def test_path_prose_is_within_the_limit():
    rows = prose_words.count_path()
    total = sum(r["prose"] for r in rows)
    assert total <= prose_words.LIMIT, (
        f"path prose {total} words > {prose_words.LIMIT}: "
        + ", ".join(f"{r['notebook'][:3]} {r['prose']}" for r in rows)
    )


def test_the_workshop_table_lists_every_path_stub_with_minutes_within_150():
    problems = prose_words.budget_problems()
    assert not problems, "docs/workshop.md's path table: " + "; ".join(problems)
    rows = prose_words.path_rows()
    assert rows[-1]["end"] <= 150 and sum(len(r["stubs"]) for r in rows) >= 10


def test_the_budget_check_catches_gaps_overruns_and_unlisted_stubs(tmp_path):
    doc = tmp_path / "workshop.md"
    doc.write_text("## The path\n\n| min | notebook | what | checks | ex |\n|---|---|---|---|---|\n"
                   "| 0–10 | **01** attention | §1 read | x | |\n"
                   "| 12–20 | **01** | §3 build `my_decode_step` and build `my_nothing` | x | |\n"
                   "| 20–151 | wrap-up | | | |\n\n## Next\n", encoding="utf-8")
    problems = "\n".join(prose_words.budget_problems(doc))
    assert "minute 10 is followed by a row starting at 12" in problems
    assert "more than 150" in problems and "no break" in problems
    assert "my_decode_step, my_nothing: no minutes" in problems
    assert "the table lists my_nothing, the notebook has no such stub" in problems
    stubs = prose_words.notebook_stubs(prose_words.notebook_for("01"))
    assert "my_decode_step" in stubs
    missing = [s for s in stubs if s != "my_decode_step"]
    assert all(f"01: stub {s} is not in the path table" in problems for s in missing)
