"""Read a request log (JSONL) into records, report every malformed line, and write logs back.

Three line shapes are accepted, one JSON object per line:

- OpenAI chat: ``{"messages": [{"role": ..., "content": ...}, ...], "user": ..., "timestamp": ...,
  "tenant": ..., "session": ..., "tools": [...]}``; ``content`` may be a string or a list of
  ``{"type": "text", "text": ...}`` parts;
- a plain prompt: ``{"prompt": "..."}``;
- token ids: ``{"token_ids": [...]}`` (or ``prompt_token_ids``).

A line that is not one of these is never dropped silently: it becomes a ``BadLine`` with its line
number and what is wrong, the caller reports it and counts it in the summary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_TOKEN_ID = 0x10FFFF  # token ids are stored as str code points (see ``kvlab.doctor.tokenize``)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(slots=True)
class Record:
    """One request of the log: its line number, its prompt in one of three forms, and its metadata."""

    line: int
    kind: str  # "messages", "prompt" or "token_ids"
    messages: list[dict] | None = None  # [{"role": str, "content": str}, ...]
    prompt: str | None = None
    token_ids: list[int] | None = None
    tools: list[dict] | None = None
    meta: dict = field(default_factory=dict)  # every other field of the line (user, timestamp, tenant, ...)
    origin: Record | None = field(default=None, repr=False, compare=False)  # the record a fix rewrote into this one

    def get(self, name: str, default: Any = None) -> Any:
        """A metadata field (``user``, ``tenant``, ``session``, ...) or ``default``."""
        return self.meta.get(name, default)

    def to_json(self) -> dict:
        """The line as a JSON object again (the same shape it was read in)."""
        out: dict[str, Any] = {}
        if self.kind == "messages":
            out["messages"] = self.messages
            if self.tools is not None:
                out["tools"] = self.tools
        elif self.kind == "prompt":
            out["prompt"] = self.prompt
        else:
            out["token_ids"] = self.token_ids
        out.update(self.meta)
        return out

    def replace(self, **changes: Any) -> Record:
        """A copy with some fields changed (messages are copied, never shared with the original)."""
        new = Record(self.line, self.kind, [dict(m) for m in self.messages] if self.messages is not None else None,
                     self.prompt, list(self.token_ids) if self.token_ids is not None else None,
                     self.tools, dict(self.meta), self)
        for k, v in changes.items():
            setattr(new, k, v)
        return new


@dataclass(slots=True, frozen=True)
class BadLine:
    """A line that could not be read: where, what is wrong, and the start of its text."""

    line: int
    error: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.error}: {self.text!r}"


def _content_text(content: Any, where: str) -> str:
    """A message's content as one string (OpenAI text parts are joined); raise ValueError otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"{where}.content[{j}] is not a text part ({{'type': 'text', 'text': str}})")
        return "".join(parts)
    if content is None:
        return ""  # an assistant message that only called tools
    raise ValueError(f"{where}.content is {type(content).__name__}, not a string or a list of text parts")


def parse_line(obj: Any, line: int) -> Record:
    """One decoded JSON value -> Record; raise ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    shapes = [k for k in ("messages", "prompt", "token_ids", "prompt_token_ids") if k in obj]
    if not shapes:
        raise ValueError("no 'messages', 'prompt' or 'token_ids' field")
    if len(shapes) > 1:
        raise ValueError(f"more than one prompt field ({', '.join(shapes)}); give exactly one")
    meta = {k: v for k, v in obj.items() if k not in ("messages", "prompt", "token_ids", "prompt_token_ids", "tools")}
    key = shapes[0]
    if key == "messages":
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise ValueError(f"{where} is {type(m).__name__}, not an object")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise ValueError(f"{where} has no 'role'")
            if role not in ROLES:
                raise ValueError(f"{where}.role {role!r} is not one of {sorted(ROLES)}")
            if "content" not in m:
                raise ValueError(f"{where} has no 'content'")
            msg = dict(m)
            msg["content"] = _content_text(m["content"], where)
            out.append(msg)
        tools = obj.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("'tools' must be a list of objects")
        return Record(line, "messages", messages=out, tools=tools, meta=meta)
    if key == "prompt":
        p = obj["prompt"]
        if not isinstance(p, str):
            raise ValueError(f"'prompt' is {type(p).__name__}, not a string")
        if not p:
            raise ValueError("'prompt' is empty")
        return Record(line, "prompt", prompt=p, meta=meta)
    ids = obj[key]
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"'{key}' must be a non-empty list of ints")
    for j, t in enumerate(ids):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"'{key}'[{j}] = {t!r} is not a token id (an int in [0, {MAX_TOKEN_ID}])")
    return Record(line, "token_ids", token_ids=ids, meta=meta)


def iter_lines(lines: Iterable[str], first_line: int = 1) -> Iterator[Record | BadLine]:
    """Records and BadLines of JSONL text lines, in order; blank lines are skipped (not requests)."""
    for n, raw in enumerate(lines, first_line):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield BadLine(n, f"invalid JSON ({e.msg} at column {e.colno})", text[:80])
            continue
        try:
            yield parse_line(obj, n)
        except ValueError as e:
            yield BadLine(n, str(e), text[:80])


def read_log(source: str | Path | Iterable[dict | str]) -> tuple[list[Record], list[BadLine]]:
    """A JSONL file (or an iterable of dicts / JSON strings) -> (records, bad lines)."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8", errors="replace") as f:
            items = list(iter_lines(f))
    else:
        items = []
        for n, item in enumerate(source, 1):
            if isinstance(item, str):
                items.extend(iter_lines([item], n))
            else:
                try:
                    items.append(parse_line(item, n))
                except ValueError as e:
                    items.append(BadLine(n, str(e), json.dumps(item, default=str)[:80]))
    records = [x for x in items if isinstance(x, Record)]
    bad = [x for x in items if isinstance(x, BadLine)]
    return records, bad


def write_log(records: Iterable[Record | dict], path: str | Path) -> Path:
    """Write records (or plain dicts) as JSONL; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json() if isinstance(r, Record) else r, ensure_ascii=False) + "\n")
    return path
