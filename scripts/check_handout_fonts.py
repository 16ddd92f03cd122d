"""Check in headless Chromium, offline, that every CJK character of the HTML handout is drawn with its embedded font.

    python scripts/check_handout_fonts.py build/notebooks [PAGE.html ...] [--screenshots DIR] [--keep-system-cjk]

For each page (a folder means its ``NN_*.html``), Chromium opens the file with no network and, by default, with
the machine's CJK fonts hidden from it (a fontconfig file that rejects every font ``fc-list :lang=zh/ja/ko``
names), as on a participant's machine that has none. The check then

- collects every CJK character in the page's visible text, grouped by the element's computed font
  (family, weight, style), and draws each group in a probe with that font;
- asks Chromium which fonts drew the probe's glyphs (DevTools ``CSS.getPlatformFontsForNode``): every glyph
  must come from the embedded web font ``kvlab CJK Sans``; any other font is a fallback, and the characters
  it drew are named;
- draws each character on a canvas with the same font and compares the pixels with those of U+FFEF, which
  no font has: an identical image is a box (Chromium draws a character no font has with the first font's
  box, and counts that as the first font's glyph);
- checks ``document.fonts`` holds the ``kvlab CJK Sans`` face, loaded, when the page has CJK text.

``--screenshots DIR`` also saves, per page, the first heading, table and printed output holding CJK text
(``<page>-heading.png``, ``-table.png``, ``-output.png``). Exit code 1 when a page fails, 2 when Chromium,
chromedriver or selenium is missing. Needs ``apt-get install chromium chromium-driver`` and ``pip install
selenium``; CI does not install them (``tests/lessons/test_handout.py`` then skips its browser test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_cjk_font import CJK_RANGES, FAMILY  # noqa: E402

CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMEDRIVER = ("chromedriver",)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--hide-scrollbars", "--window-size=1200,900", "--force-device-scale-factor=1")

# In the page: the CJK characters of each visible element's own text, grouped by the font the element asks for.
COLLECT_JS = """
const ranges = arguments[0];
const isCjk = (cp) => ranges.some(([lo, hi]) => cp >= lo && cp <= hi);
const groups = new Map();
const skip = new Set(['SCRIPT', 'STYLE', 'TITLE', 'NOSCRIPT', 'TEMPLATE', 'HEAD']);
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
for (let node = walker.nextNode(); node; node = walker.nextNode()) {
  const el = node.parentElement;
  if (!el || skip.has(el.tagName) || el.closest('script,style,template')) continue;
  const cjk = [...node.data].filter((c) => isCjk(c.codePointAt(0)));
  if (!cjk.length || !el.getClientRects().length) continue;
  const st = getComputedStyle(el);
  if (st.visibility === 'hidden') continue;
  const key = JSON.stringify([st.fontFamily, st.fontWeight, st.fontStyle]);
  if (!groups.has(key)) groups.set(key, {family: st.fontFamily, weight: st.fontWeight, style: st.fontStyle,
                                         chars: new Set(), where: el.tagName.toLowerCase() + '.' + el.className});
  cjk.forEach((c) => groups.get(key).chars.add(c));
}
return [...groups.values()].map((g) => ({...g, chars: [...g.chars].sort().join('')}));
"""

# The embedded face in document.fonts: its status after the page's fonts settled.
FACES_JS = """
const done = arguments[arguments.length - 1];
document.fonts.ready.then(() => done([...document.fonts].map((f) => ({family: f.family, status: f.status}))));
"""

PROBE_JS = """
const [id, text, family, weight, style] = arguments;
let probe = document.getElementById(id);
if (!probe) { probe = document.createElement('span'); probe.id = id; document.body.appendChild(probe); }
Object.assign(probe.style, {position: 'absolute', left: '0', top: '0', whiteSpace: 'pre', fontSize: '16px',
                            fontFamily: family, fontWeight: weight, fontStyle: style});
probe.textContent = text;
return probe.getBoundingClientRect().width;
"""

# In the page: the characters of ``chars`` drawn exactly like U+FFEF, a code point in the face's range that no
# font draws: a box (.notdef). Chromium draws a character no font has with the first font's box and counts it
# as that font's glyph, so the font names alone cannot tell a box from a glyph.
BOXES_JS = """
const [chars, family, weight, style] = arguments;
const canvas = document.createElement('canvas');
canvas.width = canvas.height = 64;
const ctx = canvas.getContext('2d', {willReadFrequently: true});
const draw = (c) => {
  ctx.clearRect(0, 0, 64, 64);
  ctx.font = `${style} ${weight} 40px ${family}`;
  ctx.fillStyle = '#000';
  ctx.fillText(c, 8, 48);
  return ctx.getImageData(0, 0, 64, 64).data;
};
const box = draw('\\uFFEF');
return [...chars].filter((c) => draw(c).every((v, i) => v === box[i]));
"""

SHOTS = {  # screenshot name -> the elements to try, first holding CJK text wins
    "heading": "h1, h2, h3",
    "table": "table",
    "output": ".jp-OutputArea-output pre, .jp-RenderedText pre",
}


def find_tools() -> tuple[str | None, str | None, str | None]:
    """(chromium, chromedriver, why not): the binaries, or the reason the check cannot run."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, None, "selenium is not installed (pip install selenium)"
    browser = next((shutil.which(b) for b in CHROMIUM if shutil.which(b)), None)
    driver = next((shutil.which(d) for d in CHROMEDRIVER if shutil.which(d)), None)
    if browser is None:
        return None, None, "Chromium is not installed (apt-get install chromium)"
    if driver is None:
        return None, None, "chromedriver is not installed (apt-get install chromium-driver)"
    return browser, driver, None


def system_cjk_fonts() -> list[str]:
    """The font files fontconfig offers for Chinese, Japanese or Korean text."""
    if shutil.which("fc-list") is None:
        return []
    files = set()
    for lang in ("zh", "ja", "ko"):
        out = subprocess.run(["fc-list", f":lang={lang}", "file"], capture_output=True, text=True).stdout
        files |= {line.strip().rstrip(":") for line in out.splitlines() if line.strip()}
    return sorted(files)


def hide_system_cjk(workdir: Path) -> dict[str, str]:
    """Environment for Chromium with a fontconfig file that rejects every system CJK font ({} if there are none)."""
    files = system_cjk_fonts()
    if not files:
        return {}
    base = os.environ.get("FONTCONFIG_FILE", "/etc/fonts/fonts.conf")
    globs = "".join(f"<glob>{f.replace('&', '&amp;').replace('<', '&lt;')}</glob>" for f in files)
    conf = workdir / "fonts.conf"
    conf.write_text(f'<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
                    f'<include ignore_missing="yes">{base}</include>\n'
                    f"<selectfont><rejectfont>{globs}</rejectfont></selectfont>\n"
                    f"<cachedir>{workdir / 'fc-cache'}</cachedir>\n</fontconfig>\n", encoding="utf-8")
    env = {"FONTCONFIG_FILE": str(conf)}
    left = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True,
                          env={**os.environ, **env}).stdout.strip()
    if left:
        raise RuntimeError(f"could not hide the system CJK fonts from Chromium: {left}")
    return env


def start_browser(browser: str, driver: str, env: dict[str, str], profile: Path):
    """Headless Chromium under chromedriver, offline, with a fresh profile and ``env`` (fontconfig)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in (*FLAGS, f"--user-data-dir={profile}", "--proxy-server=http://127.0.0.1:9",
                 "--proxy-bypass-list=<-loopback>"):  # no network: any request beyond file:// fails at once
        opts.add_argument(flag)
    service = Service(executable_path=driver, env={**os.environ, **env})
    return webdriver.Chrome(service=service, options=opts)


def platform_fonts(drv, element_id: str) -> list[dict]:
    """The fonts Chromium drew the element's text with: familyName, isCustomFont, glyphCount."""
    root = drv.execute_cdp_cmd("DOM.getDocument", {"depth": 0})["root"]["nodeId"]
    node = drv.execute_cdp_cmd("DOM.querySelector", {"nodeId": root, "selector": f"#{element_id}"})["nodeId"]
    return drv.execute_cdp_cmd("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]


def fallback_chars(drv, group: dict) -> tuple[dict[str, str], int]:
    """The group's characters not drawn by the embedded face ({char: font or 'a box'}), and the probe's width."""
    args = (group["family"], group["weight"], group["style"])
    width = drv.execute_script(PROBE_JS, "kvlab-probe", group["chars"], *args)
    fonts = platform_fonts(drv, "kvlab-probe")
    boxes = {c: "no font: a box" for c in drv.execute_script(BOXES_JS, group["chars"], *args)}
    ours = sum(f["glyphCount"] for f in fonts if f["isCustomFont"] and f["familyName"] == FAMILY)
    if ours == len(group["chars"]) and all(f["isCustomFont"] and f["familyName"] == FAMILY for f in fonts):
        return boxes, width
    bad = dict(boxes)
    for c in group["chars"]:  # name each character that fell back, and the font that drew it
        drv.execute_script(PROBE_JS, "kvlab-probe", c, *args)
        used = platform_fonts(drv, "kvlab-probe")
        if not (len(used) == 1 and used[0]["isCustomFont"] and used[0]["familyName"] == FAMILY):
            bad[c] = ", ".join(f["familyName"] for f in used) or "no font: a box"
    return bad, width


def screenshots(drv, page: Path, folder: Path) -> list[Path]:
    """The first heading, table and printed output with CJK text on the page, as PNGs in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    from selenium.webdriver.common.by import By

    saved = []
    for name, selector in SHOTS.items():
        for el in drv.find_elements(By.CSS_SELECTOR, selector):
            has_cjk = drv.execute_script(
                "const r = arguments[1]; return [...arguments[0].innerText].some("
                "(c) => r.some(([lo, hi]) => c.codePointAt(0) >= lo && c.codePointAt(0) <= hi));", el, CJK_RANGES)
            if has_cjk and el.size["height"] > 0:
                drv.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
                target = folder / f"{page.stem}-{name}.png"
                el.screenshot(str(target))
                saved.append(target)
                break
    return saved


def check_page(drv, page: Path, shots: Path | None = None) -> dict:
    """One page's result: CJK characters, fallbacks by character, the face's status, screenshots."""
    drv.get(page.resolve().as_uri())
    deadline = time.monotonic() + 20
    while drv.execute_script("return document.readyState") != "complete" and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the widget renderer draws its snapshots after load
    faces = drv.execute_async_script(FACES_JS)
    groups = drv.execute_script(COLLECT_JS, CJK_RANGES)
    chars = "".join(sorted({c for g in groups for c in g["chars"]}))
    fallbacks: dict[str, str] = {}
    for g in groups:
        bad, _ = fallback_chars(drv, g)
        fallbacks.update({c: f"{font} (in {g['where']}, font-family {g['family']})" for c, font in bad.items()})
    ours = [f["status"] for f in faces if f["family"].strip("'\"") == FAMILY]
    problems = []
    if chars and "loaded" not in ours:
        problems.append(f"document.fonts has no loaded {FAMILY!r} face (statuses: {ours or 'none'})")
    if fallbacks:
        problems.append(f"{len(fallbacks)} CJK characters drawn by a fallback: "
                        + "; ".join(f"{c} by {font}" for c, font in sorted(fallbacks.items())))
    return {"page": str(page), "cjk_chars": len(chars), "groups": len(groups), "face": ours,
            "problems": problems, "screenshots": [str(p) for p in (screenshots(drv, page, shots) if shots else [])]}


def pages_of(paths: list[Path]) -> list[Path]:
    """HTML pages named, folders expanded to their notebook pages (``NN_*.html``)."""
    out = []
    for p in paths:
        out += sorted(p.glob("[0-9][0-9]*_*.html")) if p.is_dir() else [p]
    return out


def check(paths: list[Path], shots: Path | None = None, keep_system_cjk: bool = False) -> list[dict]:
    """Check every page in one browser; results in page order (raises RuntimeError when tools are missing)."""
    browser, driver, why = find_tools()
    if why:
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory(prefix="kvlab-fonts-") as tmp:
        env = {} if keep_system_cjk else hide_system_cjk(Path(tmp))
        drv = start_browser(browser, driver, env, Path(tmp) / "profile")
        try:
            drv.execute_cdp_cmd("DOM.enable", {})
            drv.execute_cdp_cmd("CSS.enable", {})
            drv.set_script_timeout(30)
            return [check_page(drv, page, shots) for page in pages_of(paths)]
        finally:
            drv.quit()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="HTML pages, or folders of them (build/notebooks)")
    ap.add_argument("--screenshots", type=Path, default=None, metavar="DIR",
                    help="save the first heading, table and output with CJK text of each page here")
    ap.add_argument("--keep-system-cjk", action="store_true",
                    help="let Chromium see the machine's CJK fonts (by default they are hidden)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    try:
        results = check(args.paths, args.screenshots, args.keep_system_cjk)
    except RuntimeError as e:
        print(f"cannot check: {e}", file=sys.stderr)
        return 2
    if not results:
        print("no pages found", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results, ensure_ascii=False, indent=1))
    for r in results:
        status = "FAIL" if r["problems"] else "ok"
        print(f"{status:4s} {Path(r['page']).name}: {r['cjk_chars']} CJK characters in {r['groups']} font contexts"
              + "".join(f"\n     {p}" for p in r["problems"]) + "".join(f"\n     screenshot {s}" for s in r["screenshots"]))
    failed = [r for r in results if r["problems"]]
    print(f"{len(results) - len(failed)}/{len(results)} pages draw every CJK character with {FAMILY!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
