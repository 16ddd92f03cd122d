"""OpenAI chat messages as pydantic models: one schema for what ``kvlab serve`` accepts and what
``kvlab doctor`` reads from a request log.

Two strictness levels of the same shape. A request to the server is an allow-list (``Message``: the
four roles the chat template renders, text content only, no unknown keys), so a client never
believes a field took effect when it did not. A log line records traffic that already happened, so
``LoggedMessage`` also reads the roles and keys a real API log holds (``tool`` and ``function``
messages, ``tool_calls``, ``content: null`` for an assistant turn that only called tools) and keeps
the extra keys as they were. Both refuse what the analysis cannot use: a content that is not text.

``field_error`` turns pydantic's first error into one sentence that names the field the way a
reader writes it (``messages[2].content``), for the doctor's bad-line report.

Needs only pydantic (no FastAPI, no torch), so the doctor runs without the ``serve`` extra.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "LOG_ROLES",
    "LoggedMessage",
    "LoggedTool",
    "Message",
    "TextPart",
    "field_error",
    "log_messages",
    "log_tools",
]

# Roles a request log may hold (OpenAI's, old and new); the server accepts the first four only.
LOG_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class TextPart(BaseModel):
    """One part of a message's content; only text."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message of a request to ``kvlab serve``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string."""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class LoggedTextPart(BaseModel):
    """A text part as logs write it: ``type`` may be left out, other keys are kept."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"] = "text"
    text: str


class LoggedMessage(BaseModel):
    """One message of a logged request: any of ``LOG_ROLES``, text content (or null), extra keys
    kept."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # required (a message without it is a bad line), but null is read as "" (a tool-call-only turn)
    content: str | list[LoggedTextPart] | None = Field(...)

    def text(self) -> str:
        """The content as one string ("" for null)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class LoggedTool(BaseModel):
    """One entry of a logged request's ``tools``: an object whose ``function``, if any, is an
    object."""

    model_config = ConfigDict(strict=True, extra="allow")
    # absent is fine; given, it must be an object
    function: dict[str, Any] = Field(default_factory=dict)


_MESSAGES = TypeAdapter(list[LoggedMessage])
_TOOLS = TypeAdapter(list[LoggedTool])


def _path(loc: tuple[Any, ...]) -> str:
    """pydantic's location as a reader writes it: ``messages[2].content[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "list[", "str", "none", "literal")):
            # union arms (``list[LoggedTextPart]``, ``str``) are pydantic's, not the reader's
            out += f".{part}" if out else str(part)
    return out


def field_error(e: ValidationError, root: str) -> str:
    """The first error of ``e`` as one sentence naming the field under ``root`` (``messages``)."""
    errors = e.errors()
    # a union reports one error per arm; the arm that got furthest into the value says most
    err = max(errors, key=lambda x: len(x["loc"]))
    where = _path((root, *err["loc"]))
    kind, value = err["type"], err.get("input")
    if kind == "literal_error" and where.endswith(".role"):
        return f"{where} {value!r} is not one of {sorted(LOG_ROLES)}"
    head, part, _ = where.partition(".content[")
    if part:
        index = where[len(head) + len(part) :].split("]")[0]
        return f"{head}.content[{index}] is not a text part ({{'type': 'text', 'text': str}})"
    if kind == "missing":
        parent, _, name = where.rpartition(".")
        return f"{parent} has no '{name}'"
    if where.endswith(".content"):
        return f"{where} is {type(value).__name__}, not a string or a list of text parts"
    expected = {"model_type": "an object", "dict_type": "an object", "list_type": "a list"}.get(
        kind, err["msg"].removeprefix("Input should be ")
    )
    return f"{where} is {type(value).__name__}, not {expected}"


def log_messages(value: Any) -> list[dict[str, Any]]:
    """A log line's ``messages`` -> plain dicts with string content; ValueError naming the bad
    field."""
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list")
    try:
        checked = _MESSAGES.validate_python(value)
    except ValidationError as e:
        raise ValueError(field_error(e, "messages")) from None
    # the log's own dicts, key order and extra keys kept, each content one string
    return [{**raw, "content": m.text()} for raw, m in zip(value, checked)]


def log_tools(value: Any) -> list[dict] | None:
    """A log line's ``tools`` (None when absent), checked; ValueError naming the bad field."""
    if value is None:
        return None
    try:
        _TOOLS.validate_python(value)
    except ValidationError as e:
        raise ValueError(field_error(e, "tools")) from None
    return value
