"""Read a JSONL request log (chat messages, a prompt or token ids a line) into records; every bad
line is a BadLine.

Chat messages and tools are read through the pydantic models the server uses for its requests
(``kvlab.chat``: ``LoggedMessage`` is ``Message`` widened to what a log of real traffic holds); the
checks here are the ones the analysis needs beyond that shape (one prompt field, token ids in range,
who-sent-it fields that can be hashed, JSON a UTF-8 writer can write back).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..chat import log_messages, log_tools

# token ids are stored as str code points (see ``kvlab.doctor.tokenization``)
MAX_TOKEN_ID = 0x10FFFF
MAX_DEPTH = 64  # JSON nesting a line may have (tools' JSON schemas nest about 10 deep)
IDENTITY_FIELDS = ("user", "session")  # read as who sent a request: a string, a number or null
SCALARS = (str, int, float, bool, type(None))
SURROGATE = re.compile(r"[\ud800-\udfff]")  # a lone surrogate: not text, cannot be written as UTF-8
JSON_SPACE = " \t\r\n"  # a line of only these is blank (not a request)
BOM = b"\xef\xbb\xbf"
PROMPT_FIELDS = ("messages", "prompt", "token_ids", "prompt_token_ids")
# UTF-8 bytes a line may hold (its "\n" not counted): about 500k tokens of text. A longer line is a
# BadLine, read in pieces and never held whole: the tokenizer's memory grows with the line (a 5 MB
# prompt took 1 GB, a 50 MB one aborted the process in the tokenizer's allocator)
MAX_LINE_BYTES = 2 << 20


@dataclass(slots=True)
class Record:
    """One request of the log: its line number, its prompt in one of three forms, and its
    metadata."""

    line: int
    kind: str  # "messages", "prompt" or "token_ids"
    messages: list[dict] | None = None  # [{"role": str, "content": str}, ...]
    prompt: str | None = None
    token_ids: list[int] | None = None
    tools: list[dict] | None = None
    # every other field of the line (user, timestamp, tenant, ...)
    meta: dict = field(default_factory=dict)
    # the record a fix rewrote into this one
    origin: Record | None = field(default=None, repr=False, compare=False)

    def get(self, name: str, default: Any = None) -> Any:
        """A metadata field (``user``, ``tenant``, ``session``, ...) or ``default``."""
        return self.meta.get(name, default)

    def to_json(self) -> dict:
        """The line as a JSON object again (the same shape it was read in)."""
        body: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.kind == "messages" and self.tools is not None:
            body["tools"] = self.tools
        return {**body, **self.meta}

    def replace(self, **changes: Any) -> Record:
        """A copy with some fields changed (messages are copied, never shared with the original)."""
        return dataclasses.replace(
            self,
            **{
                "messages": None if self.messages is None else [dict(m) for m in self.messages],
                "meta": dict(self.meta),
                "token_ids": None if self.token_ids is None else list(self.token_ids),
                "origin": self,
                **changes,
            },
        )


@dataclass(slots=True, frozen=True)
class BadLine:
    """A line that could not be read: where, what is wrong, and the start of its text."""

    line: int
    error: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.error}: {self.text!r}"


def check_value(obj: Any) -> None:
    """Raise ValueError if a decoded line nests deeper than ``MAX_DEPTH`` or holds a lone
    surrogate."""
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


def _short(v: Any) -> str:
    """repr of a value, cut to 40 characters."""
    r = (
        repr(v)
        if not isinstance(v, int) or abs(v) < 10**40
        else f"<an int of {v.bit_length()} bits>"
    )
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
    shapes = [k for k in PROMPT_FIELDS if k in obj]
    if len(shapes) != 1:
        raise ValueError(
            f"more than one prompt field ({', '.join(shapes)}); give exactly one"
            if shapes
            else "no 'messages', 'prompt' or 'token_ids' field"
        )
    meta = {k: v for k, v in obj.items() if k not in (*PROMPT_FIELDS, "tools")}
    key, value = shapes[0], obj[shapes[0]]
    if key == "messages":
        return Record(
            line,
            "messages",
            messages=log_messages(value),
            tools=log_tools(obj.get("tools")),
            meta=meta,
        )
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"'prompt' is {type(value).__name__}, not a string"
                if not isinstance(value, str)
                else "'prompt' is empty"
            )
        return Record(line, "prompt", prompt=value, meta=meta)
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be a non-empty list of ints")
    for j, t in enumerate(value):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(
                f"'{key}'[{j}] = {_short(t)} is not a token id (an int in [0, {MAX_TOKEN_ID}])"
            )
    return Record(line, "token_ids", token_ids=value, meta=meta)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_no_constant)  # strict JSON: NaN and Infinity are refused


def _too_long(size: int, line: int, head: str | bytes) -> BadLine:
    shown = head[:80].decode("utf-8", "backslashreplace") if isinstance(head, bytes) else head[:80]
    return BadLine(
        line, f"a line of {size:,} bytes, over the limit of {MAX_LINE_BYTES:,} bytes a line", shown
    )


def _utf8_size(text: str) -> int:
    """UTF-8 bytes of ``text``, counted without encoding what is plainly over the cap."""
    return len(text) if len(text) > MAX_LINE_BYTES else len(text.encode("utf-8", "surrogatepass"))


def decode_line(raw: str | bytes, line: int) -> Record | BadLine | None:
    """One line of a log (bytes or text) -> a Record, a BadLine saying what is wrong, or None when
    blank."""
    if (size := len(raw) if isinstance(raw, bytes) else _utf8_size(raw)) > MAX_LINE_BYTES:
        return _too_long(size, line, raw)
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        # never replaced: two prompts that differ there would replay as one
        except UnicodeDecodeError as e:
            return BadLine(
                line,
                f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1})",
                raw[:80].decode("utf-8", "backslashreplace"),
            )
    if not (text := raw.strip(JSON_SPACE)):
        return None
    try:
        obj = DECODER.decode(text)
    except json.JSONDecodeError as e:
        return BadLine(line, f"invalid JSON ({e.msg} at column {e.colno})", text[:80])
    except RecursionError:
        return BadLine(line, f"JSON nested deeper than {MAX_DEPTH} levels", text[:80])
    except ValueError as e:  # a number over the int-conversion limit, NaN/Infinity
        return BadLine(line, f"unreadable JSON ({str(e).split(';')[0]})", text[:80])
    return _parsed(obj, line, text[:80])


def _from_value(item: Any, line: int) -> Record | BadLine:
    """A value given in place of a line (a dict), held to what a JSON line may hold."""
    try:
        # what a line could not hold fails here
        text = json.dumps(item, ensure_ascii=False, allow_nan=False)
        if (size := _utf8_size(text)) > MAX_LINE_BYTES:
            return _too_long(size, line, text)
    except RecursionError:
        return BadLine(line, f"JSON nested deeper than {MAX_DEPTH} levels", _preview(item))
    except (TypeError, ValueError) as e:
        return BadLine(line, f"not JSON ({e})", _preview(item))
    return _parsed(item, line, _preview(item))


def _parsed(obj: Any, line: int, shown: str) -> Record | BadLine:
    try:
        check_value(obj)
        return parse_line(obj, line)
    except ValueError as e:
        return BadLine(line, str(e), shown)


def read_log(
    source: str | Path | Iterable[dict | str | bytes],
) -> tuple[list[Record], list[BadLine]]:
    """A JSONL file (cut at ``\\n`` only, as ``wc -l`` counts) or an iterable of dicts / lines ->
    (records, bad)."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:  # binary: lines end at b"\n" only, each decoded strictly
            items = [
                decode_line(raw[len(BOM) :] if n == 1 and raw.startswith(BOM) else raw, n)
                if isinstance(raw, bytes)
                else _too_long(raw[0], n, raw[1])
                for n, raw in enumerate(_lines(f), 1)
            ]
    else:
        items = [decode_line(x, n) if isinstance(x, (str, bytes)) else _from_value(x, n)
                 for n, x in enumerate(source, 1)]
    return [x for x in items if isinstance(x, Record)], [x for x in items if isinstance(x, BadLine)]


def _lines(f) -> Iterable[bytes | tuple[int, bytes]]:
    """The lines of a binary file without their b"\n"; a line over ``MAX_LINE_BYTES`` as (its size,
    its start), read through in pieces and never held whole."""
    while raw := f.readline(MAX_LINE_BYTES + 2):
        if raw.endswith(b"\n") or len(raw) <= MAX_LINE_BYTES:
            yield raw.removesuffix(b"\n")
            continue
        head, size = raw[:80], len(raw)
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            size += len(raw)
        yield size - raw.endswith(b"\n"), head


def write_log(records: Iterable[Record | dict], path: str | Path, exclusive: bool = False) -> Path:
    """Write records (or plain dicts) as JSONL; return the path (``exclusive``: never over an
    existing file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x" if exclusive else "w", encoding="utf-8") as f:
        for r in records:
            f.write(
                json.dumps(r.to_json() if isinstance(r, Record) else r, ensure_ascii=False) + "\n"
            )
    return path
