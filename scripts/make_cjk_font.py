"""Make kvlab's CJK font: a subset of Noto Sans CJK SC holding only the glyphs the series draws.

    apt-get install -y fonts-noto-cjk        # the source font (SIL Open Font License 1.1)
    python scripts/make_cjk_font.py [--source PATH.ttc] [--check] [--executed DIR ...]

The glyphs are collected from every string the figures and the HTML handout can show: the notebooks'
sources, the executed copies' markdown and outputs (``build/notebooks/*.ipynb`` when present, and
any ``--executed DIR``), the lessons' modules and the notebooks' generated ones in ``kvlab/built``
(prompts, passphrases, the article's decision table) and every
piece the bundled tokenizer decodes to (token labels in notebooks 01 and 02). The subset goes to
``data/fonts/`` with its licence; ``kvlab.lessons.common`` registers it with matplotlib at import,
and ``scripts/run_notebooks.py`` embeds a per-page subset of it in each HTML page
(``font_face_css``). Run it again when a lesson gains new Chinese text; ``--check`` only lists
characters the shipped subset lacks (exit code 1 if any).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FONTS = ROOT / "data" / "fonts"
OUT = FONTS / "kvlab-cjk-sans.otf"
SOURCES = ("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",)
SOURCE_FAMILY = "Noto Sans CJK SC"
FAMILY = "kvlab CJK Sans"  # a modified version gets its own name (the OFL's condition 3)
EXECUTED = ROOT / "build" / "notebooks"  # the runner's executed copies, when a run has made them
# What DejaVu Sans (matplotlib's default) and DejaVu/Liberation (a browser's usual fonts on Linux)
# cannot draw: CJK radicals, symbols and punctuation, kana, the unified ideographs (with extension
# A), Hangul, the compatibility ideographs and forms, the full-width forms, and the supplementary
# ideograph planes.
CJK_RANGES = (
    (0x2E80, 0x9FFF),
    (0xAC00, 0xD7AF),
    (0xF900, 0xFAFF),
    (0xFE30, 0xFE4F),
    (0xFF00, 0xFFEF),
    (0x20000, 0x3FFFF),
)


def _subset(font, chars, flavor: str | None = None) -> None:
    """Cut ``font`` down to ``chars`` in place, keeping its layout features and every name record
    (the licence)."""
    from fontTools import subset

    options = subset.Options()
    options.layout_features = ["*"]
    options.name_IDs = ["*"]
    options.name_languages = ["*"]
    options.notdef_outline = True
    options.hinting = False
    options.flavor = flavor
    sub = subset.Subsetter(options)
    sub.populate(unicodes=[ord(c) for c in chars])
    sub.subset(font)


def is_cjk(c: str) -> bool:
    """True for a character of the CJK ranges above (not emoji, variation selectors or U+FFFD)."""
    return any(lo <= ord(c) <= hi for lo, hi in CJK_RANGES)


def _notebook_text(path: Path) -> str:
    """Every cell's source of one notebook."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells
    )


def _executed_text(path: Path) -> str:
    """All the text of an executed notebook: markdown, outputs (streams, tables, HTML) and widget
    state."""
    return json.dumps(json.loads(path.read_text(encoding="utf-8")), ensure_ascii=False)


def _tokenizer_pieces() -> str:
    """Every vocabulary entry of the bundled tokenizer, decoded on its own (the labels of token
    figures)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(
        str(ROOT / "data" / "models" / "kvlab-passphrase-qwen2" / "tokenizer.json")
    )
    return "".join(tok.decode([i]) for i in range(tok.get_vocab_size()))


def wanted_characters(executed: list[Path] | tuple[Path, ...] = (EXECUTED,)) -> set[str]:
    """The CJK (and full-width) characters the series can draw: in figures, and as text in the HTML
    handout.

    ``executed``: folders of executed notebooks (``*.ipynb``) whose outputs count too; a missing
    folder is skipped.
    """
    texts = [_notebook_text(p) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    texts += [p.read_text(encoding="utf-8") for folder in ("lessons", "built")
              for p in sorted((ROOT / "kvlab" / folder).glob("*.py"))]
    texts += [
        _executed_text(p) for folder in executed for p in sorted(Path(folder).glob("*.ipynb"))
    ]
    texts.append(_tokenizer_pieces())
    return {c for text in texts for c in text if is_cjk(c)}


def _source_font(path: str | None):
    """The Simplified Chinese face of the installed Noto Sans CJK collection."""
    from fontTools.ttLib import TTCollection, TTFont

    candidates = [path] if path else [p for p in SOURCES if Path(p).exists()]
    if not candidates:
        sys.exit(
            f"no source font: install fonts-noto-cjk (looked for {', '.join(SOURCES)}) or pass "
            "--source"
        )
    src = candidates[0]
    if not src.endswith(".ttc"):
        return TTFont(src)
    for font in TTCollection(src).fonts:
        if font["name"].getDebugName(1) == SOURCE_FAMILY:
            return font
    sys.exit(f"{src} holds no face named {SOURCE_FAMILY!r}")


def _rename(font) -> None:
    """Give the subset its own family name, keeping the copyright and licence records."""
    names = {
        1: FAMILY,
        2: "Regular",
        3: f"{FAMILY} Regular (subset of {SOURCE_FAMILY})",
        4: f"{FAMILY} Regular",
        6: FAMILY.replace(" ", "") + "-Regular",
        16: FAMILY,
        17: "Regular",
    }
    table = font["name"]
    for rec in list(table.names):
        if rec.nameID in names:
            table.removeNames(nameID=rec.nameID)
    for name_id, value in names.items():
        table.setName(value, name_id, 3, 1, 0x409)  # Windows, Unicode BMP, English
        table.setName(value, name_id, 1, 0, 0)  # Macintosh, Roman, English
    if "CFF " in font:
        cff = font["CFF "].cff
        cff.fontNames = [names[6]]
        top = cff.topDictIndex[0]
        top.FamilyName, top.FullName = FAMILY, names[4]


def make(
    source: str | None = None, executed: list[Path] | tuple[Path, ...] = (EXECUTED,)
) -> tuple[int, int]:
    """Write the subset and its licence; return (characters kept, bytes written)."""

    font = _source_font(source)
    cmap = font.getBestCmap()
    chars = sorted(c for c in wanted_characters(executed) if ord(c) in cmap)
    _subset(font, chars)
    _rename(font)
    FONTS.mkdir(parents=True, exist_ok=True)
    font.save(str(OUT))
    copyright_line = font["name"].getDebugName(0) or "Copyright 2014-2021 Adobe (http://www.adobe.com/)"
    (FONTS / "OFL.txt").write_text(_licence(copyright_line), encoding="utf-8")
    return len(chars), OUT.stat().st_size


def missing(executed: list[Path] | tuple[Path, ...] = (EXECUTED,)) -> list[str]:
    """The wanted characters the shipped subset cannot draw."""
    from fontTools.ttLib import TTFont

    cmap = TTFont(str(OUT)).getBestCmap()
    return sorted(c for c in wanted_characters(executed) if ord(c) not in cmap)


def font_face_css(text: str, selector_vars: dict[str, str]) -> tuple[str, list[str]]:
    """A ``<style>`` body that draws the CJK characters of ``text`` with the shipped font, and
    those it lacks.

    The shipped subset is cut down again to just the CJK characters in ``text`` (a page's worth:
    tens of KiB) and embedded as a base64 WOFF data URL, so one HTML file works on its own,
    offline, from any folder (no file next to it to lose, and no ``file://`` font-loading rules to
    meet). The face covers only CJK code points (``unicode-range``); it is put first in each CSS
    font variable of ``selector_vars`` (name -> the page's own value), so Latin text keeps its
    fonts. The OFL notice travels in a comment, and in the font's own name table.
    """
    from fontTools.ttLib import TTFont

    font = TTFont(str(OUT))
    cmap = font.getBestCmap()
    chars = sorted({c for c in text if is_cjk(c)})
    have = [c for c in chars if ord(c) in cmap]
    lacking = [c for c in chars if ord(c) not in cmap]
    if not have:
        return "", lacking
    _subset(font, have, flavor="woff")  # zlib, in the standard library (WOFF2 would need brotli)
    buf = io.BytesIO()
    font.flavor = "woff"
    font.save(buf)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    ranges = ",".join(f"U+{lo:X}-{hi:X}" for lo, hi in CJK_RANGES)
    notice = (font["name"].getDebugName(0) or "").replace("*/", "* /")
    overrides = "".join(
        f"\n  {name}: '{FAMILY}', {value};" for name, value in selector_vars.items()
    )
    css = (
        f"/* {FAMILY}: {len(have)} glyphs of {SOURCE_FAMILY} (Noto CJK, "
        "https://github.com/notofonts/noto-cjk),\n"
        f"   subset by kvlab's scripts/make_cjk_font.py. {notice}\n"
        f"   Licensed under the SIL Open Font License, Version 1.1 (https://openfontlicense.org);\n"
        f"   the full text ships with kvlab as data/fonts/OFL.txt. */\n"
        f"@font-face {{\n  font-family: '{FAMILY}';\n  font-style: normal;\n  font-weight: "
        "normal;  /* bold text gets synthetic bold, as from a system font */\n"
        f"  font-display: block;\n  unicode-range: {ranges};\n"
        f"  src: url(data:font/woff;base64,{data}) format('woff');\n}}\n"
        f":root:root {{{overrides}\n}}\n"
    )
    return css, lacking


def _licence(copyright_line: str) -> str:
    """The OFL text with the source font's copyright line and a note on what was changed."""
    ofl = Path(__file__).with_name("OFL-1.1.txt").read_text(encoding="utf-8")
    return (
        f"{FAMILY} is a subset of {SOURCE_FAMILY} (Noto CJK, "
        "https://github.com/notofonts/noto-cjk),\n"
        f"made by scripts/make_cjk_font.py: only the glyphs kvlab's notebooks draw, renamed.\n\n"
        f"{copyright_line}\n\nThis Font Software is licensed under the SIL Open Font License, "
        f"Version 1.1.\n\n{ofl}"
    )


def _show(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    """Command line: make the subset, or ``--check`` the shipped one."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--source", help="a Noto Sans CJK .ttc/.otf (default: the fonts-noto-cjk package's)"
    )
    ap.add_argument(
        "--check", action="store_true", help="list wanted characters the shipped subset lacks"
    )
    ap.add_argument(
        "--executed",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"a folder of executed notebooks whose outputs count too (repeatable; default: "
        f"{EXECUTED.relative_to(ROOT)} when present)",
    )
    args = ap.parse_args()
    executed = args.executed or [EXECUTED]
    if args.check:
        gone = missing(executed)
        print(
            f"{len(gone)} wanted characters missing from {OUT.name}"
            + (f": {''.join(gone)}" if gone else "")
            + " (sources, lessons, tokenizer and the executed copies in "
            + ", ".join(_show(d) + ("" if Path(d).is_dir() else " (absent)") for d in executed)
            + ")"
        )
        sys.exit(1 if gone else 0)
    n, size = make(args.source, executed)
    print(f"{OUT.relative_to(ROOT)}: {n} characters, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
