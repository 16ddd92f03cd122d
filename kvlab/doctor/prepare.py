"""Turn records into what the analysis needs: rendered text, token strs, and where each message
sits."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .divergence import lcp
from .logio import BadLine, Record
from .tokenization import PromptEncoder, tokstr

CHATML_MSG = re.compile(
    r"<\|im_start\|>[ \t]*(\w+)[ \t]*\n(.*?)(?=<\|im_end\|>|<\|im_start\|>|\Z)", re.S
)
SYSTEM_ROLES = ("system", "developer")
# Prepared's lists
PER_REQUEST = ("records", "texts", "tokens", "segments", "sys_tokens", "sys_chars")
# rewritten records spliced into their origin's text and checked against a real render
SPLICE_CHECKS = 16


@dataclass(slots=True, frozen=True)
class Segment:
    """One sender-controlled piece of a prompt: role, index, and its character span in the text."""

    role: str
    index: int | None  # index in record.messages (None: a message the doctor added, e.g. tools)
    start: int
    end: int
    # where the doctor's tools block starts inside it (chars in the text)
    tools_from: int | None = None


def parse_chatml(text: str) -> list[tuple[str, int, int]]:
    """(role, start, end) of each message content of a ChatML text; [] if it is not ChatML."""
    out = [(m.group(1).lower(), m.start(2), m.end(2)) for m in CHATML_MSG.finditer(text)]
    # the generation prompt "<|im_start|>assistant\n" at the end parses as an empty assistant
    # message: drop it
    if out and out[-1][0] == "assistant" and out[-1][1] == out[-1][2] == len(text):
        out.pop()
    return out


def layout(rec: Record, text: str | None, enc: PromptEncoder | None) -> list[Segment]:
    """The segments of a record in its rendered text."""
    if rec.kind == "token_ids" or text is None:
        return []
    if rec.kind == "prompt":  # a ChatML prompt's messages, else the prompt as one
        return ([Segment(role, i, s, e) for i, (role, s, e) in enumerate(parse_chatml(text))]
                or [Segment("prompt", 0, 0, len(text))])
    eff = enc.effective_messages(rec) if enc is not None else rec.messages
    # 1 when the doctor added a system message for the tools
    injected = len(eff) - len(rec.messages)
    segs, cursor = [], 0
    for j, m in enumerate(eff):
        content = m["content"]
        pos = text.find(content, cursor) if content else -1
        if pos < 0:
            continue  # the template changed the content (stripped it, ...): treat it as markup
        idx = j - injected if j >= injected else None
        tools_from = pos if idx is None else None  # where the tools the doctor appended start
        if rec.tools and enc is not None and not enc.renders_tools and j == 0 and idx is not None:
            tools_from = pos + len(rec.messages[0]["content"])
        segs.append(Segment(m["role"], idx, pos, pos + len(content), tools_from))
        cursor = pos + len(content)
    return segs


@dataclass
class Prepared:
    """Rendered, tokenized requests (in log order) and the lines that could not be used."""

    records: list[Record]
    texts: list[str | None]
    tokens: list[str]
    segments: list[list[Segment]]
    sys_tokens: list[int]
    bad: list[BadLine] = field(default_factory=list)
    # tokens were changed after tokenizing (alignment padding): write them as token ids
    padded: bool = False
    # characters of the rendered text in the system part
    sys_chars: list[int] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        """Prompt length of each request in tokens."""
        return [len(t) for t in self.tokens]

    def take(self, src: Prepared, k: int) -> None:
        """Append request ``k`` of ``src`` (its objects shared)."""
        for name in PER_REQUEST:
            getattr(self, name).append(getattr(src, name)[k])

    def subset(self, idx: list[int]) -> Prepared:
        """The requests at ``idx`` (in that order), sharing this one's objects."""
        out = Prepared([], [], [], [], [], padded=self.padded)
        for i in idx:
            out.take(self, i)
        return out


def prepare(
    records: list[Record], enc: PromptEncoder | None, base: Prepared | None = None
) -> Prepared:
    """Render, tokenize and lay out every record; with ``base``, reuse its records and splice
    rewritten ones."""
    if base is None:
        return _prepare(records, enc, None, {})
    known = {id(r): k for k, r in enumerate(base.records)}
    fresh = [r for r in records if id(r) not in known]
    new = _prepare(fresh, enc, base, known) if fresh else Prepared([], [], [], [], [])
    got = {id(r): k for k, r in enumerate(new.records)}
    out = Prepared([], [], [], [], [], list(new.bad))
    for r in records:
        src, k = (base, known[id(r)]) if id(r) in known else (new, got.get(id(r)))
        if k is not None:  # None: it became a bad line
            out.take(src, k)
    return out


def _splice(
    rec: Record, base: Prepared, k: int, enc: PromptEncoder
) -> tuple[str, list[Segment], int] | None:
    """The rendered text of ``rec`` from its origin's text, when only message contents changed."""
    r0 = base.records[k]
    if rec.kind != "messages" or r0.kind != "messages" or len(rec.messages) != len(r0.messages):
        return None
    if (
        any(a["role"] != b["role"] for a, b in zip(rec.messages, r0.messages))
        or rec.tools != r0.tools
    ):
        return None
    segs0, text0, sys0 = base.segments[k], base.texts[k], base.sys_chars[k]
    if len({s.index for s in segs0 if s.index is not None}) != len(rec.messages) or text0 is None:
        return None
    parts, segs, cursor, delta, sys_chars = [], [], 0, 0, sys0
    for seg in sorted(segs0, key=lambda s: s.start):
        # a message's new content, then the tools the doctor appended to it (a message it added
        # stays as is)
        content = rec.messages[seg.index]["content"] if seg.index is not None else ""
        tail = text0[seg.tools_from:seg.end] if seg.tools_from is not None else ""
        start = seg.start + delta
        parts += [text0[cursor:seg.start], content + tail]
        delta, cursor = start + len(content) + len(tail) - seg.end, seg.end
        if sys_chars and seg.end <= sys0:
            sys_chars = sys0 + delta
        tools_from = None if seg.tools_from is None else start + len(content)
        segs.append(Segment(seg.role, seg.index, start, seg.end + delta, tools_from))
    parts.append(text0[cursor:])
    return "".join(parts), segs, sys_chars


def _prepare(
    records: list[Record], enc: PromptEncoder | None, base: Prepared | None, known: dict
) -> Prepared:
    rows, bad, heads = [], [], {}
    for rec in records:
        if rec.kind == "token_ids":
            rows.append((rec, None, [], 0))
        elif enc is None:
            bad.append(BadLine(rec.line, "a text record needs a tokenizer (--model)", ""))
        else:
            try:
                rows.append((rec, *_render(rec, enc, base, known, heads)))
            # jinja raises TemplateError and friends for a conversation it refuses
            except Exception as e:
                bad.append(
                    BadLine(
                        rec.line,
                        f"the chat template cannot render it ({type(e).__name__}: {e})",
                        "",
                    )
                )
    kept, texts, segments, sys_chars = (
        (list(col) for col in zip(*rows)) if rows else ([], [], [], [])
    )

    def encoded(idx: list[int], text: Callable[[int], str]) -> dict[int, str]:  # in one batch
        plain = [kept[i].kind == "prompt" for i in idx]
        return dict(zip(idx, enc.encode([text(i) for i in idx], plain))) if idx else {}

    by_text = encoded([i for i, t in enumerate(texts) if t is not None], texts.__getitem__)
    tokens = [by_text[i] if i in by_text else tokstr(r.token_ids) for i, r in enumerate(kept)]
    heads = encoded([i for i, c in enumerate(sys_chars) if c], lambda i: texts[i][:sys_chars[i]])
    # the head's tokens must be a prefix of the prompt's (a merge across the boundary would break
    # it)
    sys_tokens = [lcp(heads[i], tokens[i]) if i in heads else 0 for i in range(len(kept))]
    every = Prepared(kept, texts, tokens, segments, sys_tokens, sys_chars=sys_chars)
    # a prompt with no tokens cannot be replayed
    out = every.subset([i for i, t in enumerate(tokens) if t])
    out.bad = sorted(
        bad
        + [BadLine(r.line, "the prompt has no tokens", "") for r, t in zip(kept, tokens) if not t],
        key=lambda b: b.line,
    )
    return out


def _render(rec: Record, enc: PromptEncoder, base: Prepared | None, known: dict, heads: dict
            ) -> tuple[str, list[Segment], int]:
    """A text record's rendered text, segments and system-part length (spliced from its origin's
    when checked)."""
    if base is not None and enc.splice_ok and rec.origin is not None and id(rec.origin) in known:
        spliced = _splice(rec, base, known[id(rec.origin)], enc)
        if spliced is not None and enc.splice_checked < SPLICE_CHECKS:
            enc.splice_checked += 1
            if enc.try_render(rec) != spliced[0]:
                enc.splice_ok = False
                enc.notes.append("the chat template does not copy message contents verbatim: "
                                 "rewritten logs are rendered in full (slower)")
                spliced = None
        if spliced is not None:
            return spliced
    text = enc.render(rec)
    return text, layout(rec, text, enc), _system_chars(rec, text, enc, heads)


def _system_chars(rec: Record, text: str, enc: PromptEncoder, memo: dict) -> int:
    """Characters of the rendered text that hold the system part (its leading system message +
    markup); 0 if none."""
    if rec.kind == "messages":
        eff = enc.effective_messages(rec)
        if not eff or eff[0]["role"] not in SYSTEM_ROLES:
            return 0
        key = (eff[0]["role"], eff[0]["content"], id(rec.tools) if enc.renders_tools else None)
        if key not in memo:
            memo[key] = enc.try_render(rec, add_generation_prompt=False, messages=eff[:1])
        head = memo[key]
    else:  # a ChatML prompt: up to and including the system message's end marker
        parsed = parse_chatml(text)
        if not parsed or parsed[0][0] not in SYSTEM_ROLES:
            return 0
        end = text.find("<|im_end|>", parsed[0][2])
        head = text[: end + len("<|im_end|>")] if end >= 0 else None
    return len(head) if head and text.startswith(head) else 0
