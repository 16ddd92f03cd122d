"""Find why prompts stop sharing, and rewrite the log so they would.

**Diffing prompts that share a template.** For a sample of requests, take the earlier request it
matched longest (its partner, ``kvlab.doctor.divergence``) and walk both from the divergence point:
find where they line up again (the first run of ``MIN_RUN`` equal tokens within ``WINDOW`` tokens), call
what lies between a *slot*, and continue after the re-aligned run. What a slot is comes from its text,
not from a list of regular expressions:

- whitespace only on both sides -> **whitespace**; outside any message (in the template's markup) ->
  **template**; inside the tools the doctor rendered -> **tools order**;
- the same paragraphs/lines in another order -> **order** (documents, tools, examples);
- otherwise the slot is a *field* of the line (or sentence) that holds it: the line's stable start
  (``stable_key``: "Customer: " of "Customer: Alice Zhang") names it; its values across the whole
  log, grouped by ``user`` and ``session``, say whether it is per user (names, ids), per conversation,
  or per request (timestamps, UUIDs, request ids, counters), and the value's shape labels it.

Other culprits are counted directly: multi-turn conversations whose history is rebuilt rather than
appended (``session``/``user`` fields), shared prefixes that end inside a block (alignment, prefixes
shorter than one block), and tenant salts (``--tenant-field``) that split a prefix all tenants send.

Every culprit carries a *fix*: a function that rewrites the records (move the volatile line to the end
of the last user message, sort the documents, normalise whitespace, render through one template, send
the full history, sort the tools) or the tokens (pad the shared prefix to a block boundary), or a
replay policy (the public-prefix salt). ``kvlab.doctor.core`` measures each one.
"""

from __future__ import annotations

import json
import random
import re
import statistics
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .divergence import Divergence, lcp
from .logio import Record
from .prepare import SYSTEM_ROLES, Prepared, Segment, parse_chatml
from .tokenize import PromptEncoder

MIN_RUN = 8  # tokens that must match again after a slot
WINDOW = 160  # tokens searched for the re-alignment (a slot's value is shorter than this)
MAX_STEPS = 8  # slots followed per pair
LONG_LINE = 240  # a longer line is split into sentences
MAX_FIELD_CHARS = 300  # a field's values are short (times, ids, names); longer ones are content

TIMESTAMP_RE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b\d{1,2}/\d{1,2}/\d{2,4}\b|"
                          r"\b(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b \d", re.I)
UUID_RE = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
ID_RE = re.compile(r"\b(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{5,}\b")


# --- small text helpers --------------------------------------------------------------------------------
def _value_char(ch: str) -> bool:
    return ch.isdigit() or ch in "-:./_+#@="


def stable_key(common: str, unit: str) -> str:
    """Cut the common start of two lines back to where the field's value begins.

    "Current time: 2024-05-03 14:2" -> "Current time: "; "Customer: Ali" (of "Customer: Alice") -> "Customer: ".
    """
    k = common
    while True:
        before = k
        while k and _value_char(k[-1]):
            k = k[:-1]
        if len(k) >= 2 and k[-1] == " " and (k[-2].isdigit()):
            k = k[:-1]
            continue
        nxt = unit[len(k)] if len(k) < len(unit) else ""
        if k and k[-1].isalnum() and nxt.isalnum():
            while k and k[-1].isalnum():
                k = k[:-1]
        if k == before:
            return k


def stable_suffix(a: str, b: str) -> str:
    """The common end of two values, cut forward past value characters (" UTC" of "...:11 UTC" / "...:40 UTC")."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    s = a[len(a) - n:] if n else ""
    while True:
        before = s
        while s and _value_char(s[0]):
            s = s[1:]
        if len(s) >= 2 and s[0] == " " and s[1].isdigit():
            s = s[1:]
            continue
        prev = a[len(a) - len(s) - 1] if len(s) < len(a) else ""
        if s and s[0].isalnum() and prev.isalnum():
            while s and s[0].isalnum():
                s = s[1:]
        if s == before:
            return s


def common_suffix(values: list[str]) -> str:
    """The end every value shares, cut forward past value characters and partial words."""
    if len(values) < 2:
        return ""
    s = values[0]
    for v in values[1:]:
        n = 0
        while n < min(len(s), len(v)) and s[len(s) - 1 - n] == v[len(v) - 1 - n]:
            n += 1
        s = s[len(s) - n:] if n else ""
        if not s:
            return ""
    return _trim_suffix(s, values)


def _trim_suffix(s: str, values: list[str]) -> str:
    while True:
        before = s
        while s and _value_char(s[0]):
            s = s[1:]
        if len(s) >= 2 and s[0] == " " and s[1].isdigit():
            s = s[1:]
            continue
        if s and s[0].isalnum() and any(len(v) > len(s) and v[len(v) - len(s) - 1].isalnum() for v in values[:50]):
            while s and s[0].isalnum():
                s = s[1:]
        if s == before:
            return s


def unit_bounds(text: str, s: int, e: int) -> tuple[int, int, str]:
    """The line holding chars [s, e) of ``text`` (the sentence(s), inside a line longer than LONG_LINE)."""
    s = max(0, min(s, len(text)))
    e = min(max(e, s + 1), max(len(text), s + 1))
    ls = text.rfind("\n", 0, s) + 1
    le = text.find("\n", e - 1 if e > s else s)
    le = len(text) if le < 0 else le
    if le < e:
        le2 = text.find("\n", e)
        le = len(text) if le2 < 0 else le2
    if le - ls <= LONG_LINE:
        return ls, le, "line"
    line = text[ls:le]
    starts = [0] + [m.end() for m in re.finditer(r"[.!?]\s+", line)]
    ends = [m.start() + 1 for m in re.finditer(r"[.!?](\s+|$)", line)] + [len(line)]
    ss = max((x for x in starts if ls + x <= s), default=0)
    ee = min((x for x in ends if ls + x >= e), default=len(line))
    return ls + ss, ls + ee, "sentence"


def normalize_ws(text: str) -> str:
    """CRLF -> LF, no trailing spaces on lines, at most one blank line in a row, no outer whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def label_values(values: list[str]) -> str:
    """What a volatile field's values look like: timestamp/date, UUID, id, counter, or text."""
    sample = [v for v in values if v][:200]
    if not sample:
        return "empty"

    def share(rx: re.Pattern) -> float:
        return sum(bool(rx.search(v)) for v in sample) / len(sample)

    if share(UUID_RE) > 0.5:
        return "UUID"
    if share(TIMESTAMP_RE) > 0.5:
        return "timestamp/date"
    if all(v.strip().isdigit() for v in sample):
        return "number/counter"
    if share(ID_RE) > 0.5:
        return "id"
    return "text"


def _shorten(s: str, n: int = 90) -> str:
    s = s.replace("\n", "⏎")
    return s if len(s) <= n else s[: n - 1] + "…"


# --- record segments (what a sender controls) -------------------------------------------------------
def record_segments(rec: Record) -> list[tuple[str, int, str]]:
    """(role, index, content) of each message (parsed back from a ChatML prompt; a plain prompt is one)."""
    if rec.kind == "messages":
        return [(m["role"], i, m["content"]) for i, m in enumerate(rec.messages)]
    if rec.kind == "prompt":
        parsed = parse_chatml(rec.prompt)
        if parsed:
            return [(role, i, rec.prompt[s:e]) for i, (role, s, e) in enumerate(parsed)]
        return [("prompt", 0, rec.prompt)]
    return []


def _tail_insert(prompt: str, text: str) -> str:
    """Put ``text`` at the end of a plain prompt, before a trailing chat-markup tail if there is one."""
    marks = list(re.finditer(r"<\|[a-z_]+\|>|\[/?INST\]", prompt))
    m = marks[-1] if marks else None
    if m is not None and len(prompt) - m.start() <= 64:
        return prompt[: m.start()] + text + "\n" + prompt[m.start():]
    return prompt.rstrip("\n") + "\n\n" + text + ("\n" if prompt.endswith("\n") else "")


def with_contents(rec: Record, contents: list[str], prepend_user: str = "") -> Record:
    """A copy of ``rec`` whose segments hold ``contents``; ``prepend_user`` goes before the last user message."""
    segs = record_segments(rec)
    contents = list(contents)
    if prepend_user:
        users = [j for j, (role, _, _) in enumerate(segs) if role == "user"]
        if users:
            j = users[-1]
            contents[j] = prepend_user + "\n\n" + contents[j]
            prepend_user = ""
    if rec.kind == "messages":
        msgs = [dict(m, content=c) for m, c in zip(rec.messages, contents)]
        if prepend_user:  # no user message: the context becomes its own user message before generation
            msgs.append({"role": "user", "content": prepend_user})
        return rec.replace(messages=msgs)
    if rec.kind == "prompt":
        parsed = parse_chatml(rec.prompt)
        if parsed:
            text = rec.prompt
            for (_, s, e), c in reversed(list(zip(parsed, contents))):
                text = text[:s] + c + text[e:]
        else:
            text = contents[0]
        if prepend_user:
            text = _tail_insert(text, prepend_user)
        return rec.replace(prompt=text)
    return rec


# --- findings from diffing pairs ------------------------------------------------------------------------
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
    anchor: str = "prefix"  # prefix: the line starts with key; after: the line after the line == key
    suffix: str = ""
    value_a: str = ""
    value_b: str = ""
    run: int = 0  # tokens equal again after the difference
    items_a: list[str] = field(default_factory=list)
    items_b: list[str] = field(default_factory=list)
    sep: str = ""
    right: str = ""  # token-id logs: the tokens right after the span


def realign(A: str, B: str, pa: int, pb: int, window: int = WINDOW, m: int = MIN_RUN) -> tuple[int, int, int] | None:
    """Smallest (a, b) such that A[pa+a:] and B[pb+b:] agree again for >= m tokens; with that run length."""
    grams: dict[str, list[int]] = {}
    for b in range(min(window, len(B) - pb - m + 1)):
        grams.setdefault(B[pb + b: pb + b + m], []).append(b)
    for a in range(min(window, len(A) - pa - m + 1)):
        for b in grams.get(A[pa + a: pa + a + m], ()):
            if a == 0 and b == 0:
                continue
            run = lcp(A[pa + a:], B[pb + b:])
            if run >= m:
                return a, b, run
    return None


def _char_at(off: list[tuple[int, int]], t: int, text: str) -> int:
    return off[t][0] if t < len(off) else len(text)


def _token_at(ends: list[int], c: int) -> int:
    """Index of the token holding char ``c`` (the first token that ends after it)."""
    return bisect_right(ends, c)


def _seg_at(segs: list[Segment], c: int) -> Segment | None:
    for s in segs:
        if s.start <= c < s.end or (s.start == s.end == c):
            return s
    return None


def _seg_like(segs: list[Segment], role: str, index: int | None) -> Segment | None:
    for s in segs:
        if s.role == role and s.index == index:
            return s
    return None


def _permutation(ca: str, la: int, cb: str, lb: int) -> tuple[str, list[str], list[str], int, int] | None:
    """Paragraphs (or lines) from the one holding la/lb on that are the same multiset in another order."""
    for sep in ("\n\n", "\n"):
        sa = ca.rfind(sep, 0, la)
        sa = 0 if sa < 0 else sa + len(sep)
        sb = cb.rfind(sep, 0, lb)
        sb = 0 if sb < 0 else sb + len(sep)
        ia, ib = ca[sa:].split(sep)[:24], cb[sb:].split(sep)[:24]
        for w in range(2, min(len(ia), len(ib)) + 1):
            if not ia[w - 1].strip() or not ib[w - 1].strip():
                break  # a blank item: whitespace, not order
            if ia[:w] != ib[:w] and Counter(ia[:w]) == Counter(ib[:w]):
                return sep, ia[:w], ib[:w], sa + len(sep.join(ia[:w])), sb + len(sep.join(ib[:w]))
    return None


def scan_pairs(prep: Prepared, div: Divergence, enc: PromptEncoder | None, sample: int = 400, seed: int = 0,
               min_run: int = MIN_RUN) -> tuple[list[Finding], dict]:
    """Diff a sample of requests against their partners; return the findings and what was scanned."""
    n = len(prep.tokens)
    cand = [i for i in range(n) if div.partner[i] >= 0
            and div.position[i] < min(len(prep.tokens[i]), len(prep.tokens[div.partner[i]])) - 1]
    rng = random.Random(seed)
    if len(cand) > sample:
        # every divergence position once (its earliest request: rare positions are where rare culprits are),
        # then a uniform sample of the rest
        first_at: dict[int, int] = {}
        for i in cand:
            first_at.setdefault(div.position[i], i)
        rare = sorted(first_at.values(), key=lambda i: div.position[i])[: sample // 2]
        rest = sorted(set(cand) - set(rare))
        chosen = sorted(set(rare) | set(rng.sample(rest, min(len(rest), sample - len(rare)))))
    else:
        chosen = cand
    text_ids = sorted({j for i in chosen for j in (i, div.partner[i]) if prep.texts[j] is not None})
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
            findings.extend(_scan_text(prep, i, p, div.position[i], offsets[i], offsets[p], min_run))
    return findings, {"candidates": len(cand), "scanned": len(chosen), "offset_mismatch": mismatched}


def _scan_tokens(prep: Prepared, i: int, p: int, d: int, min_run: int) -> list[Finding]:
    A, B = prep.tokens[i], prep.tokens[p]
    pa = pb = d
    out = []
    for _ in range(MAX_STEPS):
        if pa >= len(A) or pb >= len(B):
            break
        r = realign(A, B, pa, pb, m=min_run)
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
        if in_tools or ((sa is None or sb is None) and prep.records[i].tools and prep.records[p].tools
                        and _tool_names(prep.records[i]) != _tool_names(prep.records[p])):
            out.append(Finding("tools", i, p, pa, text_a=_shorten(TA[ca:ca + 80]), text_b=_shorten(TB[cb:cb + 80])))
            break
        if sa is not None and sb is not None and (sa.role, sa.index) == (sb.role, sb.index):
            ca_, cb_ = TA[sa.start:sa.end], TB[sb.start:sb.end]
            perm = _permutation(ca_, ca - sa.start, cb_, cb - sb.start)
            if perm is not None:
                sep, ia, ib, ea, eb = perm
                out.append(Finding("order", i, p, pa, sa.role, sa.index, items_a=ia, items_b=ib, sep=sep))
                pa, pb = _token_at(endsA, sa.start + ea), _token_at(endsB, sb.start + eb)
                run = lcp(A[pa:], B[pb:])
                pa, pb = pa + run, pb + run
                continue
            if sa.role not in SYSTEM_ROLES and sa.role != "prompt":
                break  # conversation content: the multi-turn check looks at it, not the field finder
        r = realign(A, B, pa, pb, m=min_run)
        if r is None:
            break
        a, b, run = r
        ea, eb = _char_at(offA, pa + a, TA), _char_at(offB, pb + b, TB)
        ea, eb = max(ea, ca), max(eb, cb)
        da, db = TA[ca:ea], TB[cb:eb]
        f = Finding("slot", i, p, _token_at(endsA, ca), run=run)
        if out and out[-1].kind == "slot" and sa is not None and out[-1].role == sa.role and out[-1].index == sa.index \
                and out[-1].text_a and TA.find(out[-1].text_a, sa.start) <= ca < TA.find(out[-1].text_a, sa.start) + len(out[-1].text_a):
            pa, pb = pa + a + run, pb + b + run  # the same line again (its value had a common piece): one finding
            continue
        if re.sub(r"\s+", "", da) == re.sub(r"\s+", "", db):
            f.kind, f.text_a, f.text_b = "whitespace", TA[max(0, ca - 30):ea + 30], TB[max(0, cb - 30):eb + 30]
            f.role, f.index = (sa.role, sa.index) if sa else (None, None)
        elif sa is None or sb is None or (sa.role, sa.index) != (sb.role, sb.index):
            if max(len(da), len(db)) > 40:
                break  # content on one side, markup on the other: different messages, not a template difference
            f.kind, f.text_a, f.text_b = "template", TA[max(0, ca - 30):ea + 30], TB[max(0, cb - 30):eb + 30]
        else:
            out.extend(_describe_slot(f, TA, TB, sa, sb, ca, ea, cb, eb, endsA))
            pa, pb = pa + a + run, pb + b + run
            continue
        out.append(f)
        pa, pb = pa + a + run, pb + b + run
    return out


def _describe_slot(f: Finding, TA: str, TB: str, sa: Segment, sb: Segment, ca: int, ea: int, cb: int, eb: int,
                   endsA: list[int]) -> list[Finding]:
    """A slot's line(s), key, value and anchor: one finding per line that differs.

    A coarse tokenizer may need more than one line to line up again (" UTC⏎Customer: " is too short a
    run); then the slot covers several lines, and lines that differ in both requests become one
    finding each.
    """
    conA, conB = TA[sa.start:sa.end], TB[sb.start:sb.end]
    us, ue, level = unit_bounds(conA, ca - sa.start, ea - sa.start)
    vs, ve, _ = unit_bounds(conB, cb - sb.start, eb - sb.start)
    ua, ub = conA[us:ue], conB[vs:ve]
    la, lb = ua.split("\n"), ub.split("\n")
    if level == "line" and len(la) == len(lb) > 1:
        out, off = [], 0
        for x, y in zip(la, lb):
            if x != y:
                g = Finding("slot", f.a, f.b, f.token_pos, run=f.run)
                prev_a = conA[:us + off].rstrip("\n").rsplit("\n", 1)[-1] if us + off else ""
                prev_b = conB[:vs + off].rstrip("\n").rsplit("\n", 1)[-1] if vs + off else ""
                _describe_line(g, sa, x, y, us + off, prev_a, prev_b, "line", endsA)
                out.append(g)
            off += len(x) + 1
        return out
    prev_a = conA[:us].rstrip("\n").rsplit("\n", 1)[-1] if us else ""
    prev_b = conB[:vs].rstrip("\n").rsplit("\n", 1)[-1] if vs else ""
    _describe_line(f, sa, ua, ub, us, prev_a, prev_b, level, endsA)
    return [f]


def _describe_line(f: Finding, sa: Segment, ua: str, ub: str, us: int, prev_a: str, prev_b: str, level: str,
                   endsA: list[int]) -> None:
    key = stable_key(ua[:lcp(ua, ub)], ua)
    suffix = stable_suffix(ua[len(key):], ub[len(key):]) if len(key) < min(len(ua), len(ub)) else ""
    f.role, f.index, f.level = sa.role, sa.index, level
    f.text_a, f.text_b = ua, ub
    f.value_a, f.value_b = ua[len(key):len(ua) - len(suffix)], ub[len(key):len(ub) - len(suffix)]
    f.suffix = suffix
    f.token_pos = _token_at(endsA, sa.start + us + len(key))
    if len(key.strip()) >= 3:
        f.key, f.anchor = key, "prefix"
    elif prev_a and prev_a == prev_b and level == "line":  # the line is all value: anchor it on the line before
        f.key, f.anchor = prev_a, "after"
    else:
        f.key, f.anchor = "", "none"


def _tool_names(rec: Record) -> tuple[str, ...]:
    return tuple(str((t.get("function") or {}).get("name", t.get("name", json.dumps(t, sort_keys=True))))
                 for t in (rec.tools or []))


# --- culprits -------------------------------------------------------------------------------------------
Fix = Callable[[list[Record]], list[Record]]


@dataclass
class Culprit:
    """A reason prompts stop sharing: what, where, the evidence, and the fix (measured later)."""

    kind: str  # volatile | per-user | per-session | order | tools-order | whitespace | template | multi-turn | alignment | tenant-salt
    title: str
    position: int | None  # typical token position where it breaks the shared prefix
    where: str
    evidence: list[str]
    fix_text: str
    affected: int  # requests it touches
    fix: Fix | None = None  # rewrites the records
    token_fix: Callable[[Prepared], Prepared] | None = None  # rewrites the tokens (alignment)
    policy: str | None = None  # "public-prefix" for the tenant culprit
    examples: list[tuple[str, str]] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    alone: dict | None = None  # measured: this fix on the original log
    chained: dict | None = None  # measured: this fix after the ones before it
    before: dict | None = None  # measured: the log just before this fix (in the chain)
    no_effect: bool = False  # measured, and it changed nothing worth reporting: not a culprit of this log
    fixed_log: str | None = None

    @property
    def measurable(self) -> bool:
        """Whether the doctor can re-measure the log with this fix."""
        return self.fix is not None or self.token_fix is not None or self.policy is not None


@dataclass
class FieldPattern:
    """A line (or sentence) of one message that carries a field: how to find it in any request."""

    role: str
    index: int | None
    key: str
    anchor: str  # prefix | after
    level: str
    suffix: str

    def locate(self, content: str) -> tuple[int, int] | None:
        """Char span of the field's line in a message's content, or None."""
        if self.anchor == "after":
            pos = 0
            while True:
                j = content.find(self.key + "\n", pos)
                if j < 0:
                    return None
                if j == 0 or content[j - 1] == "\n":
                    s = j + len(self.key) + 1
                    e = content.find("\n", s)
                    return s, len(content) if e < 0 else e
                pos = j + 1
        pos = 0
        while True:
            j = content.find(self.key, pos)
            if j < 0:
                return None
            if self.level == "sentence" or j == 0 or content[j - 1] == "\n":
                break
            pos = j + 1
        if self.level == "line":
            e = content.find("\n", j)
            return j, len(content) if e < 0 else e
        m = re.compile(r"[.!?](\s|$)").search(content, j + len(self.key))
        nl = content.find("\n", j)
        e = m.start() + 1 if m else len(content)
        if 0 <= nl < e:
            e = nl
        return j, e

    def value(self, content: str) -> str | None:
        """The field's value in a message's content, or None."""
        span = self.locate(content)
        if span is None:
            return None
        line = content[span[0]:span[1]]
        if self.anchor == "prefix":
            line = line[len(self.key):]
        if self.suffix and line.endswith(self.suffix):
            line = line[: len(line) - len(self.suffix)]
        return line

    def matches(self, role: str, index: int) -> bool:
        """Whether a segment is the one this field lives in."""
        return role == self.role and (self.index is None or index == self.index)


def move_fields(records: list[Record], patterns: list[FieldPattern]) -> list[Record]:
    """Move each field's line out of its message into the start of the last user message."""
    out = []
    for rec in records:
        segs = record_segments(rec)
        if not segs:
            out.append(rec)
            continue
        contents = [c for _, _, c in segs]
        moved = []
        for pat in patterns:
            for j, (role, idx, _) in enumerate(segs):
                if not pat.matches(role, idx):
                    continue
                span = pat.locate(contents[j])
                if span is None:
                    continue
                s, e = span
                c = contents[j]
                moved.append(c[s:e].strip())
                if e < len(c) and c[e] == "\n":
                    e += 1
                elif s > 0 and c[s - 1] == "\n":
                    s -= 1
                contents[j] = c[:s] + c[e:]
        out.append(with_contents(rec, contents, "\n".join(m for m in moved if m)) if moved else rec)
    return out


def sort_items(records: list[Record], role: str, index: int | None, sep: str, prefix: str) -> list[Record]:
    """Sort every run of consecutive items (paragraphs/lines) that start with ``prefix`` in one message."""
    out = []
    for rec in records:
        segs = record_segments(rec)
        changed = False
        contents = []
        for r, idx, c in segs:
            if r == role and (index is None or idx == index) and prefix in c:
                items = c.split(sep)
                j = 0
                while j < len(items):
                    if items[j].startswith(prefix):
                        k = j
                        while k < len(items) and items[k].startswith(prefix):
                            k += 1
                        if k - j > 1:
                            items[j:k] = sorted(items[j:k])
                        j = k
                    else:
                        j += 1
                new = sep.join(items)
                changed |= new != c
                contents.append(new)
            else:
                contents.append(c)
        out.append(with_contents(rec, contents) if changed else rec)
    return out


def normalize_records(records: list[Record]) -> list[Record]:
    """Whitespace-normalise every message (``normalize_ws``)."""
    out = []
    for rec in records:
        segs = record_segments(rec)
        contents = [normalize_ws(c) for _, _, c in segs]
        out.append(with_contents(rec, contents) if contents != [c for _, _, c in segs] else rec)
    return out


def rerender_chatml(records: list[Record]) -> list[Record]:
    """Hand-rendered ChatML prompts -> chat records, so the one chat template renders every request."""
    out = []
    for rec in records:
        if rec.kind == "prompt":
            parsed = parse_chatml(rec.prompt)
            if parsed and parsed[-1][0] == "user" and re.search(r"<\|im_start\|>\s*assistant\s*$", rec.prompt):
                msgs = [{"role": role, "content": rec.prompt[s:e]} for role, s, e in parsed]
                out.append(Record(rec.line, "messages", messages=msgs, meta=dict(rec.meta)))
                continue
        out.append(rec)
    return out


def sort_tools(records: list[Record]) -> list[Record]:
    """Send tools in one order (by name)."""
    def name(t: dict) -> str:
        return str((t.get("function") or {}).get("name", t.get("name", "")))

    out = []
    for rec in records:
        if rec.tools and [name(t) for t in rec.tools] != sorted(name(t) for t in rec.tools):
            out.append(rec.replace(tools=sorted(rec.tools, key=name)))
        else:
            out.append(rec)
    return out


def conversation_key(rec: Record) -> object | None:
    """Which conversation a chat record belongs to: its ``session``, else its user and first user message."""
    if rec.kind != "messages":
        return None
    if rec.get("session") is not None:
        return ("session", str(rec.get("session")))
    first = next((m["content"] for m in rec.messages if m["role"] == "user"), None)
    if first is None:
        return None
    return ("user+first", str(rec.get("user")), first)


def _history(rec: Record) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in rec.messages if m["role"] not in SYSTEM_ROLES]


def append_histories(records: list[Record]) -> list[Record]:
    """Rebuild every conversation so each turn re-sends the full history of the previous one, then the new messages."""
    full: dict[object, list[dict]] = {}
    last: dict[object, list[tuple[str, str]]] = {}
    out = []
    for rec in records:
        key = conversation_key(rec)
        if key is None:
            out.append(rec)
            continue
        hist = [m for m in rec.messages if m["role"] not in SYSTEM_ROLES]
        system = [m for m in rec.messages if m["role"] in SYSTEM_ROLES]
        h = [(m["role"], m["content"]) for m in hist]
        if key not in full:
            new = [dict(m) for m in hist]
        else:
            prev = last[key]
            if h[: len(prev)] == prev:  # already append-only
                tail = hist[len(prev):]
            else:
                j = None
                if prev:
                    for t in range(len(h) - 1, -1, -1):
                        if h[t] == prev[-1]:
                            j = t + 1
                            break
                if j is None:
                    j = len(h) - (2 if len(h) >= 2 and h[-2][0] == "assistant" else 1)
                tail = hist[j:]
            new = full[key] + [dict(m) for m in tail]
        full[key] = new
        last[key] = h
        out.append(rec.replace(messages=[dict(m) for m in system] + [dict(m) for m in new]))
    return out


# --- from findings to culprits ---------------------------------------------------------------------------
def _where(role: str | None, index: int | None) -> str:
    if role is None:
        return "chat-template markup"
    if role == "prompt":
        return "the prompt"
    return f"the {role} message" + (f" (messages[{index}])" if index is not None else "")


def _line_no(prep: Prepared, pat: FieldPattern) -> int | None:
    for rec in prep.records:
        for role, idx, c in record_segments(rec):
            if pat.matches(role, idx):
                span = pat.locate(c)
                if span:
                    return c.count("\n", 0, span[0]) + 1
    return None


def field_culprits(prep: Prepared, findings: list[Finding], min_count: int = 2, tenants: list | None = None,
                   max_fields: int = 10) -> list[Culprit]:
    """Group slot findings by the line they live in; classify each field by its values over the whole log.

    Keys that extend a shorter key of the same message ("Customer: Sven" / "Customer: ") are merged into it.
    A field must show up in at least ``min_count`` pairs and 5 % of the pairs scanned; fields whose value
    is constant per tenant are tenant content, not culprits (the tenant check covers sharing across tenants).
    """
    by_key: dict[tuple, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind == "slot" and f.anchor in ("prefix", "after"):
            by_key[(f.role, f.index, f.anchor, f.key)].append(f)
    groups: dict[tuple, list[Finding]] = {}
    for k, fs in by_key.items():  # one level per key: the more common one
        groups[(*k, Counter(f.level for f in fs).most_common(1)[0][0])] = fs
    for g in sorted(groups, key=lambda g: len(g[3])):
        for h in list(groups):
            if h != g and h[:3] == g[:3] and h[4] == g[4] and h in groups and g in groups \
                    and len(g[3].strip()) >= 3 and h[3].startswith(g[3]) and len(h[3]) > len(g[3]):
                groups[g].extend(groups.pop(h))
    scanned = len({(f.a, f.b) for f in findings})
    need = max(min_count, int(0.05 * scanned))
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    out = []
    for (role, index, anchor, key, level), fs in ranked:
        if len(fs) < need or len(out) >= max_fields:
            continue
        pat = FieldPattern(role, index, key, anchor, level, "")
        lines = [v for rec in prep.records[:2000] for r, idx, c in record_segments(rec)
                 if pat.matches(r, idx) for v in [pat.value(c)] if v is not None]
        pat.suffix = common_suffix(lines)
        values, users, sessions, owners = [], [], [], []
        for k, rec in enumerate(prep.records):
            for r, idx, c in record_segments(rec):
                if pat.matches(r, idx):
                    v = pat.value(c)
                    if v is not None:
                        values.append(v)
                        users.append(rec.get("user"))
                        sessions.append(rec.get("session"))
                        owners.append(tenants[k] if tenants is not None else None)
                    break
        if len(set(values)) < 2:
            continue
        if statistics.median(map(len, values)) > MAX_FIELD_CHARS:
            continue  # that long is the request's content, not a field in it
        if tenants is not None and _constant_share(values, owners)[0] >= 0.9:
            continue  # one value per tenant: the tenant's own content
        kind, scope = _scope(values, users, sessions)
        label = label_values(values)
        name = key.strip() or f"line after {key!r}"
        what = {"per-user": "per-user field", "per-session": "per-conversation field", "volatile": "per-request field"}[kind]
        if kind == "per-user" and label in ("text", "id"):
            label = "user name/id" if label == "text" else "user id"
        position = int(statistics.median(f.token_pos for f in fs))
        ex = fs[0]
        c = Culprit(
            kind, f"{what} ({label}) in {_where(role, index)}: {_shorten(name, 40)!s}", position,
            f"{_where(role, index)}, line {_line_no(prep, pat)}",
            [f"{len(values)} requests carry this line; {len(set(values))} distinct values ({scope})",
             "examples: " + "; ".join(repr(v) for v in list(dict.fromkeys(values))[:3]),
             f"found by diffing {len(fs)} request pairs that share the template; value starts at token ~{position}"],
            f"move the line {_shorten(name, 40)!r}... out of {_where(role, index)} to the start of the last user message",
            len(values), fix=lambda recs, pat=pat: move_fields(recs, [pat]),
            examples=[(ex.text_a, ex.text_b)],
            details={"pattern": pat, "label": label, "distinct": len(set(values)), "values": values[:5],
                     "pairs": len(fs)})
        out.append(c)
    return out


def _constant_share(values: list[str], keys: list) -> tuple[float, int, int]:
    """Share of groups (with >= 2 requests) in which the value never changes; groups; groups with >= 2."""
    by: dict = defaultdict(set)
    counts: Counter = Counter()
    for k, v in zip(keys, values):
        if k is not None:
            by[k].add(v)
            counts[k] += 1
    multi = [k for k in by if counts[k] >= 2]
    if len(by) < 2 or not multi:
        return 0.0, len(by), len(multi)
    return sum(len(by[k]) == 1 for k in multi) / len(multi), len(by), len(multi)


def _scope(values: list[str], users: list, sessions: list) -> tuple[str, str]:
    """per-user / per-session / volatile, with a sentence saying why."""
    def constant_within(keys: list) -> tuple[float, int, int]:
        return _constant_share(values, keys)

    share_u, n_u, multi_u = constant_within(users)
    if share_u >= 0.9 and n_u >= 2:
        return "per-user", f"the same value for all requests of {share_u:.0%} of the {multi_u} users with several requests"
    share_s, n_s, multi_s = constant_within(sessions)
    if share_s >= 0.9 and n_s >= 2:
        return "per-session", f"constant within {share_s:.0%} of {multi_s} conversations, different across them"
    return "volatile", (f"changes from request to request: {len(set(values))} values in {len(values)} requests"
                        + (f"; within one user it stays the same for only {share_u:.0%} of users" if multi_u else ""))


def order_culprits(prep: Prepared, findings: list[Finding], min_count: int = 2) -> list[Culprit]:
    """Same items (documents, examples) in another order: sort runs of items that share a header."""
    groups: dict[tuple, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind == "order":
            groups[(f.role, f.index, f.sep)].append(f)
    out = []
    for (role, index, sep), fs in groups.items():
        if len(fs) < min_count:
            continue
        items = [it for f in fs for it in f.items_a + f.items_b]
        common = items[0]
        for it in items[1:]:
            common = common[:lcp(common, it)]
        prefix = stable_key(common, items[0])
        ex = fs[0]
        unit = "paragraphs" if sep == "\n\n" else "lines"
        affected = sum(1 for rec in prep.records for r, idx, c in record_segments(rec)
                       if r == role and (index is None or idx == index) and prefix and c.count(prefix) >= 2)
        c = Culprit(
            "order", f"the same {unit} in varying order in {_where(role, index)}"
            + (f" (items starting {prefix!r})" if prefix else ""),
            int(statistics.median(f.token_pos for f in fs)), _where(role, index),
            [f"{len(fs)} of the diffed pairs hold the same {len(ex.items_a)} {unit} in another order",
             "request: " + " | ".join(_shorten(x, 40) for x in ex.items_a),
             "partner: " + " | ".join(_shorten(x, 40) for x in ex.items_b)],
            f"sort the {unit} that start with {prefix!r} (one canonical order, e.g. by id)" if prefix
            else f"send the {unit} in one canonical order (they share no header the doctor could sort by)",
            affected, fix=(lambda recs, r=role, i=index, s=sep, p=prefix: sort_items(recs, r, i, s, p)) if prefix else None,
            examples=[("\n".join(ex.items_a), "\n".join(ex.items_b))], details={"prefix": prefix, "sep": sep})
        out.append(c)
    return out


def hand_rendered(prep: Prepared, enc: PromptEncoder | None, limit: int = 2000) -> list[tuple[int, str, str]]:
    """Plain prompts that parse as ChatML but differ from the template's rendering of the same messages.

    Returns (token position of the first difference, the prompt around it, the template around it).
    """
    if enc is None:
        return []
    out = []
    for rec, ts in zip(prep.records, prep.tokens):
        if rec.kind != "prompt" or len(out) >= limit:
            continue
        conv = rerender_chatml([rec])[0]
        if conv.kind != "messages":
            continue
        try:
            text = enc.render(conv)
        except Exception:
            continue
        if text == rec.prompt:
            continue
        c = lcp(text, rec.prompt)
        tok = enc.encode([rec.prompt[:c]])[0]
        out.append((lcp(tok, ts), rec.prompt[max(0, c - 20):c + 20], text[max(0, c - 20):c + 20]))
    return out


def simple_culprits(prep: Prepared, findings: list[Finding], enc: PromptEncoder | None = None) -> list[Culprit]:
    """Whitespace, template and tools-order culprits from the findings (and the tools fields)."""
    out = []
    ws = [f for f in findings if f.kind == "whitespace"]
    if ws:
        ex = ws[0]
        affected = sum(1 for rec in prep.records if any(normalize_ws(c) != c for _, _, c in record_segments(rec)))
        out.append(Culprit(
            "whitespace", "whitespace differences in text that is otherwise shared",
            int(statistics.median(f.token_pos for f in ws)), _where(ex.role, ex.index),
            [f"{len(ws)} diffed pairs differ only in whitespace at that point",
             f"request: {ex.text_a!r}", f"partner: {ex.text_b!r}"],
            "normalise whitespace in every message (CRLF, trailing spaces, runs of blank lines, outer whitespace)",
            affected, fix=normalize_records, examples=[(ex.text_a, ex.text_b)]))
    tp = [f for f in findings if f.kind == "template"]
    hand = hand_rendered(prep, enc)
    if tp or hand:
        ex = (hand[0][1], hand[0][2]) if hand else (tp[0].text_a, tp[0].text_b)
        kinds = Counter(r.kind for r in prep.records)
        chatml_prompts = sum(1 for r in prep.records if r.kind == "prompt" and parse_chatml(r.prompt))
        fix = rerender_chatml if chatml_prompts else None
        positions = [f.token_pos for f in tp] + [pos for pos, _, _ in hand]
        ev = []
        if hand:
            ev.append(f"{len(hand)} hand-rendered ChatML prompts differ from what the chat template renders for the "
                      "same messages")
        if tp:
            ev.append(f"{len(tp)} diffed pairs differ outside any message's content")
        ev += [f"the prompt: {ex[0]!r}", f"the template: {ex[1]!r}" if hand else f"the earlier prompt: {ex[1]!r}",
               f"record kinds in the log: {dict(kinds)}"]
        out.append(Culprit(
            "template", "the chat markup differs between requests (hand-rendered prompts or another template)",
            int(statistics.median(positions)), "chat-template markup", ev,
            "render every request through the model's one chat template"
            + (f" ({chatml_prompts} hand-rendered ChatML prompts become chat records)" if fix else ""),
            chatml_prompts, fix=fix, examples=[ex]))
    with_tools = [r for r in prep.records if r.tools]
    if with_tools:
        orders: dict[frozenset, set] = defaultdict(set)
        for r in with_tools:
            names = _tool_names(r)
            orders[frozenset(names)].add(names)
        varying = {k: v for k, v in orders.items() if len(v) > 1}
        if varying:
            n_aff = sum(1 for r in with_tools if frozenset(_tool_names(r)) in varying)
            k, v = max(varying.items(), key=lambda kv: len(kv[1]))
            tf = [f for f in findings if f.kind == "tools"]
            ex = list(v)[:2]
            out.append(Culprit(
                "tools-order", "the same tools sent in varying order", int(statistics.median(f.token_pos for f in tf)) if tf else None,
                "the tools (rendered into the prompt)",
                [f"{n_aff} requests send one of {len(varying)} tool sets; the set of {len(k)} tools came in {len(v)} different orders",
                 "one order: " + ", ".join(ex[0]), "another:   " + ", ".join(ex[1])],
                "send the tools sorted by name", n_aff, fix=sort_tools, examples=[(", ".join(ex[0]), ", ".join(ex[1]))]))
    return out


def token_span_culprits(prep: Prepared, findings: list[Finding], min_count: int = 2) -> list[Culprit]:
    """Token-id logs: spans between the same left and right token context, moved to the end of the prompt."""
    groups: dict[tuple, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind == "span" and f.key and f.right:
            groups[(f.key, f.right)].append(f)
    out = []
    for (key, right), fs in groups.items():
        if len(fs) < min_count:
            continue
        values, users = [], []
        for rec, ts in zip(prep.records, prep.tokens):
            j = ts.find(key)
            if j < 0:
                continue
            e = ts.find(right, j + len(key), j + len(key) + WINDOW + len(right))
            if e < 0:
                continue
            values.append(ts[j + len(key):e])
            users.append(rec.get("user"))
        if len(set(values)) < 2:
            continue
        kind, scope = _scope(values, users, [None] * len(values))
        position = int(statistics.median(f.token_pos for f in fs))

        def fix(recs: list[Record], key=key, right=right) -> list[Record]:
            out_r = []
            for rec in recs:
                if rec.kind != "token_ids":
                    out_r.append(rec)
                    continue
                ts = "".join(map(chr, rec.token_ids))
                j = ts.find(key)
                e = ts.find(right, j + len(key), j + len(key) + WINDOW + len(right)) if j >= 0 else -1
                if j < 0 or e < 0:
                    out_r.append(rec)
                    continue
                s = j + len(key)
                new = ts[:s] + ts[e:] + ts[s:e]
                out_r.append(rec.replace(token_ids=[ord(c) for c in new]))
            return out_r

        out.append(Culprit(
            kind, f"a {'per-user' if kind == 'per-user' else 'varying'} token span at token ~{position}", position,
            "token ids", [f"{len(values)} requests hold a span between the same {len(key)} tokens before and "
                          f"{len(right)} after; {len(set(values))} distinct spans ({scope})",
                          f"example spans (ids): {[[ord(c) for c in v][:8] for v in list(dict.fromkeys(values))[:2]]}"],
            "move the span to the end of the prompt", len(values), fix=fix))
    return out


def multiturn_culprit(prep: Prepared) -> Culprit | None:
    """Conversations whose turns rebuild the history instead of appending to it."""
    convs: dict[object, list[int]] = defaultdict(list)
    for i, rec in enumerate(prep.records):
        k = conversation_key(rec)
        if k is not None:
            convs[k].append(i)
    follow = rebuilt = 0
    kinds: Counter = Counter()
    example = None
    template_breaks = 0
    for key, idx in convs.items():
        for prev, cur in zip(idx, idx[1:]):
            follow += 1
            hp, hc = _history(prep.records[prev]), _history(prep.records[cur])
            if hc[: len(hp)] == hp:
                sp = [m["content"] for m in prep.records[prev].messages if m["role"] in SYSTEM_ROLES]
                sc = [m["content"] for m in prep.records[cur].messages if m["role"] in SYSTEM_ROLES]
                if sp == sc and lcp(prep.tokens[prev], prep.tokens[cur]) < len(prep.tokens[prev]) - 8:
                    template_breaks += 1
                continue
            rebuilt += 1
            j = next((j for j in range(1, len(hp)) if hc[: len(hp) - j] == hp[j:] and len(hp) - j > 0), None)
            kind = f"window: dropped the oldest {j} message(s)" if j else "edited or replaced history"
            kinds[kind] += 1
            if example is None:
                example = (key, prev, cur, len(hp), len(hc), kind)
    if not rebuilt and not template_breaks:
        return None
    ev = [f"{follow} follow-up turns in {sum(len(v) > 1 for v in convs.values())} conversations; "
          f"{rebuilt} ({rebuilt / max(follow, 1):.0%}) do not re-send the previous turn's history unchanged"]
    ev += [f"  {n}x {k}" for k, n in kinds.most_common(4)]
    if example:
        key, prev, cur, lp, lc, kind = example
        ev.append(f"e.g. {key[0]} {key[1]!r}: line {prep.records[prev].line} sends {lp} history messages, "
                  f"the next turn (line {prep.records[cur].line}) sends {lc} ({kind})")
    if template_breaks:
        ev.append(f"{template_breaks} turns append their messages but the chat template re-renders the history "
                  "differently (the token prefix breaks anyway)")
    position = int(statistics.median(prep.sys_tokens[i] for i in range(len(prep.records))
                                     if conversation_key(prep.records[i]) is not None)) if convs else None
    return Culprit("multi-turn", "multi-turn conversations rebuild their history instead of appending to it",
                   position, "the conversation history", ev,
                   "send each turn as the previous turn's messages + the reply + the new message (append-only)",
                   rebuilt, fix=append_histories if rebuilt else None, details={"follow_ups": follow, "rebuilt": rebuilt})


def alignment_boundaries(tokens: list[str], div: Divergence, min_count: int = 3) -> list[str]:
    """Shared prefixes at which many requests diverge (template boundaries), as token strs."""
    counts: Counter = Counter()
    for i, (d, p) in enumerate(zip(div.position, div.partner)):
        if p >= 0 and 0 < d < len(tokens[i]):
            counts[tokens[i][:d]] += 1
    thresh = max(min_count, len(tokens) // 100)
    return sorted((pfx for pfx, c in counts.items() if c >= thresh), key=len)


def pad_to_blocks(tokens: list[str], boundaries: list[str], block_size: int, pad: int
                  ) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Insert ``pad`` tokens after every shared prefix a prompt starts with, up to a block boundary.

    Returns the new token strs and, per prompt, the (old position, tokens inserted) of each insertion.
    """
    out, inserts = [], []
    ch = chr(pad)
    for s in tokens:
        hits = [b for b in boundaries if s.startswith(b)]
        new, done, length, ins = [], 0, 0, []
        for b in hits:  # ascending length: each boundary is padded where it ends, shifted by earlier pads
            new.append(s[done:len(b)])
            length += len(b) - done
            done = len(b)
            k = (-length) % block_size
            if k:
                new.append(ch * k)
                length += k
                ins.append((done, k))
        new.append(s[done:])
        out.append("".join(new))
        inserts.append(ins)
    return out, inserts


def padded(prep: Prepared, block_size: int, pad: int) -> Prepared:
    """``prep`` with its shared prefixes padded to block boundaries (system-part lengths shifted alike)."""
    toks, inserts = pad_to_blocks(prep.tokens, alignment_boundaries(prep.tokens, _div(prep.tokens)), block_size, pad)
    sys_tokens = [st + sum(k for p, k in ins if p <= st) if st else 0 for st, ins in zip(prep.sys_tokens, inserts)]
    return Prepared(prep.records, prep.texts, toks, prep.segments, sys_tokens, prep.bad, prep.seconds, padded=True,
                    sys_chars=prep.sys_chars)


def alignment_culprit(prep: Prepared, div: Divergence, block_size: int, pad: int, pad_text: str) -> Culprit | None:
    """Shared prefixes that end inside a block (or are shorter than one): tokens shared but not cached."""
    lens = prep.lengths
    shared = [min(d, n - 1) for d, n in zip(div.position, lens)]
    lost = sum(s % block_size for s in shared)
    short = sum(1 for s in shared if 0 < s < block_size)
    if not lost:
        return None
    bounds = alignment_boundaries(prep.tokens, div)
    frac = lost / max(sum(lens), 1)
    return Culprit(
        "alignment", f"shared prefixes end inside a {block_size}-token block" + (
            f"; {short} request{'s share' if short != 1 else ' shares'} less than one block" if short else ""),
        int(statistics.median(len(b) for b in bounds)) if bounds else None, "block boundaries",
        [f"{lost} prompt tokens ({frac:.2%} of all) match an earlier prompt but sit in a block that is not full "
         f"of shared tokens, so they are recomputed",
         f"{short} requests share 1..{block_size - 1} tokens with an earlier prompt: less than one block, 0 hits",
         f"{len(bounds)} shared prefixes end where many requests diverge (template boundaries)"],
        f"pad each of those shared prefixes to a multiple of {block_size} tokens with {pad_text!r} (the article's 5.4 "
        "advice); written as token ids", short,
        token_fix=lambda prep: padded(prep, block_size, pad),
        details={"lost_tokens": lost, "short_requests": short, "boundaries": len(bounds)})


def _div(tokens: list[str]) -> Divergence:
    from .divergence import divergence

    return divergence(tokens)


def public_prefixes(prep: Prepared, tenants: list[str | None], scan: int = 64) -> list[int]:
    """Per request, the length of its system part's prefix that another tenant sends too (tokens)."""
    heads: dict[str, set] = defaultdict(set)
    for ts, st, t in zip(prep.tokens, prep.sys_tokens, tenants):
        if st and t is not None:
            heads[ts[:st]].add(t)
    keys = sorted(heads)
    best: dict[str, int] = {}
    for j, h in enumerate(keys):
        mine = heads[h]
        b = 0
        if len(mine) > 1:
            b = len(h)
        else:
            for step in (-1, 1):
                k = j + step
                while 0 <= k < len(keys) and abs(k - j) <= scan:
                    if heads[keys[k]] - mine:
                        b = max(b, lcp(h, keys[k]))
                        break
                    k += step
        best[h] = b
    return [best.get(ts[:st], 0) if st and t is not None else 0
            for ts, st, t in zip(prep.tokens, prep.sys_tokens, tenants)]


def tenant_culprit(prep: Prepared, tenants: list[str | None], field_name: str, block_size: int,
                   salted: int, unsalted: int) -> Culprit | None:
    """Tenant salts (vLLM's cache_salt) that split a prefix several tenants send."""
    distinct = sorted({t for t in tenants if t is not None})
    if len(distinct) < 2 or unsalted <= salted:
        return None
    pub = public_prefixes(prep, tenants)
    with_pub = sum(p >= block_size for p in pub)
    return Culprit(
        "tenant-salt", f"per-tenant cache salts split a prefix that {len(distinct)} tenants all send",
        int(statistics.median([p for p in pub if p] or [0])), f"field {field_name!r}",
        [f"{len(distinct)} tenants ({', '.join(distinct[:6])}{', ...' if len(distinct) > 6 else ''}); salted per tenant the "
         f"replay hits {salted} tokens, without salts {unsalted}: salting gives up {unsalted - salted} hit tokens",
         f"{with_pub} requests start with a system-prompt prefix of >= one block that another tenant sends too "
         f"(median {int(statistics.median([p for p in pub if p] or [0]))} tokens)"],
        "public-prefix policy: share the operator's prefix that several tenants send, salt from the first block "
        "past it (kvlab Engine(isolation='public-prefix')); never drop the salts", with_pub, policy="public-prefix",
        details={"tenants": distinct})
