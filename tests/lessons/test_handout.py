"""The HTML handout reads with no CJK system font: the page embeds the CJK subset, and Chromium
draws with it (issue 40)."""

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
    """An 'executed' notebook: Chinese in a heading, markdown, a printed output and an HTML
    table."""
    import nbformat

    v4 = nbformat.v4
    table = (
        "<table><tr><th>prefix</th><th>输出</th></tr>"
        f"<tr><td>identical (完全相同)</td><td>{PROMPT}</td></tr></table>"
    )
    nb = v4.new_notebook(
        cells=[
            v4.new_markdown_cell(
                f"# {TITLE}\n\nThe article's prompt: 口令是什么？{extra_markdown}\n\n## 二、实验"
            ),
            v4.new_code_cell(
                "print(PROMPT)",
                outputs=[v4.new_output("stream", name="stdout", text=PROMPT + "\n")],
            ),
            v4.new_code_cell(
                "table",
                outputs=[
                    v4.new_output("display_data", data={"text/html": table, "text/plain": "t"})
                ],
            ),
        ]
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "00_tiny.ipynb"
    nbformat.write(nb, path)
    return path


def _embedded_font(body: str):
    from fontTools.ttLib import TTFont

    data = re.search(r"url\(data:font/woff;base64,([A-Za-z0-9+/=]+)\) format\('woff'\)", body)
    assert data, "no embedded WOFF data URL"
    return TTFont(io.BytesIO(base64.b64decode(data.group(1))))


def test_the_page_embeds_the_cjk_subset_of_its_own_characters_and_is_titled_by_its_heading(
    tmp_path,
):
    body = run_notebooks.to_html(_tiny_executed(tmp_path)).read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", body, re.S).group(1)
    # the heading, without its markdown
    assert html.unescape(title) == "Tiny · 口令实验 (a test page)", title
    assert "<title>Notebook</title>" not in body
    assert "@font-face" in body and f"font-family: '{make_cjk_font.FAMILY}'" in body
    # only CJK code points: Latin text keeps the theme's fonts
    assert "unicode-range: U+2E80-9FFF" in body
    for var in ("--jp-content-font-family", "--jp-ui-font-family", "--jp-code-font-family-default"):
        assert re.search(rf"{var}: '{make_cjk_font.FAMILY}', \S", body), (
            f"{var} does not start with the CJK face"
        )
    # the licence travels with the page
    assert "SIL Open Font License" in body and "OFL.txt" in body
    assert "<!-- kvlab: CJK font -->" not in body
    page_chars = {
        c for c in TITLE + PROMPT + "口令是什么？输出完全相同二、实验" if make_cjk_font.is_cjk(c)
    }
    cmap = _embedded_font(body).getBestCmap()
    # just the page's characters: a few KiB, not the whole subset
    assert {chr(c) for c in cmap} == page_chars
    assert "kvlab CJK Sans" in _embedded_font(body)["name"].getDebugName(1)


def test_a_page_without_cjk_text_embeds_no_font(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_markdown_cell("# 04 · Blocks\n\nNo Chinese here.")]
    )
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
    """Headless Chromium, offline, system CJK fonts hidden: the page passes; without its font, or
    with a character the font lacks (drawn as a box), it fails and names the characters."""
    page = run_notebooks.to_html(_tiny_executed(tmp_path / "ok"))
    no_face = tmp_path / "no_face.html"
    no_face.write_text(
        re.sub(r"@font-face \{.*?\}\n", "", page.read_text(encoding="utf-8"), flags=re.S),
        encoding="utf-8",
    )
    boxed = run_notebooks.to_html(
        _tiny_executed(tmp_path / "boxed", " 龘")
    )  # 龘: not in the subset
    ok, bare, box = check_handout_fonts.check([page, no_face, boxed])
    assert ok["cjk_chars"] >= 30 and ok["groups"] >= 2 and ok["problems"] == [], ok
    assert ok["face"] == ["loaded"]
    assert any("no loaded" in p for p in bare["problems"]) and any(
        "drawn by a fallback" in p for p in bare["problems"]
    )
    assert box["problems"] and "龘 by no font: a box" in box["problems"][-1], box
    assert "口" not in box["problems"][-1]


def test_the_page_leaves_out_papermills_injected_parameters_cell(tmp_path):
    import nbformat

    path = _tiny_executed(tmp_path)
    nb = nbformat.read(path, as_version=4)
    injected = nbformat.v4.new_code_cell("# Parameters\nSMOKE = True\nKVLAB_INJECTED = 1\n")
    injected.metadata["tags"] = ["injected-parameters"]
    kept = nbformat.v4.new_code_cell("SMOKE = False  # parameters\nKVLAB_OWN = 1\n")
    kept.metadata["tags"] = ["parameters"]
    nb.cells[1:1] = [kept, injected]
    nbformat.write(nb, path)
    body = run_notebooks.to_html(path).read_text(encoding="utf-8")
    assert "KVLAB_OWN" in body and "KVLAB_INJECTED" not in body
    # the executed copy itself keeps it
    assert "injected-parameters" in path.read_text(encoding="utf-8")


def test_the_index_lists_titles_linked_to_pages_and_styled(tmp_path):
    path = _tiny_executed(tmp_path)
    rows = [
        {
            "notebook": "00_tiny.ipynb",
            "status": "ok",
            "wall_s": 1.5,
            "peak_mem_mb": 10,
            "error": "",
            "output": str(path),
        },
        {
            "notebook": "01_qkv_and_kv_cache.ipynb",
            "status": "error",
            "wall_s": 2.0,
            "peak_mem_mb": 10,
            "error": "CellTimeoutError",
        },
    ]
    run_notebooks.write_report(rows, tmp_path)
    body = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert f"<a href='00_tiny.html'>{html.escape('Tiny · 口令实验 (a test page)')}</a>" in body
    # a failed notebook: its title, no link
    assert "01 · " in body and "01_qkv_and_kv_cache.html" not in body
    assert "<style>" in body and "@font-face" in body and "border-collapse" in body


def test_lab_css_puts_the_shipped_face_first_and_make_lab_serves_it(tmp_path):
    css = run_notebooks.lab_css(tmp_path / "custom").read_text(encoding="utf-8")
    font = tmp_path / "custom" / make_cjk_font.OUT.name
    assert (
        font.read_bytes() == make_cjk_font.OUT.read_bytes()
        and (tmp_path / "custom" / "OFL.txt").is_file()
    )
    assert f"font-family: '{make_cjk_font.FAMILY}'" in css and f"url('{font.name}')" in css
    assert "unicode-range: U+2E80-9FFF" in css  # CJK only: Latin keeps the theme's fonts
    for var in ("--jp-content-font-family", "--jp-ui-font-family", "--jp-code-font-family-default"):
        assert re.search(rf":root:root \{{[^}}]*{var}: '{make_cjk_font.FAMILY}', \S", css), var
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    lab = make[make.index("\nlab:"):].split("\n\n")[0]
    assert (
        "JUPYTER_CONFIG_DIR=$(CURDIR)/.venv/etc/jupyter" in lab
        and "--LabApp.custom_css=True" in lab
    )
    assert (
        'run_notebooks.py --lab-css "$VENV/etc/jupyter/custom"'
        in (ROOT / "scripts/setup.sh").read_text()
    )


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no browser check: {WHY_NOT}")
def test_jupyterlab_draws_notebook_00s_chinese_with_the_shipped_font_and_no_box(tmp_path):
    """`make lab`'s set-up, in a JupyterLab on 127.0.0.1, system CJK fonts hidden from Chromium:
    notebook 00's Chinese (title, markdown, code) is drawn by the shipped face, no character is a
    box; the same server without the custom CSS fails the same check (so the check can fail)."""
    config = tmp_path / "jupyter"
    run_notebooks.lab_css(config / "custom")
    nb = "notebooks/00_passphrase_experiment.ipynb"
    ok = check_handout_fonts.check_lab(nb, ROOT, config)
    assert ok["cjk_chars"] >= 10 and ok["problems"] == [], ok
    assert ok["face"] and "loaded" in ok["face"]
    bare = check_handout_fonts.check_lab(nb, ROOT, config, custom_css=False)
    assert bare["cjk_chars"] >= 10 and any(
        "box" in p or "fallback" in p or "no loaded" in p for p in bare["problems"]
    )
