"""Read a JSONL request log (chat messages, a prompt or token ids a line) into records; every bad line is a BadLine."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

MAX_TOKEN_ID = 0x10FFFF  # token ids are stored as str code points (see ``kvlab.doctor.tokenization``)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_DEPTH = 64  # JSON nesting a line may have (tools' JSON schemas nest about 10 deep)
IDENTITY_FIELDS = ("user", "session")  # read as who sent a request: a string, a number or null
SCALARS = (str, int, float, bool, type(None))
SURROGATE = re.compile(r"[\ud800-\udfff]")  # a lone surrogate: not text, cannot be written as UTF-8
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a JSON text spells one (or half of an emoji's pair)
JSON_SPACE = " \t\r\n"  # a line of only these is blank (not a request)
BOM = b"\xef\xbb\xbf"
JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
NOT_BRACKET = re.compile(r"[^\[\]{}]+")
BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


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


def check_value(obj: Any) -> None:
    """Raise ValueError if a decoded line nests deeper than ``MAX_DEPTH`` or holds a lone surrogate."""
    stack = [(obj, 1)]
    while stack:  # iterative: a deep value must not hit the recursion limit here either
        v, depth = stack.pop()
        if isinstance(v, str):
            if m := SURROGATE.search(v):
                raise ValueError(f"a string holds a lone surrogate ({m.group()!a}), not text")
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                v = v.values()
            stack.extend((x, depth + 1) for x in v if not isinstance(x, (int, float)))
        elif not isinstance(v, SCALARS):
            raise ValueError(f"a value is {type(v).__name__}, not JSON")


def json_depth(text: str) -> int:
    """How deep a valid JSON text nests (its brackets outside strings, counted in C)."""
    brackets = NOT_BRACKET.sub("", JSON_STRING.sub("", text))
    return max(accumulate(map(BRACKET_STEP.__getitem__, brackets)), default=0)


def _check(text: str, obj: Any) -> None:
    """``check_value`` for the value ``obj`` of the JSON ``text``, fast where the text shows it is fine."""
    if text.count("[") + text.count("{") > MAX_DEPTH and json_depth(text) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    if ("\\u" in text and SURROGATE_ESCAPE.search(text)) or not _utf8_ok(text):  # escaped, or as is (str, dict)
        check_value(obj)


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _short(v: Any) -> str:
    """repr of a value, cut to 40 characters."""
    r = repr(v) if not isinstance(v, int) or abs(v) < 10**40 else f"<an int of {v.bit_length()} bits>"
    return r if len(r) <= 40 else r[:37] + "..."


def _preview(v: Any) -> str:
    """The start of a value's repr (a value nested too deep to repr says so)."""
    try:
        return repr(v)[:80]
    except (RecursionError, ValueError):  # ValueError: an int over the str-conversion limit
        return f"<a {type(v).__name__} too large to show>"


def parse_line(obj: Any, line: int) -> Record:
    """One decoded JSON value -> Record; raise ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for k in IDENTITY_FIELDS:
        if not isinstance(obj.get(k), SCALARS):
            raise ValueError(f"'{k}' is {type(obj[k]).__name__}, not a string, a number or null")
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
        for j, t in enumerate(tools or []):
            if not isinstance(t.get("function", {}), dict):
                raise ValueError(f"tools[{j}].function is {type(t['function']).__name__}, not an object")
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
            raise ValueError(f"'{key}'[{j}] = {_short(t)} is not a token id (an int in [0, {MAX_TOKEN_ID}])")
    return Record(line, "token_ids", token_ids=ids, meta=meta)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_no_constant)  # strict JSON: NaN and Infinity are refused


def decode_line(raw: str | bytes, line: int) -> Record | BadLine | None:
    """One line of a log (bytes or text) -> a Record, a BadLine saying what is wrong, or None when blank."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # never replaced: two prompts that differ there would replay as one
            return BadLine(line, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1})",
                           raw[:80].decode("utf-8", "backslashreplace"))
    text = raw.strip(JSON_SPACE)
    if not text:
        return None
    try:
        obj = DECODER.decode(text)
    except json.JSONDecodeError as e:
        return BadLine(line, f"invalid JSON ({e.msg} at column {e.colno})", text[:80])
    except RecursionError:
        return BadLine(line, f"JSON nested deeper than {MAX_DEPTH} levels", text[:80])
    except ValueError as e:  # a number over the int-conversion limit, NaN/Infinity
        return BadLine(line, f"unreadable JSON ({str(e).split(';')[0]})", text[:80])
    try:
        _check(text, obj)
        return parse_line(obj, line)
    except ValueError as e:
        return BadLine(line, str(e), text[:80])


def iter_lines(lines: Iterable[str | bytes], first_line: int = 1) -> Iterator[Record | BadLine]:
    """Records and BadLines of JSONL lines (text or bytes), in order; blank lines are skipped (not requests)."""
    for n, raw in enumerate(lines, first_line):
        item = decode_line(raw, n)
        if item is not None:
            yield item


def read_log(source: str | Path | Iterable[dict | str | bytes]) -> tuple[list[Record], list[BadLine]]:
    """A JSONL file (or an iterable of dicts / JSON lines) -> (records, bad lines).

    A file is read as bytes and cut at ``\\n`` only, so line numbers are what ``wc -l`` and editors count.
    """
    items: list[Record | BadLine] = []
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:  # binary: lines end at b"\n" only, each decoded strictly
            for n, raw in enumerate(f, 1):
                item = decode_line(raw[len(BOM):] if n == 1 and raw.startswith(BOM) else raw, n)
                if item is not None:
                    items.append(item)
    else:
        for n, item in enumerate(source, 1):
            if isinstance(item, (str, bytes)):
                items.extend(iter_lines([item], n))
                continue
            try:  # a dict is held to what a JSON line may hold
                text = json.dumps(item, ensure_ascii=False, allow_nan=False)
            except RecursionError:
                items.append(BadLine(n, f"JSON nested deeper than {MAX_DEPTH} levels", _preview(item)))
                continue
            except (TypeError, ValueError) as e:
                items.append(BadLine(n, f"not JSON ({e})", _preview(item)))
                continue
            try:
                _check(text, item)
                items.append(parse_line(item, n))
            except ValueError as e:
                items.append(BadLine(n, str(e), _preview(item)))
    records = [x for x in items if isinstance(x, Record)]
    bad = [x for x in items if isinstance(x, BadLine)]
    return records, bad


def write_log(records: Iterable[Record | dict], path: str | Path, exclusive: bool = False) -> Path:
    """Write records (or plain dicts) as JSONL; return the path (``exclusive``: never over an existing file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x" if exclusive else "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json() if isinstance(r, Record) else r, ensure_ascii=False) + "\n")
    return path
