"""The HTML handout reads with no CJK system font: the page embeds the CJK subset, and Chromium draws with it (issue 40)."""

import base64
import html
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import check_handout_fonts  # noqa: E402
import make_cjk_font  # noqa: E402
import run_notebooks  # noqa: E402

TITLE = "Tiny · 口令实验 (a [test](https://example.org) page)"
PROMPT = "你是一个专业的翻译助手，请将以下内容翻译成英文：「今天天气很好。」"


def _tiny_executed(folder: Path, extra_markdown: str = "") -> Path:
    """An 'executed' notebook: Chinese in a heading, markdown, a printed output and an HTML table."""
    import nbformat

    v4 = nbformat.v4
    table = f"<table><tr><th>prefix</th><th>输出</th></tr><tr><td>identical (完全相同)</td><td>{PROMPT}</td></tr></table>"
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell(f"# {TITLE}\n\nThe article's prompt: 口令是什么？{extra_markdown}\n\n## 二、实验"),
        v4.new_code_cell("print(PROMPT)", outputs=[v4.new_output("stream", name="stdout", text=PROMPT + "\n")]),
        v4.new_code_cell("table", outputs=[v4.new_output("display_data", data={"text/html": table, "text/plain": "t"})]),
    ])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "00_tiny.ipynb"
    nbformat.write(nb, path)
    return path


def _embedded_font(body: str):
    from fontTools.ttLib import TTFont

    data = re.search(r"url\(data:font/woff;base64,([A-Za-z0-9+/=]+)\) format\('woff'\)", body)
    assert data, "no embedded WOFF data URL"
    return TTFont(io.BytesIO(base64.b64decode(data.group(1))))


def test_the_page_embeds_the_cjk_subset_of_its_own_characters_and_is_titled_by_its_heading(tmp_path):
    body = run_notebooks.to_html(_tiny_executed(tmp_path)).read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", body, re.S).group(1)
    assert html.unescape(title) == "Tiny · 口令实验 (a test page)", title  # the heading, without its markdown
    assert "<title>Notebook</title>" not in body
    assert "@font-face" in body and f"font-family: '{make_cjk_font.FAMILY}'" in body
    assert "unicode-range: U+2E80-9FFF" in body  # only CJK code points: Latin text keeps the theme's fonts
    for var in ("--jp-content-font-family", "--jp-ui-font-family", "--jp-code-font-family-default"):
        assert re.search(rf"{var}: '{make_cjk_font.FAMILY}', \S", body), f"{var} does not start with the CJK face"
    assert "SIL Open Font License" in body and "OFL.txt" in body  # the licence travels with the page
    assert "<!-- kvlab: CJK font -->" not in body
    page_chars = {c for c in TITLE + PROMPT + "口令是什么？输出完全相同二、实验" if make_cjk_font.is_cjk(c)}
    cmap = _embedded_font(body).getBestCmap()
    assert {chr(c) for c in cmap} == page_chars  # just the page's characters: a few KiB, not the whole subset
    assert "kvlab CJK Sans" in _embedded_font(body)["name"].getDebugName(1)


def test_a_page_without_cjk_text_embeds_no_font(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 04 · Blocks\n\nNo Chinese here.")])
    nbformat.write(nb, tmp_path / "04_x.ipynb")
    body = run_notebooks.to_html(tmp_path / "04_x.ipynb").read_text(encoding="utf-8")
    assert "@font-face" not in body and "<title>04 · Blocks</title>" in body


def test_characters_the_shipped_font_lacks_are_named_on_stderr(tmp_path, capsys):
    from fontTools.ttLib import TTFont

    lacking = "龘"  # not in the series: not in the subset
    assert ord(lacking) not in TTFont(str(make_cjk_font.OUT)).getBestCmap()
    run_notebooks.to_html(_tiny_executed(tmp_path, f" {lacking}"))
    assert lacking in capsys.readouterr().err


def test_check_counts_the_executed_copies_outputs(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "x", outputs=[nbformat.v4.new_output("stream", name="stdout", text="龘\n")])])
    nbformat.write(nb, tmp_path / "00_x.ipynb")
    assert "龘" in make_cjk_font.missing([tmp_path])
    assert "龘" not in make_cjk_font.missing([tmp_path / "absent"])


_browser, _driver, WHY_NOT = check_handout_fonts.find_tools()


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no browser check: {WHY_NOT}")
def test_chromium_draws_every_cjk_character_with_the_embedded_face_and_catches_a_fallback(tmp_path):
    """Headless Chromium, offline, system CJK fonts hidden: the page passes; without its font, or with a
    character the font lacks (drawn as a box), it fails and names the characters."""
    page = run_notebooks.to_html(_tiny_executed(tmp_path / "ok"))
    no_face = tmp_path / "no_face.html"
    no_face.write_text(re.sub(r"@font-face \{.*?\}\n", "", page.read_text(encoding="utf-8"), flags=re.S),
                       encoding="utf-8")
    boxed = run_notebooks.to_html(_tiny_executed(tmp_path / "boxed", " 龘"))  # 龘: not in the subset
    ok, bare, box = check_handout_fonts.check([page, no_face, boxed])
    assert ok["cjk_chars"] >= 30 and ok["groups"] >= 2 and ok["problems"] == [], ok
    assert ok["face"] == ["loaded"]
    assert any("no loaded" in p for p in bare["problems"]) and any("drawn by a fallback" in p for p in bare["problems"])
    assert box["problems"] and "龘 by no font: a box" in box["problems"][-1], box
    assert "口" not in box["problems"][-1]
