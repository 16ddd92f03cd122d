"""Helpers every lesson uses: exercise verdicts, the article's decision table (with a verdict
column), CJK labels."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# ----------------------------------------------------------------------------- exercise verdicts


@dataclass(frozen=True)
class Verdict:
    """What an exercise checker says: ``ok`` (truthy when correct) and one line of text, never the
    answer."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return self.message


def verdict(ok: bool, good: str = "", hint: str = "") -> Verdict:
    """``Verdict(True, "correct: <good>")`` or ``Verdict(False, "not yet: <hint>")``."""
    if ok:
        return Verdict(True, "correct" + (f": {good}" if good else ""))
    return Verdict(False, "not yet" + (f": {hint}" if hint else ""))


def unanswered(hint: str) -> Verdict:
    """The verdict on an exercise left blank (``None`` or ``raise NotImplementedError``): a hint, no
    answer."""
    return verdict(False, hint=f"no answer yet. Hint: {hint}")


def call_answer(fn: Callable[..., Any] | None, *args: Any, hint: str, name: str = "your function"
                ) -> tuple[Any, Verdict | None]:
    """Call the reader's function: ``(result, None)``, or ``(None, a "not yet" Verdict)`` when it is
    missing (``None``), still ``raise NotImplementedError``, or raises anything else. A checker
    never raises."""
    if fn is None:
        return None, unanswered(hint)
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, unanswered(hint)
    except Exception as err:  # the reader's code may fail in any way
        return None, verdict(False, hint=f"{name} raised {type(err).__name__}: {err}")


def as_number(answer: Any, kind: type = float) -> Any:
    """``answer`` as ``kind`` (float or int), or None when it is not a number."""
    try:
        return kind(answer)
    except (TypeError, ValueError):
        return None


def check_number(answer: Any, expected: float, good: str, hint: str, kind: type = float,
                 tol: float = 0.0) -> Verdict:
    """A checker for a numeric answer: blank -> the hint; not a ``kind`` -> says so; else right
    within ``tol``."""
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, kind)
    if value is None:
        return verdict(False,
                       hint=f"give {'a whole number' if kind is int else 'a number'}, not "
                            f"{answer!r}")
    return verdict(abs(value - expected) <= tol, good, hint)


# ----------------------------------------------------------------------------- the decision table


class DecisionRow(NamedTuple):
    """One row of the article's decision table (its section 2.4), named so evidence can refer to
    it."""

    name: str  # a short, stable key: evidence dicts and exercise answers use it
    condition: str  # the article's condition, in English
    zh: str  # the article's own words
    share: str  # the article: may requests share cached K/V under this condition?
    isolate: str  # the article: must they be isolated?


DECISION_ROWS: tuple[DecisionRow, ...] = (
    DecisionRow("identical-prefix", "prefix token sequences are identical", "前缀token序列完全一致",
                "yes", "no"),
    DecisionRow("same-start", "the prefix starts at the same position", "前缀起始位置相同", "yes",
                "no"),
    DecisionRow("no-writes-to-shared", "later generation does not modify shared blocks",
                "后续生成不修改共享块",
                "yes", "no"),
    DecisionRow("positions-agree", "position encodings agree", "位置编码一致", "yes", "no"),
    DecisionRow("independent-context", "later contexts of the requests are independent",
                "不同请求的后续上下文独立",
                "yes", "no"),
    DecisionRow("shared-may-be-written", "shared blocks may be written", "共享块可能被写入", "no",
                "yes"),
    DecisionRow("overlap-different-start", "prefixes overlap partly but start differently",
                "前缀有部分重叠但起始不同",
                "no", "yes"),
    DecisionRow("full-isolation", "requests must be fully isolated", "需要保证请求间完全隔离", "no",
                "yes"),
)

ROW_NAMES: tuple[str, ...] = tuple(r.name for r in DECISION_ROWS)


VERDICTS = ("confirmed", "refined", "contradicted")


class Evidence(NamedTuple):
    """A row's verdict on the article's yes/no, what was measured, and the cell that measured it
    ("07 §2, cell 24")."""

    verdict: str  # one of VERDICTS
    measured: str
    cell: str


def decision_table(evidence: Mapping[str, str | Evidence] | None = None):
    """The article's decision table as a DataFrame indexed by row name, with what a notebook
    measured."""
    import pandas as pd

    evidence = dict(evidence or {})
    unknown = sorted(set(evidence) - set(ROW_NAMES), key=str)
    if unknown:
        raise KeyError(f"no decision-table row named {unknown}; the rows are {list(ROW_NAMES)}")
    judged = {k: v for k, v in evidence.items() if isinstance(v, Evidence)}
    wrong = {k: v.verdict for k, v in judged.items() if v.verdict not in VERDICTS}
    if wrong:
        raise ValueError(f"verdicts must be one of {VERDICTS}, got {wrong}")
    rows = []
    for r in DECISION_ROWS:
        e = evidence.get(r.name, "")
        row = {"row": r.name, "condition": r.condition, "article (zh)": r.zh, "share?": r.share,
               "isolate?": r.isolate}
        if judged:
            row["verdict"] = e.verdict if isinstance(e, Evidence) else ""
        row["evidence (measured here)"] = e.measured if isinstance(e, Evidence) else e
        if judged:
            row["measured in"] = e.cell if isinstance(e, Evidence) else ""
        rows.append(row)
    return pd.DataFrame(rows).set_index("row")


# ----------------------------------------------------------------------------- records of live runs


def record_files(relpath: str) -> tuple[Callable[..., str], Callable[..., dict | None]]:
    """``(save_record, load_record)`` for the JSON file ``relpath`` under the repository (or a
    ``root`` given to either): the last live run against a peer (vLLM), stamped with its time, so a
    run without the peer can show it."""
    import json
    import time
    from pathlib import Path

    def where(root: Any) -> Path:
        return Path(root if root is not None else Path(__file__).resolve().parents[2]) / relpath

    def save_record(record: dict, root: Any = None) -> str:
        path = where(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        path.write_text(json.dumps({**record, "recorded_at": stamp}, indent=1, default=str))
        return str(path)

    def load_record(root: Any = None) -> dict | None:
        try:
            return json.loads(where(root).read_text()) | {"path": str(where(root))}
        except (OSError, json.JSONDecodeError):
            return None

    return save_record, load_record


# ----------------------------------------------------------------------------- sizes

# above this many parameters on a CPU, a notebook's sweeps use their small sizes
QUICK_PARAMETERS = 10_000_000


class Reveal:
    """Measured answer to a "predict first" question, shown collapsed: a participant opens it after
    predicting."""

    def __init__(self, summary: str, text: str, table: Any = None):
        self.summary, self.text, self.table = summary, text, table

    def _repr_html_(self) -> str:
        import html

        inner = f"<pre>{html.escape(self.text)}</pre>"
        if self.table is not None:
            inner += self.table.to_html()
        return f"<details><summary>{html.escape(self.summary)}</summary>{inner}</details>"

    def __repr__(self) -> str:
        table = "" if self.table is None else "\n" + self.table.to_string()
        return f"{self.summary}\n{self.text}{table}"


def quick_sizes(model: Any, smoke: bool = False) -> bool:
    """Small sweep sizes in SMOKE mode and for a model above ``QUICK_PARAMETERS`` on a CPU (03's: 12
    min on SmolLM2)."""
    if smoke:
        return True
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return False
    return sum(p.numel() for p in model.parameters()) > QUICK_PARAMETERS


def quick_note(model: Any, smoke: bool = False) -> str:
    """One line for a notebook's set-up cell saying which sizes ``quick_sizes`` picked and why."""
    if smoke:
        return "SMOKE: small sizes everywhere"
    if quick_sizes(model):
        n = sum(p.numel() for p in model.parameters())
        return (f"{n / 1e6:.0f}M parameters on a CPU: the sweeps use their small sizes "
                "(on a GPU the full sizes run)")
    return "full sizes"


# ----------------------------------------------------------------------------- timing

# a ratio within 5 % of 1 is called "about the same" (ratio_word): for a verdict the repeats
# already told apart (timing.TimingVerdict.says) or a quantity that is not a timing; one timed
# run has no spread and is not ranked with it
TIE = 0.05


def ratio_word(ratio: float, above: str, below: str, tie: float = TIE) -> str:
    """``above`` / ``below`` for a ratio away from 1, "about the same" within ``tie`` of it (either
    way)."""
    if abs(ratio - 1) <= tie:
        return f"about the same, within {tie:.0%}"
    return above if ratio > 1 else below


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal (0.1234 -> '12.3 %'); 'n/a' for None or NaN."""
    return "n/a" if x is None or x != x else f"{100 * x:.1f} %"


def ms(x: float | None) -> str:
    """Seconds as milliseconds with two decimals; 'n/a' for None or NaN."""
    return "n/a" if x is None or x != x else f"{1000 * x:.2f} ms"


def share_word(k: int, n: int) -> str:
    """How many of ``n`` cases ``k`` is, in a word: "all", "most", "half", "a minority" or
    "none"."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"share_word needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    if k == n:
        return "all"
    if k == 0:
        return "none"
    return "most" if 2 * k > n else "half" if 2 * k == n else "a minority"


# data/fonts: a subset of Noto Sans CJK SC (OFL), made by scripts/make_cjk_font.py
CJK_FAMILY = "kvlab CJK Sans"
CJK_FONTS = (CJK_FAMILY, "Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC",
             "WenQuanYi Zen Hei",
             "WenQuanYi Micro Hei", "SimHei", "Microsoft YaHei", "PingFang SC", "Heiti SC",
             "Arial Unicode MS")


def _register_cjk_font() -> str | None:
    """Register the shipped CJK subset with matplotlib and append the first CJK font found to
    ``font.family``, matplotlib's per-glyph fallback chain, so Chinese labels draw. Returns its
    name."""
    from kvlab.engine.models import package_data

    try:
        from matplotlib import font_manager, rcParams
    except ImportError:  # an install without the notebooks extra draws nothing
        return None

    shipped = package_data("fonts", "kvlab-cjk-sans.otf")
    installed = {f.name for f in font_manager.fontManager.ttflist}
    if CJK_FAMILY not in installed and shipped.is_file():
        font_manager.fontManager.addfont(str(shipped))
        installed.add(CJK_FAMILY)
    found = next((name for name in CJK_FONTS if name in installed), None)
    # a family list is a per-glyph fallback chain
    if found and found not in rcParams["font.family"]:
        rcParams["font.family"] = [*rcParams["font.family"], found]
    return found


CJK_FONT = _register_cjk_font()


def label(text: str) -> str:
    """Text safe to draw: CJK characters become ``\\uXXXX`` escapes only when no CJK font could be
    registered."""
    if CJK_FONT:
        return text
    return "".join(c if ord(c) < 0x2E80 else f"\\u{ord(c):04x}" for c in text)


def progress_bar(items: Sequence, on: bool, desc: str):
    """``items`` wrapped in a labelled tqdm bar when ``on`` (notebooks), else unchanged (tests,
    scripts)."""
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc)
