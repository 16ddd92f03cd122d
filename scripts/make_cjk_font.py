"""Make kvlab's CJK font: a subset of Noto Sans CJK SC holding only the glyphs the series draws.

    apt-get install -y fonts-noto-cjk        # the source font (SIL Open Font License 1.1)
    python scripts/make_cjk_font.py [--source PATH.ttc] [--check]

The glyphs are collected from every string the figures can show: the notebooks' sources, the lessons'
modules (prompts, passphrases, the article's decision table) and every piece the bundled tokenizer
decodes to (token labels in notebooks 01 and 02). The subset goes to ``data/fonts/`` with its
licence; ``kvlab.lessons.common`` registers it with matplotlib at import. Run it again when a lesson
gains new Chinese text; ``--check`` only lists characters the shipped subset lacks (exit code 1 if any).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FONTS = ROOT / "data" / "fonts"
OUT = FONTS / "kvlab-cjk-sans.otf"
SOURCES = ("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",)
SOURCE_FAMILY = "Noto Sans CJK SC"
FAMILY = "kvlab CJK Sans"  # a modified version gets its own name (the OFL's condition 3)
FIRST_CJK = 0x2E80  # CJK radicals onwards: what DejaVu Sans, matplotlib's default, cannot draw


def _notebook_text(path: Path) -> str:
    """Every cell's source of one notebook."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells)


def _tokenizer_pieces() -> str:
    """Every vocabulary entry of the bundled tokenizer, decoded on its own (the labels of token figures)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "data" / "models" / "kvlab-passphrase-qwen2" / "tokenizer.json"))
    return "".join(tok.decode([i]) for i in range(tok.get_vocab_size()))


def wanted_characters() -> set[str]:
    """The CJK (and full-width) characters the series can draw."""
    texts = [_notebook_text(p) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    texts += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "kvlab" / "lessons").glob("*.py"))]
    texts.append(_tokenizer_pieces())
    return {c for text in texts for c in text if ord(c) >= FIRST_CJK and c != "\ufffd"}


def _source_font(path: str | None):
    """The Simplified Chinese face of the installed Noto Sans CJK collection."""
    from fontTools.ttLib import TTCollection, TTFont

    candidates = [path] if path else [p for p in SOURCES if Path(p).exists()]
    if not candidates:
        sys.exit(f"no source font: install fonts-noto-cjk (looked for {', '.join(SOURCES)}) or pass --source")
    src = candidates[0]
    if not src.endswith(".ttc"):
        return TTFont(src)
    for font in TTCollection(src).fonts:
        if font["name"].getDebugName(1) == SOURCE_FAMILY:
            return font
    sys.exit(f"{src} holds no face named {SOURCE_FAMILY!r}")


def _rename(font) -> None:
    """Give the subset its own family name, keeping the copyright and licence records."""
    names = {1: FAMILY, 2: "Regular", 3: f"{FAMILY} Regular (subset of {SOURCE_FAMILY})", 4: f"{FAMILY} Regular",
             6: FAMILY.replace(" ", "") + "-Regular", 16: FAMILY, 17: "Regular"}
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


def make(source: str | None = None) -> tuple[int, int]:
    """Write the subset and its licence; return (characters kept, bytes written)."""
    from fontTools import subset

    font = _source_font(source)
    cmap = font.getBestCmap()
    chars = sorted(c for c in wanted_characters() if ord(c) in cmap)
    options = subset.Options()
    options.layout_features = ["*"]
    options.name_IDs = ["*"]
    options.name_languages = ["*"]
    options.notdef_outline = True
    options.hinting = False
    sub = subset.Subsetter(options)
    sub.populate(unicodes=[ord(c) for c in chars])
    sub.subset(font)
    _rename(font)
    FONTS.mkdir(parents=True, exist_ok=True)
    font.save(str(OUT))
    copyright_line = font["name"].getDebugName(0) or "Copyright 2014-2021 Adobe (http://www.adobe.com/)"
    (FONTS / "OFL.txt").write_text(_licence(copyright_line), encoding="utf-8")
    return len(chars), OUT.stat().st_size


def missing() -> list[str]:
    """The wanted characters the shipped subset cannot draw."""
    from fontTools.ttLib import TTFont

    cmap = TTFont(str(OUT)).getBestCmap()
    return sorted(c for c in wanted_characters() if ord(c) not in cmap)


def _licence(copyright_line: str) -> str:
    """The OFL text with the source font's copyright line and a note on what was changed."""
    ofl = Path(__file__).with_name("OFL-1.1.txt").read_text(encoding="utf-8")
    return (f"{FAMILY} is a subset of {SOURCE_FAMILY} (Noto CJK, https://github.com/notofonts/noto-cjk),\n"
            f"made by scripts/make_cjk_font.py: only the glyphs kvlab's notebooks draw, renamed.\n\n"
            f"{copyright_line}\n\nThis Font Software is licensed under the SIL Open Font License, Version 1.1.\n\n{ofl}")


def main() -> None:
    """Command line: make the subset, or ``--check`` the shipped one."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="a Noto Sans CJK .ttc/.otf (default: the fonts-noto-cjk package's)")
    ap.add_argument("--check", action="store_true", help="list wanted characters the shipped subset lacks")
    args = ap.parse_args()
    if args.check:
        gone = missing()
        print(f"{len(gone)} wanted characters missing from {OUT.name}" + (f": {''.join(gone)}" if gone else ""))
        sys.exit(1 if gone else 0)
    n, size = make(args.source)
    print(f"{OUT.relative_to(ROOT)}: {n} characters, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
