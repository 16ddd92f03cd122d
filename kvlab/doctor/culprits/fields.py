"""Fields: a line (or sentence) whose value differs between requests that share a template.

Slot findings are grouped by the line they live in; the line's values across the whole log, grouped by
``user`` and ``session``, say whether it is per user (names, ids), per conversation, or per request
(timestamps, UUIDs, request ids, counters), and the value's shape labels it. The fix moves the line to the
start of the last user message. Token-id logs get the same treatment for spans between fixed token contexts.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from ..logio import Record
from ..prepare import Prepared
from .base import Culprit, _shorten, _where, record_segments, with_contents
from .textdiff import WINDOW, Finding, _value_char

MAX_FIELD_CHARS = 300  # a field's values are short (times, ids, names); longer ones are content
TIMESTAMP_RE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b\d{1,2}/\d{1,2}/\d{2,4}\b|"
                          r"\b(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b \d", re.I)
UUID_RE = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
ID_RE = re.compile(r"\b(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{5,}\b")


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
