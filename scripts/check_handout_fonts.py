"""Check in headless Chromium, offline, that every CJK character of the HTML handout is drawn with
its embedded font.

    python scripts/check_handout_fonts.py build/notebooks [PAGE.html ...] [--screenshots DIR] \\
        [--keep-system-cjk]
    # live, in `make lab`'s JupyterLab:
    python scripts/check_handout_fonts.py --lab notebooks/00_passphrase_experiment.ipynb

For each page (a folder means its ``NN_*.html``), Chromium opens the file with no network and, by
default, with the machine's CJK fonts hidden from it (a fontconfig file that rejects every font
``fc-list :lang=zh/ja/ko`` names), as on a participant's machine that has none. The check then

- collects every CJK character in the page's visible text, grouped by the element's computed font
  (family, weight, style), and draws each group in a probe with that font;
- asks Chromium which fonts drew the probe's glyphs (DevTools ``CSS.getPlatformFontsForNode``):
  every glyph must come from the embedded web font ``kvlab CJK Sans``; any other font is a
  fallback, and the characters it drew are named;
- draws each character on a canvas with the same font and compares the pixels with those of U+FFEF,
  which no font has: an identical image is a box (Chromium draws a character no font has with the
  first font's box, and counts that as the first font's glyph);
- checks ``document.fonts`` holds the ``kvlab CJK Sans`` face, loaded, when the page has CJK text.

``--screenshots DIR`` also saves, per page, the first heading, table and printed output holding CJK
text (``<page>-heading.png``, ``-table.png``, ``-output.png``). Exit code 1 when a page fails, 2
when Chromium, chromedriver or selenium is missing. Needs ``apt-get install chromium
chromium-driver`` and ``pip install selenium``; CI does not install them
(``tests/lessons/test_handout.py`` then skips its browser test).
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
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--window-size=1200,900",
    "--force-device-scale-factor=1",
)

# In the page: the CJK characters of each visible element's own text, grouped by the font the
# element asks for.
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
  if (!groups.has(key)) groups.set(key, {family: st.fontFamily, weight: st.fontWeight,
                                         style: st.fontStyle, chars: new Set(),
                                         where: el.tagName.toLowerCase() + '.' + el.className});
  cjk.forEach((c) => groups.get(key).chars.add(c));
}
return [...groups.values()].map((g) => ({...g, chars: [...g.chars].sort().join('')}));
"""

# The embedded face in document.fonts: its status after the page's fonts settled.
FACES_JS = """
const done = arguments[arguments.length - 1];
document.fonts.ready.then(
  () => done([...document.fonts].map((f) => ({family: f.family, status: f.status}))));
"""

PROBE_JS = """
const [id, text, family, weight, style] = arguments;
let probe = document.getElementById(id);
if (!probe) {
  probe = document.createElement('span'); probe.id = id; document.body.appendChild(probe);
}
Object.assign(probe.style, {position: 'absolute', left: '0', top: '0', whiteSpace: 'pre',
                            fontSize: '16px', fontFamily: family, fontWeight: weight,
                            fontStyle: style});
probe.textContent = text;
return probe.getBoundingClientRect().width;
"""

# In the page: the characters of ``chars`` drawn exactly like U+FFEF, a code point in the face's
# range that no font draws: a box (.notdef). Chromium draws a character no font has with the first
# font's box and counts it as that font's glyph, so the font names alone cannot tell a box from a
# glyph.
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
        out = subprocess.run(
            ["fc-list", f":lang={lang}", "file"], capture_output=True, text=True
        ).stdout
        files |= {line.strip().rstrip(":") for line in out.splitlines() if line.strip()}
    return sorted(files)


def hide_system_cjk(workdir: Path) -> dict[str, str]:
    """Environment for Chromium with a fontconfig file that rejects every system CJK font ({} if
    there are none)."""
    files = system_cjk_fonts()
    if not files:
        return {}
    base = os.environ.get("FONTCONFIG_FILE", "/etc/fonts/fonts.conf")
    globs = "".join(f"<glob>{f.replace('&', '&amp;').replace('<', '&lt;')}</glob>" for f in files)
    conf = workdir / "fonts.conf"
    conf.write_text(
        f'<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>\n'
        f'<include ignore_missing="yes">{base}</include>\n'
        f"<selectfont><rejectfont>{globs}</rejectfont></selectfont>\n"
        f"<cachedir>{workdir / 'fc-cache'}</cachedir>\n</fontconfig>\n",
        encoding="utf-8",
    )
    env = {"FONTCONFIG_FILE": str(conf)}
    left = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True,
                          env={**os.environ, **env}).stdout.strip()
    if left:
        raise RuntimeError(f"could not hide the system CJK fonts from Chromium: {left}")
    return env


def start_browser(
    browser: str, driver: str, env: dict[str, str], profile: Path, loopback: bool = False
):
    """Headless Chromium under chromedriver, offline, with a fresh profile and ``env`` (fontconfig).

    ``loopback``: pages on 127.0.0.1 load (a local JupyterLab); everything else stays
    unreachable."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    # no network beyond file:// (and loopback)
    for flag in (
        *FLAGS,
        f"--user-data-dir={profile}",
        "--proxy-server=http://127.0.0.1:9",
        *(() if loopback else ("--proxy-bypass-list=<-loopback>",)),
    ):
        opts.add_argument(flag)
    service = Service(executable_path=driver, env={**os.environ, **env})
    return webdriver.Chrome(service=service, options=opts)


def platform_fonts(drv, element_id: str) -> list[dict]:
    """The fonts Chromium drew the element's text with: familyName, isCustomFont, glyphCount."""
    root = drv.execute_cdp_cmd("DOM.getDocument", {"depth": 0})["root"]["nodeId"]
    node = drv.execute_cdp_cmd("DOM.querySelector", {"nodeId": root, "selector": f"#{element_id}"})[
        "nodeId"
    ]
    return drv.execute_cdp_cmd("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]


def fallback_chars(drv, group: dict) -> tuple[dict[str, str], int]:
    """The group's characters not drawn by the embedded face ({char: font or 'a box'}), and the
    probe's width."""
    args = (group["family"], group["weight"], group["style"])
    width = drv.execute_script(PROBE_JS, "kvlab-probe", group["chars"], *args)
    fonts = platform_fonts(drv, "kvlab-probe")
    boxes = {c: "no font: a box" for c in drv.execute_script(BOXES_JS, group["chars"], *args)}
    ours = sum(f["glyphCount"] for f in fonts if f["isCustomFont"] and f["familyName"] == FAMILY)
    if ours == len(group["chars"]) and all(
        f["isCustomFont"] and f["familyName"] == FAMILY for f in fonts
    ):
        return boxes, width
    bad = dict(boxes)
    for c in group["chars"]:  # name each character that fell back, and the font that drew it
        drv.execute_script(PROBE_JS, "kvlab-probe", c, *args)
        used = platform_fonts(drv, "kvlab-probe")
        if not (len(used) == 1 and used[0]["isCustomFont"] and used[0]["familyName"] == FAMILY):
            bad[c] = ", ".join(f["familyName"] for f in used) or "no font: a box"
    return bad, width


def screenshots(drv, page: Path, folder: Path) -> list[Path]:
    """The first heading, table and printed output with CJK text on the page, as PNGs in
    ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    from selenium.webdriver.common.by import By

    saved = []
    for name, selector in SHOTS.items():
        for el in drv.find_elements(By.CSS_SELECTOR, selector):
            has_cjk = drv.execute_script(
                "const r = arguments[1]; return [...arguments[0].innerText].some("
                "(c) => r.some(([lo, hi]) => c.codePointAt(0) >= lo && c.codePointAt(0) <= hi));",
                el,
                CJK_RANGES,
            )
            if has_cjk and el.size["height"] > 0:
                drv.execute_script("arguments[0].scrollIntoView({block: 'center'});", el)
                target = folder / f"{page.stem}-{name}.png"
                el.screenshot(str(target))
                saved.append(target)
                break
    return saved


# A live JupyterLab notebook: drawn once its cells are attached and the markdown rendered; every
# cell is laid out (JupyterLab's default windowing skips off-screen cells' layout with
# content-visibility).
LAB_READY_JS = """
const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
const md = document.querySelectorAll('.jp-Notebook .jp-MarkdownCell .jp-RenderedMarkdown');
if (cells.length < arguments[0] || !md.length) return false;
if (!document.getElementById('kvlab-all-cells')) {
  const st = document.createElement('style'); st.id = 'kvlab-all-cells';
  st.textContent = '.jp-Cell, .jp-Notebook * {content-visibility: visible !important}';
  document.head.appendChild(st);
}
return true;
"""


# One step down the notebook's scroller; true once it is at the bottom.
SCROLL_JS = """
const el = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer');
if (!el) return true;
const before = el.scrollTop;
el.scrollTop = before + el.clientHeight * 0.8;
return el.scrollTop === before;
"""


def check_page(drv, page: Path | str, shots: Path | None = None, min_cells: int = 0) -> dict:
    """One page's result: CJK characters, fallbacks by character, the face's status, screenshots.

    ``page``: an HTML file, or the URL of a notebook in a running JupyterLab (then ``min_cells``
    cells must be attached before the check)."""
    live = isinstance(page, str)
    drv.get(page if live else page.resolve().as_uri())
    deadline = time.monotonic() + (90 if live else 20)
    while (
        drv.execute_script("return document.readyState") != "complete"
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    while live and not drv.execute_script(LAB_READY_JS, min_cells):
        if time.monotonic() > deadline:
            raise RuntimeError(f"JupyterLab did not show the notebook's cells within 90 s: {page}")
        time.sleep(0.5)
    # the widget renderer (handout) or JupyterLab's outputs draw after load
    time.sleep(2.0 if live else 0.5)
    faces = drv.execute_async_script(FACES_JS)
    groups = drv.execute_script(COLLECT_JS, CJK_RANGES)
    # JupyterLab's editors draw only the lines near the viewport: scroll through, collecting as it
    # goes
    if live:
        merged = {(g["family"], g["weight"], g["style"]): g for g in groups}
        for _ in range(400):
            if drv.execute_script(SCROLL_JS):
                break
            time.sleep(0.3)
            for g in drv.execute_script(COLLECT_JS, CJK_RANGES):
                have = merged.setdefault((g["family"], g["weight"], g["style"]), g)
                have["chars"] = "".join(sorted(set(have["chars"]) | set(g["chars"])))
        groups = list(merged.values())
    chars = "".join(sorted({c for g in groups for c in g["chars"]}))
    fallbacks: dict[str, str] = {}
    for g in groups:
        bad, _ = fallback_chars(drv, g)
        fallbacks.update(
            {c: f"{font} (in {g['where']}, font-family {g['family']})" for c, font in bad.items()}
        )
    ours = [f["status"] for f in faces if f["family"].strip("'\"") == FAMILY]
    problems = []
    if chars and "loaded" not in ours:
        problems.append(
            f"document.fonts has no loaded {FAMILY!r} face (statuses: {ours or 'none'})"
        )
    if fallbacks:
        problems.append(f"{len(fallbacks)} CJK characters drawn by a fallback: "
                        + "; ".join(f"{c} by {font}" for c, font in sorted(fallbacks.items())))
    return {
        "page": str(page),
        "cjk_chars": len(chars),
        "groups": len(groups),
        "face": ours,
        "problems": problems,
        "screenshots": [
            str(p)
            for p in (screenshots(drv, Path(str(page).rsplit("/", 1)[-1]), shots) if shots else [])
        ],
    }


def pages_of(paths: list[Path]) -> list[Path]:
    """HTML pages named, folders expanded to their notebook pages (``NN_*.html``)."""
    out = []
    for p in paths:
        out += sorted(p.glob("[0-9][0-9]*_*.html")) if p.is_dir() else [p]
    return out


def check(
    paths: list[Path], shots: Path | None = None, keep_system_cjk: bool = False
) -> list[dict]:
    """Check every page in one browser; results in page order (raises RuntimeError when tools are
    missing)."""
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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_lab(root: Path, config_dir: Path, custom_css: bool = True, timeout: float = 90):
    """A JupyterLab server on 127.0.0.1 (no token, no browser) over ``root``, with
    ``JUPYTER_CONFIG_DIR=config_dir`` as ``make lab`` runs it: ``(process, base URL)``. Stop it
    with ``stop_lab``."""
    import urllib.request

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--ServerApp.root_dir={root}",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--ServerApp.disable_check_xsrf=True",
        f"--LabApp.custom_css={custom_css}",
        "--allow-root",
    ]
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir)}
    log = open(config_dir / "lab.log", "wb")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"jupyter lab exited with {proc.returncode}: see {config_dir / 'lab.log'}"
            )
        try:
            with urllib.request.urlopen(url + "api/status", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    stop_lab(proc)
    raise RuntimeError(f"jupyter lab did not answer within {timeout:.0f} s")


def stop_lab(proc) -> None:
    """Stop the server ``start_lab`` started, and its kernels (its own process group only)."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_lab(
    notebook: str,
    root: Path,
    config_dir: Path,
    custom_css: bool = True,
    min_cells: int = 10,
    keep_system_cjk: bool = False,
    shots: Path | None = None,
) -> dict:
    """Open ``notebook`` (a path under ``root``) in a running JupyterLab, as ``make lab`` starts
    it, and check its CJK text as ``check_page`` checks a handout page: which font drew each
    character, and no box."""
    browser, driver, why = find_tools()
    if why:
        raise RuntimeError(why)
    proc, url = start_lab(root, config_dir, custom_css)
    try:
        with tempfile.TemporaryDirectory(prefix="kvlab-fonts-") as tmp:
            env = {} if keep_system_cjk else hide_system_cjk(Path(tmp))
            drv = start_browser(browser, driver, env, Path(tmp) / "profile", loopback=True)
            try:
                drv.execute_cdp_cmd("DOM.enable", {})
                drv.execute_cdp_cmd("CSS.enable", {})
                drv.set_script_timeout(60)
                return check_page(drv, f"{url}lab/tree/{notebook}", shots, min_cells=min_cells)
            finally:
                drv.quit()
    finally:
        stop_lab(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "paths", nargs="+", type=Path, help="HTML pages, or folders of them (build/notebooks)"
    )
    ap.add_argument("--screenshots", type=Path, default=None, metavar="DIR",
                    help="save the first heading, table and output with CJK text of each page here")
    ap.add_argument("--keep-system-cjk", action="store_true",
                    help="let Chromium see the machine's CJK fonts (by default they are hidden)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument(
        "--lab",
        action="store_true",
        help="the paths are notebooks (e.g. notebooks/00_*.ipynb): open each "
        "in a JupyterLab started as `make lab` starts it (config .venv/etc/jupyter) and check it "
        "there",
    )
    args = ap.parse_args(argv)
    try:
        if args.lab:
            root = Path(__file__).resolve().parents[1]
            results = [
                check_lab(
                    p.resolve().relative_to(root).as_posix(),
                    root,
                    root / ".venv/etc/jupyter",
                    keep_system_cjk=args.keep_system_cjk,
                    shots=args.screenshots,
                )
                for p in args.paths
            ]
        else:
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
        print(
            f"{status:4s} {Path(r['page']).name}: {r['cjk_chars']} CJK characters in {r['groups']} "
            "font contexts"
            + "".join(f"\n     {p}" for p in r["problems"])
            + "".join(f"\n     screenshot {s}" for s in r["screenshots"])
        )
    failed = [r for r in results if r["problems"]]
    print(
        f"{len(results) - len(failed)}/{len(results)} pages draw every CJK character with "
        f"{FAMILY!r}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
