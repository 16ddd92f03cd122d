"""Fields: a line (or a token span) whose value differs per request, user or conversation; the fix
moves it."""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from ..logio import Record
from ..prepare import Prepared
from ..tokenization import ids, tokstr
from .base import Culprit, _shorten, _where, record_segments, with_contents
from .textdiff import WINDOW, Finding, by_key, common_suffix

MAX_FIELD_CHARS = 300  # a field's values are short (times, ids, names); longer ones are content
TIMESTAMP_RE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b\d{1,2}/\d{1,2}/\d{2,4}\b|"
                          r"\b(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b|"
                          r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b \d", re.I)
UUID_RE = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
ID_RE = re.compile(r"\b(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{5,}\b")
SENTENCE_END = re.compile(r"[.!?](\s|$)")


def label_values(values: list[str]) -> str:
    """What a volatile field's values look like: timestamp/date, UUID, id, counter, or text."""
    if not (sample := [v for v in values if v][:200]):
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
        """Char span of the field's line (or sentence) in a message's content, or None."""
        after, sentence = (
            self.anchor == "after",
            self.level == "sentence" and self.anchor != "after",
        )
        needle = self.key + "\n" if after else self.key
        j = content.find(needle)
        while j > 0 and not sentence and content[j - 1] != "\n":  # a line must start with it
            j = content.find(needle, j + 1)
        if j < 0:
            return None
        j += len(needle) if after else 0
        nl = content.find("\n", j)
        e = len(content) if nl < 0 else nl
        if sentence:
            stop = SENTENCE_END.search(content, j + len(self.key))
            e = min(e, stop.start() + 1 if stop else len(content))
        return j, e

    def value(self, content: str) -> str | None:
        """The field's value in a message's content, or None."""
        if (span := self.locate(content)) is None:
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
        contents, moved = [c for _, _, c in segs], []
        for pat in patterns:
            for j, (role, idx, _) in enumerate(segs):
                if not pat.matches(role, idx) or (span := pat.locate(contents[j])) is None:
                    continue
                (s, e), c = span, contents[j]
                moved.append(c[s:e].strip())
                if e < len(c) and c[e] == "\n":
                    e += 1
                elif s > 0 and c[s - 1] == "\n":
                    s -= 1
                contents[j] = c[:s] + c[e:]
        out.append(with_contents(rec, contents, "\n".join(m for m in moved if m)) if moved else rec)
    return out


def field_culprits(
    prep: Prepared,
    findings: list[Finding],
    min_count: int = 2,
    tenants: list | None = None,
    max_fields: int = 10,
) -> list[Culprit]:
    """Group slot findings by the line they live in; classify each field by its values over the
    whole log."""
    # and 5 % of the pairs scanned
    need = max(min_count, int(0.05 * len({(f.a, f.b) for f in findings})))
    out = []
    for (role, index, anchor, key, level), fs in sorted(
        _slot_groups(findings).items(), key=lambda kv: -len(kv[1])
    ):
        if len(fs) >= need and len(out) < max_fields:
            c = _field_culprit(prep, FieldPattern(role, index, key, anchor, level, ""), fs, tenants)
            out += [c] if c is not None else []
    return out


def _slot_groups(findings: list[Finding]) -> dict[tuple, list[Finding]]:
    """Slot findings by (role, index, anchor, key, level); a key that extends a shorter one joins
    it."""
    keyed = by_key(
        findings,
        "slot",
        lambda f: (f.role, f.index, f.anchor, f.key) if f.anchor in ("prefix", "after") else None,
    )
    # one level per key (the commoner one)
    groups = {
        (*k, Counter(f.level for f in fs).most_common(1)[0][0]): fs for k, fs in keyed.items()
    }
    for g in sorted(groups, key=lambda g: len(g[3])):  # "Customer: Sven" joins "Customer: "
        if g in groups and len(g[3].strip()) >= 3:
            for h in [h for h in groups if h[:3] == g[:3] and h[4] == g[4] and len(h[3]) > len(g[3])
                      and h[3].startswith(g[3])]:
                groups[g].extend(groups.pop(h))
    return groups


def _field_culprit(
    prep: Prepared, pat: FieldPattern, fs: list[Finding], tenants: list | None
) -> Culprit | None:
    """One group of slot findings as a field culprit, scoped by its values over the whole log (None:
    not a field)."""
    pat.suffix = common_suffix(
        [
            v
            for rec in prep.records[:2000]
            for r, idx, c in record_segments(rec)
            if pat.matches(r, idx)
            for v in [pat.value(c)]
            if v is not None
        ]
    )
    values, rows = [], []
    for k, rec in enumerate(prep.records):
        # its first such message
        c = next((c for r, idx, c in record_segments(rec) if pat.matches(r, idx)), None)
        if c is not None and (v := pat.value(c)) is not None:
            values.append(v)
            rows.append(k)
    if len(set(values)) < 2 or statistics.median(map(len, values)) > MAX_FIELD_CHARS:
        return None  # one value, or so long it is the request's content
    if tenants is not None and _constant_share(values, [tenants[k] for k in rows])[0] >= 0.9:
        # one value per tenant: the tenant's own content (the tenant check covers sharing)
        return None
    recs = [prep.records[k] for k in rows]
    kind, scope = _scope(values, [r.get("user") for r in recs], [r.get("session") for r in recs])
    label = label_values(values)
    if kind == "per-user":
        label = {"text": "user name/id", "id": "user id"}.get(label, label)
    what = {
        "per-user": "per-user field",
        "per-session": "per-conversation field",
        "volatile": "per-request field",
    }
    name = _shorten(pat.key.strip() or f"line after {pat.key!r}", 40)
    where, position = _where(pat.role, pat.index), int(statistics.median(f.token_pos for f in fs))
    spans = (
        (c, pat.locate(c))
        for rec in prep.records
        for r, idx, c in record_segments(rec)
        if pat.matches(r, idx)
    )
    line_no = next((c.count("\n", 0, span[0]) + 1 for c, span in spans if span), None)
    return Culprit(
        kind,
        f"{what[kind]} ({label}) in {where}: {name!s}",
        position,
        f"{where}, line {line_no}",
        [
            f"{len(values)} requests carry this line; {len(set(values))} distinct values ({scope})",
            "examples: " + "; ".join(repr(v) for v in list(dict.fromkeys(values))[:3]),
            f"found by diffing {len(fs)} request pairs that share the template; value starts at "
            f"token ~{position}",
        ],
        f"move the line {name!r}... out of {where} to the start of the last user message",
        len(values),
        fix=lambda recs: move_fields(recs, [pat]),
        examples=[(fs[0].text_a, fs[0].text_b)],
        details={
            "pattern": pat,
            "label": label,
            "distinct": len(set(values)),
            "values": values[:5],
            "pairs": len(fs),
        },
    )


def _constant_share(values: list[str], keys: list) -> tuple[float, int, int]:
    """Share of groups (with >= 2 requests) in which the value never changes; groups; groups with >=
    2."""
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
    share_u, n_u, multi_u = _constant_share(values, users)
    if share_u >= 0.9 and n_u >= 2:
        return "per-user", (
            f"the same value for all requests of {share_u:.0%} of the {multi_u} users with "
            "several requests"
        )
    share_s, n_s, multi_s = _constant_share(values, sessions)
    if share_s >= 0.9 and n_s >= 2:
        return (
            "per-session",
            f"constant within {share_s:.0%} of {multi_s} conversations, different across them",
        )
    return "volatile", (
        f"changes from request to request: {len(set(values))} values in {len(values)} requests"
        + (
            f"; within one user it stays the same for only {share_u:.0%} of users"
            if multi_u
            else ""
        )
    )


def _span(ts: str, key: str, right: str) -> tuple[int, int] | None:
    """Where the tokens between ``key`` and ``right`` are in a token str, or None."""
    j = ts.find(key)
    e = ts.find(right, j + len(key), j + len(key) + WINDOW + len(right)) if j >= 0 else -1
    return (j + len(key), e) if e >= 0 else None


def move_span(records: list[Record], key: str, right: str) -> list[Record]:
    """Move the tokens between ``key`` and ``right`` of each token-id record to the end of its
    prompt."""

    def moved(rec: Record) -> Record:
        ts = tokstr(rec.token_ids) if rec.kind == "token_ids" else ""
        if (span := _span(ts, key, right)) is None:
            return rec
        s, e = span
        return rec.replace(token_ids=ids(ts[:s] + ts[e:] + ts[s:e]))

    return [moved(rec) for rec in records]


def token_span_culprits(
    prep: Prepared, findings: list[Finding], min_count: int = 2
) -> list[Culprit]:
    """Token-id logs: spans between the same left and right token context, moved to the end of the
    prompt."""
    out = []
    for (key, right), fs in by_key(
        findings, "span", lambda f: (f.key, f.right) if f.key and f.right else None
    ).items():
        if len(fs) < min_count:
            continue
        spans = [
            (rec, ts, sp)
            for rec, ts in zip(prep.records, prep.tokens)
            if (sp := _span(ts, key, right))
        ]
        values = [ts[s:e] for _, ts, (s, e) in spans]
        if len(set(values)) < 2:
            continue
        kind, scope = _scope(values, [rec.get("user") for rec, _, _ in spans], [None] * len(values))
        position = int(statistics.median(f.token_pos for f in fs))
        out.append(
            Culprit(
                kind,
                f"a {'per-user' if kind == 'per-user' else 'varying'} token span at "
                f"token ~{position}",
                position,
                "token ids",
                [
                    f"{len(values)} requests hold a span between the same {len(key)} tokens before "
                    f"and {len(right)} after; {len(set(values))} distinct spans ({scope})",
                    f"example spans (ids): {[ids(v)[:8] for v in list(dict.fromkeys(values))[:2]]}",
                ],
                "move the span to the end of the prompt",
                len(values),
                fix=lambda recs, key=key, right=right: move_span(recs, key, right),
            )
        )
    return out
