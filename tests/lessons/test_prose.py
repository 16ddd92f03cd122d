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
    page, hidden = prose_words.split_prose("one two\n<details><summary>more</summary>three four</details>\n"
                                           "```python\nx = 1\n```\nfive")
    assert prose_words.count_words(page) == 3
    assert "three four" in hidden


def test_the_path_comes_from_the_workshop_doc():
    keys = prose_words.path_keys()
    assert {"00", "01", "02", "03", "04", "05", "07"} <= set(keys), keys


def test_path_prose_is_within_the_limit():
    rows = prose_words.count_path()
    total = sum(r["prose"] for r in rows)
    assert total <= prose_words.LIMIT, f"path prose {total} words > {prose_words.LIMIT}: " + ", ".join(
        f"{r['notebook'][:3]} {r['prose']}" for r in rows)
