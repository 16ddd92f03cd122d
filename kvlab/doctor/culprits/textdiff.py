"""Diff a request against its partner from the divergence point and name each difference (see
docs/doctor.md)."""

from __future__ import annotations

import json
import random
import re
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from os.path import commonprefix

from ..divergence import Divergence, lcp
from ..logio import Record
from ..prepare import SYSTEM_ROLES, Prepared, Segment
from ..tokenization import PromptEncoder
from .base import _shorten, tool_name

MIN_RUN = 8  # tokens that must match again after a slot
WINDOW = 160  # tokens searched for the re-alignment (a slot's value is shorter than this)
MAX_STEPS = 8  # slots followed per pair
LONG_LINE = 240  # a longer line is split into sentences
VALUE_CHARS = "-:./_+#@="  # with digits: what a value (time, id, number) is made of


def trim_value_start(s: str, joined: Callable[[str], bool]) -> str:
    """Cut value characters, a space before a digit and a cut word (``joined(s)``) off the start of
    ``s``."""
    while True:
        before = s
        while s and (s[0].isdigit() or s[0] in VALUE_CHARS):
            s = s[1:]
        if len(s) >= 2 and s[0] == " " and s[1].isdigit():
            s = s[1:]
            continue
        if s and s[0].isalnum() and joined(s):
            while s and s[0].isalnum():
                s = s[1:]
        if s == before:
            return s


def stable_key(common: str, unit: str) -> str:
    """Cut the common start of two lines back to where the value begins ("Customer: Ali" ->
    "Customer: ")."""
    # the mirror image of trimming a suffix: reversed, a cut word is one that goes on in ``unit``
    return trim_value_start(
        common[::-1], lambda r: len(r) < len(unit) and unit[len(r)].isalnum()
    )[::-1]


def common_suffix(values: list[str], judged: list[str] | None = None) -> str:
    """The end all values share, cut forward past value characters and words cut short in ``judged``
    (first 50)."""
    if len(values) < 2:
        return ""
    s = values[0]
    for v in values[1:]:
        if not (s := s[len(s) - len(commonprefix([s[::-1], v[::-1]])):]):
            return ""
    judged = values[:50] if judged is None else judged
    return trim_value_start(
        s, lambda s: any(len(v) > len(s) and v[-len(s) - 1].isalnum() for v in judged)
    )


def unit_bounds(text: str, s: int, e: int) -> tuple[int, int, str]:
    """The line holding chars [s, e) of ``text`` (the sentence(s), inside a line longer than
    LONG_LINE)."""
    s = max(0, min(s, len(text)))
    e = min(max(e, s + 1), max(len(text), s + 1))
    ls = text.rfind("\n", 0, s) + 1
    le = text.find("\n", e)
    le = len(text) if le < 0 else le
    if le - ls <= LONG_LINE:
        return ls, le, "line"
    line = text[ls:le]
    starts = [0] + [m.end() for m in re.finditer(r"[.!?]\s+", line)]
    ends = [m.start() + 1 for m in re.finditer(r"[.!?](\s+|$)", line)] + [len(line)]
    ss = max((x for x in starts if ls + x <= s), default=0)
    ee = min((x for x in ends if ls + x >= e), default=len(line))
    return ls + ss, ls + ee, "sentence"


@dataclass
class Finding:
    """One difference between a request and its partner that breaks a shared prefix."""

    kind: str  # slot | whitespace | template | order | tools | span
    a: int
    b: int
    token_pos: int  # where the difference starts in request a (tokens)
    role: str | None = None
    index: int | None = None
    text_a: str = ""  # the differing text of a (the whole line for a slot)
    text_b: str = ""
    key: str = ""
    level: str = "line"
    # prefix: the line starts with key; after: the line after the line == key
    anchor: str = "prefix"
    suffix: str = ""
    value_a: str = ""
    value_b: str = ""
    run: int = 0  # tokens equal again after the difference
    items_a: list[str] = field(default_factory=list)
    items_b: list[str] = field(default_factory=list)
    sep: str = ""
    right: str = ""  # token-id logs: the tokens right after the span


def by_key(
    findings: list[Finding], kind: str, key: Callable[[Finding], tuple | None]
) -> dict[tuple, list[Finding]]:
    """Findings of one kind grouped by ``key`` (None leaves a finding out), in the order first
    found."""
    groups: dict[tuple, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind == kind and (k := key(f)) is not None:
            groups[k].append(f)
    return groups


def realign(
    A: str, B: str, pa: int, pb: int, window: int = WINDOW, m: int = MIN_RUN
) -> tuple[int, int, int] | None:
    """Smallest (a, b) such that A[pa+a:] and B[pb+b:] agree again for >= m tokens; with that run
    length."""
    grams: dict[str, list[int]] = {}
    for b in range(min(window, len(B) - pb - m + 1)):
        grams.setdefault(B[pb + b: pb + b + m], []).append(b)
    for a in range(min(window, len(A) - pa - m + 1)):
        for b in grams.get(A[pa + a: pa + a + m], ()):
            if (a or b) and (run := lcp(A[pa + a:], B[pb + b:])) >= m:
                return a, b, run
    return None


def _char_at(off: list[tuple[int, int]], t: int, text: str) -> int:
    return off[t][0] if t < len(off) else len(text)


def _token_at(ends: list[int], c: int) -> int:
    """Index of the token holding char ``c`` (the first token that ends after it)."""
    return bisect_right(ends, c)


def _seg_at(segs: list[Segment], c: int) -> Segment | None:
    return next((s for s in segs if s.start <= c < s.end or s.start == s.end == c), None)


def _permutation(
    ca: str, la: int, cb: str, lb: int
) -> tuple[str, list[str], list[str], int, int] | None:
    """Paragraphs (or lines) from the one holding la/lb on that are the same multiset in another
    order."""
    for sep in ("\n\n", "\n"):
        sa, sb = ca.rfind(sep, 0, la), cb.rfind(sep, 0, lb)
        # where the item holding la / lb starts
        sa, sb = (0 if j < 0 else j + len(sep) for j in (sa, sb))
        ia, ib = ca[sa:].split(sep)[:24], cb[sb:].split(sep)[:24]
        for w in range(2, min(len(ia), len(ib)) + 1):
            if not ia[w - 1].strip() or not ib[w - 1].strip():
                break  # a blank item: whitespace, not order
            if ia[:w] != ib[:w] and Counter(ia[:w]) == Counter(ib[:w]):
                return sep, ia[:w], ib[:w], sa + len(sep.join(ia[:w])), sb + len(sep.join(ib[:w]))
    return None


def scan_pairs(
    prep: Prepared,
    div: Divergence,
    enc: PromptEncoder | None,
    sample: int = 400,
    seed: int = 0,
    min_run: int = MIN_RUN,
) -> tuple[list[Finding], dict]:
    """Diff a sample of requests against their partners; return the findings and what was
    scanned."""
    cand = [i for i, (d, p) in enumerate(zip(div.position, div.partner))
            if p >= 0 and d < min(len(prep.tokens[i]), len(prep.tokens[p])) - 1]
    chosen = cand
    if len(cand) > sample:
        # every divergence position once (its earliest request: rare positions are where rare
        # culprits are), then a uniform sample of the rest
        first_at = {div.position[i]: i for i in reversed(cand)}  # reversed: the earliest wins
        rare = sorted(first_at.values(), key=lambda i: div.position[i])[: sample // 2]
        rest = sorted(set(cand) - set(rare))
        chosen = sorted(
            set(rare) | set(random.Random(seed).sample(rest, min(len(rest), sample - len(rare))))
        )
    text_ids = sorted({j for i in chosen for j in (i, div.partner[i]) if prep.texts[j] is not None})
    # request -> (char offsets, token ends)
    offsets: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}
    mismatched = 0
    if text_ids and enc is not None:
        encoded = enc.encode_with_offsets([prep.texts[j] for j in text_ids])
        for j, (toks, off) in zip(text_ids, encoded):
            pre = len(prep.tokens[j]) - len(toks)  # a plain prompt's BOS is not in the text
            if pre < 0 or prep.tokens[j][pre:] != toks:
                mismatched += 1
                continue
            off = [(0, 0)] * pre + list(off)
            offsets[j] = (off, [e for _, e in off])
    findings: list[Finding] = []
    for i in chosen:
        p = div.partner[i]
        if prep.texts[i] is None or prep.texts[p] is None:
            findings.extend(_scan_tokens(prep, i, p, div.position[i], min_run))
        elif i in offsets and p in offsets:
            findings.extend(
                _scan_text(prep, i, p, div.position[i], offsets[i], offsets[p], min_run)
            )
    return findings, {
        "candidates": len(cand),
        "scanned": len(chosen),
        "offset_mismatch": mismatched,
    }


def _scan_tokens(prep: Prepared, i: int, p: int, d: int, min_run: int) -> list[Finding]:
    A, B = prep.tokens[i], prep.tokens[p]
    pa = pb = d
    out = []
    for _ in range(MAX_STEPS):
        r = realign(A, B, pa, pb, m=min_run) if pa < len(A) and pb < len(B) else None
        if r is None:
            break
        a, b, run = r
        out.append(Finding("span", i, p, pa, key=A[max(0, pa - min_run):pa], value_a=A[pa:pa + a],
                           value_b=B[pb:pb + b], right=A[pa + a:pa + a + min_run], run=run))
        pa, pb = pa + a + run, pb + b + run
    return out


def _scan_text(prep: Prepared, i: int, p: int, d: int, oa, ob, min_run: int) -> list[Finding]:
    A, B = prep.tokens[i], prep.tokens[p]
    TA, TB = prep.texts[i], prep.texts[p]
    (offA, endsA), (offB, endsB) = oa, ob
    segsA, segsB = prep.segments[i], prep.segments[p]
    pa = pb = d
    out: list[Finding] = []
    for _ in range(MAX_STEPS):
        if pa >= len(A) or pb >= len(B):
            break
        ca, cb = _char_at(offA, pa, TA), _char_at(offB, pb, TB)
        k = lcp(TA[ca:ca + 400], TB[cb:cb + 400])
        ca, cb = ca + k, cb + k  # the first differing characters
        sa, sb = _seg_at(segsA, ca), _seg_at(segsB, cb)
        in_tools = any(s is not None and s.tools_from is not None and c >= s.tools_from
                       for s, c in ((sa, ca), (sb, cb)))
        if in_tools or (
            (sa is None or sb is None)
            and prep.records[i].tools
            and prep.records[p].tools
            and _tool_names(prep.records[i]) != _tool_names(prep.records[p])
        ):
            out.append(
                Finding(
                    "tools",
                    i,
                    p,
                    pa,
                    text_a=_shorten(TA[ca : ca + 80]),
                    text_b=_shorten(TB[cb : cb + 80]),
                )
            )
            break
        if sa is not None and sb is not None and (sa.role, sa.index) == (sb.role, sb.index):
            perm = _permutation(
                TA[sa.start : sa.end], ca - sa.start, TB[sb.start : sb.end], cb - sb.start
            )
            if perm is not None:
                sep, ia, ib, ea, eb = perm
                out.append(
                    Finding("order", i, p, pa, sa.role, sa.index, items_a=ia, items_b=ib, sep=sep)
                )
                pa, pb = _token_at(endsA, sa.start + ea), _token_at(endsB, sb.start + eb)
                run = lcp(A[pa:], B[pb:])
                pa, pb = pa + run, pb + run
                continue
            if sa.role not in SYSTEM_ROLES and sa.role != "prompt":
                # conversation content: the multi-turn check looks at it, not the field finder
                break
        if (r := realign(A, B, pa, pb, m=min_run)) is None:
            break
        a, b, run = r
        ea, eb = max(_char_at(offA, pa + a, TA), ca), max(_char_at(offB, pb + b, TB), cb)
        da, db = TA[ca:ea], TB[cb:eb]
        tok, context = (
            _token_at(endsA, ca),
            (TA[max(0, ca - 30) : ea + 30], TB[max(0, cb - 30) : eb + 30]),
        )
        if _same_line(out, sa, TA, ca):
            pass  # the same line again (its value had a common piece): one finding
        elif re.sub(r"\s+", "", da) == re.sub(r"\s+", "", db):
            where = (sa.role, sa.index) if sa else (None, None)
            out.append(Finding("whitespace", i, p, tok, *where, *context, run=run))
        elif sa is None or sb is None or (sa.role, sa.index) != (sb.role, sb.index):
            if max(len(da), len(db)) > 40:
                # content on one side, markup on the other: different messages, not a template
                # difference
                break
            out.append(Finding("template", i, p, tok, None, None, *context, run=run))
        else:
            out.extend(
                _describe_slot(
                    Finding("slot", i, p, tok, run=run), TA, TB, sa, sb, ca, ea, cb, eb, endsA
                )
            )
        pa, pb = pa + a + run, pb + b + run
    return out


def _same_line(out: list[Finding], seg: Segment | None, text: str, c: int) -> bool:
    """Whether char ``c`` of ``text`` is in the line of the slot found last."""
    last = out[-1] if out else None
    if (
        last is None
        or last.kind != "slot"
        or seg is None
        or (last.role, last.index) != (seg.role, seg.index)
    ):
        return False
    at = text.find(last.text_a, seg.start)
    return bool(last.text_a) and at <= c < at + len(last.text_a)


def _line_before(content: str, pos: int) -> str:
    """The line that ends just before ``pos`` ("" at the start)."""
    return content[:pos].rstrip("\n").rsplit("\n", 1)[-1] if pos else ""


def _describe_slot(
    f: Finding,
    TA: str,
    TB: str,
    sa: Segment,
    sb: Segment,
    ca: int,
    ea: int,
    cb: int,
    eb: int,
    endsA: list[int],
) -> list[Finding]:
    """A slot's line(s), key, value and anchor: one finding per line that differs."""
    conA, conB = TA[sa.start:sa.end], TB[sb.start:sb.end]
    us, ue, level = unit_bounds(conA, ca - sa.start, ea - sa.start)
    vs, ve, _ = unit_bounds(conB, cb - sb.start, eb - sb.start)
    la, lb = conA[us:ue].split("\n"), conB[vs:ve].split("\n")
    if level != "line" or len(la) != len(lb):
        la, lb = [conA[us:ue]], [conB[vs:ve]]  # one finding for the whole unit
    # a coarse tokenizer may need several lines to line up again: one finding per line that differs
    out, off = [], 0
    for x, y in zip(la, lb):
        if x != y or len(la) == 1:
            g = Finding("slot", f.a, f.b, f.token_pos, run=f.run)
            _describe_line(
                g,
                sa,
                x,
                y,
                us + off,
                _line_before(conA, us + off),
                _line_before(conB, vs + off),
                level,
                endsA,
            )
            out.append(g)
        off += len(x) + 1
    return out


def _describe_line(
    f: Finding,
    sa: Segment,
    ua: str,
    ub: str,
    us: int,
    prev_a: str,
    prev_b: str,
    level: str,
    endsA: list[int],
) -> None:
    key = stable_key(ua[:lcp(ua, ub)], ua)
    va, vb = ua[len(key):], ub[len(key):]
    suffix = common_suffix([va, vb], [va]) if len(key) < min(len(ua), len(ub)) else ""
    f.role, f.index, f.level, f.suffix = sa.role, sa.index, level, suffix
    f.text_a, f.text_b = ua, ub
    f.value_a, f.value_b = va[:len(va) - len(suffix)], vb[:len(vb) - len(suffix)]
    f.token_pos = _token_at(endsA, sa.start + us + len(key))
    if len(key.strip()) >= 3:
        f.key, f.anchor = key, "prefix"
    # the line is all value: anchor it on the line before
    elif prev_a and prev_a == prev_b and level == "line":
        f.key, f.anchor = prev_a, "after"
    else:
        f.key, f.anchor = "", "none"


def _tool_names(rec: Record) -> tuple[str, ...]:
    return tuple(tool_name(t, json.dumps(t, sort_keys=True)) for t in (rec.tools or []))
