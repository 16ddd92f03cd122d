"""The errors of a refused request (pure Python): ``RequestError`` names the field at fault, so a
server can report it (OpenAI's error ``param``) without reading the message."""

from __future__ import annotations

__all__ = ["RequestError", "RequestTypeError", "UnknownRequestError", "refused"]


class RequestError(ValueError):
    """A request refused at intake; ``field`` names the offending field (None when no one field is
    at fault)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


class RequestTypeError(RequestError, TypeError):
    """A request field of the wrong type: a ``RequestError`` that is also a ``TypeError`` (as it was
    before)."""


def refused(field: str | None, e: Exception) -> RequestError:
    """``e`` (a ``TypeError`` or ``ValueError``) as a ``RequestError`` of ``field``, its message
    kept."""
    return (RequestTypeError if isinstance(e, TypeError) else RequestError)(field, str(e))


class UnknownRequestError(LookupError):
    """Raised for a request id the engine does not hold (or that belongs to another tenant)."""
