"""What a connection may hold, and what a request must be, before a handler sees it (slowloris,
cross-site POSTs).

- ``RequestGuard`` (ASGI middleware, added by ``create_app``):

  * a POST must say ``Content-Type: application/json`` (415 otherwise): a browser page on another
    site can send a "simple" cross-site POST (``text/plain``, a form, a ``Blob`` without a type) to
    a server on this machine without asking it first, but not one with a JSON content type;
  * a POST's body of more than ``max_body_bytes`` (declared) is refused with 413 and never parsed
    (read and dropped up to ``DRAIN_BYTES``, so that the client reads the answer);
  * a POST's body must arrive within ``body_timeout`` seconds of the request's head (408 and the
    connection closed otherwise); it is read here, at most ``max_body_bytes + 1`` bytes of it, and
    handed on whole;
  * ``GET /metrics`` needs an API key when keys are configured (401), unless ``metrics_open`` (the
    operator's ``--open-metrics``, for a scraper on a trusted network): its counters show every
    tenant's load.

- ``head_timeout_protocol(seconds)``: uvicorn's h11 protocol with a deadline for a request's head.
  uvicorn times out an idle keep-alive connection only after a response, and never a head that
  arrives a byte at a time: a connection that has not sent a whole request head ``seconds`` after it
  opened (or after its last response) is closed.

Reference: the slowloris attack (R. Hansen, 2009); the CORS "simple request" rules (Fetch standard,
CORS-safelisted request headers).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .protocol import ApiError
from .tenancy import AuthError, KeyTable

__all__ = ["RequestGuard", "default_body_limit", "head_timeout_protocol"]

JSON_TYPES = ("application/json",)
MAX_BODY_BYTES = 1 << 20
DRAIN_BYTES = 16 << 20  # a body over the limit but under this is read and dropped before the 413


def default_body_limit(max_model_len: int | None, max_prompt_bytes: int | None = None) -> int:
    """The body size (413 past it) that the largest valid request of a model with this context can
    need.

    Prompt text of ``max_prompt_bytes`` (default: ``PROMPT_BYTES_PER_TOKEN`` x the context) written
    with JSON's escapes (``ensure_ascii``: up to 3 bytes a UTF-8 byte), a token-id list as long as
    the context (up to 16 bytes an id), and 64 KiB for the other fields; at most 1 MiB. A bigger
    body could only be refused after parsing it; it is refused before reading it (issue 53: 1 MB
    bodies parsed at once stall running streams).
    """
    from .protocol import PROMPT_BYTES_PER_TOKEN

    if not max_model_len:
        return MAX_BODY_BYTES
    text = (
        max_prompt_bytes if max_prompt_bytes is not None else PROMPT_BYTES_PER_TOKEN * max_model_len
    )
    return min(MAX_BODY_BYTES, 3 * text + 16 * max_model_len + (64 << 10))


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _refuse(send, e: ApiError, close: bool = False) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: JSON content type on POSTs, a body deadline, /metrics behind the keys (see
    the module)."""

    def __init__(self, app: Any, keys: KeyTable, max_body_bytes: int, body_timeout: float = 30.0,
                 metrics_open: bool = False) -> None:
        if not body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout!r}")
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes
        self.body_timeout, self.metrics_open = body_timeout, metrics_open

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == "/metrics" and not (self.metrics_open or self.keys.open):
            try:
                self.keys.tenant_for(_header(scope, b"authorization"))
            except AuthError as e:
                return await _refuse(
                    send,
                    ApiError(
                        401,
                        f"{e} (/metrics needs a key on a server with keys; "
                        "--open-metrics opens it)",
                        code="invalid_api_key",
                    ),
                )
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            too_big = ApiError(
                413,
                f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}",
                code="request_too_large",
            )
            # read and dropped unparsed (up to DRAIN_BYTES, within the deadline), so the client
            # reads the 413 instead of a reset connection; beyond that the connection is closed at
            # once
            drained = int(declared) <= DRAIN_BYTES and await self._drain(receive)
            return await _refuse(send, too_big, close=not drained)
        ctype = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if ctype not in JSON_TYPES:
            return await _refuse(send, ApiError(
                415, f"the body must be JSON sent as 'Content-Type: application/json', got "
                     f"{ctype or 'no content type'!r}", code="unsupported_media_type"))
        try:
            async with asyncio.timeout(self.body_timeout):
                body, rest = await self._read(receive)
        except TimeoutError:
            return await _refuse(
                send,
                ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} s",
                    code="request_timeout",
                ),
                close=True,
            )
        if body is None:  # the client went away while sending
            return None
        return await self.app(scope, _replay(body, rest, receive), send)

    async def _drain(self, receive) -> bool:
        """Read the body and drop it; False when it did not end within the deadline (or the client
        left)."""
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return False
                    if not message.get("more_body", False):
                        return True
        except TimeoutError:
            return False

    async def _read(self, receive) -> tuple[bytes | None, list[dict]]:
        """The body (at most ``max_body_bytes + 1`` bytes: the app answers 413 past its limit), or
        None if the client disconnected; and any message that is not body (kept for the app)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, []
            if message["type"] != "http.request":
                return b"".join(chunks), [message]
            chunk = message.get("body", b"")
            chunks.append(chunk[:self.max_body_bytes + 1 - size])
            size += len(chunks[-1])
            if not message.get("more_body", False) or size > self.max_body_bytes:
                return b"".join(chunks), []


def _replay(body: bytes, rest: list[dict], receive):
    """A ``receive`` that gives the whole body once, then what the connection sends (a
    disconnect)."""
    queue = [{"type": "http.request", "body": body, "more_body": False}, *rest]

    async def replay() -> dict:
        return queue.pop(0) if queue else await receive()
    return replay


def head_timeout_protocol(seconds: float) -> type:
    """uvicorn's ``H11Protocol`` that closes a connection whose request head is not complete within
    ``seconds``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if not seconds > 0:
        raise ValueError(f"the head timeout must be > 0 seconds, got {seconds!r}")

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._head_timer = self.loop.call_later(seconds, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()  # no whole request head in time: a slow client holds nothing

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # the head is complete (the body has its own deadline)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeoutH11Protocol
