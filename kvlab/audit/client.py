"""The attacker's only instrument: time to first token of a streamed completion, measured on the
client.

An ``Endpoint`` is what a user of an OpenAI-compatible API holds: a base URL, an API key, a model
name and, where the server takes one (vLLM, kvlab serve), a ``cache_salt``. ``measure`` sends one
``POST /v1/completions`` with ``stream: true`` and ``max_tokens: 1`` and returns the seconds from
just before the request is written to the first streamed chunk that carries a choice: the prefill
the server did for this prompt, plus the network and the server's own overhead. The server's
``usage.prompt_tokens_details.cached_tokens`` is read when it reports one; the audit never uses it
to decide, only to show what the server itself says. Every answer is checked against the shapes in
``wire`` (pydantic): a server that answers something else gets ``AuditResponseError``, never a
traceback.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from .errors import AuditHTTPError

__all__ = ["AuditHTTPError", "Endpoint", "Timing", "first_model", "list_models", "measure"]


@dataclass(frozen=True)
class Endpoint:
    """One user of an OpenAI-compatible API: where, as whom, which model, and an optional
    ``cache_salt``."""

    base_url: str
    api_key: str | None = None
    model: str | None = None
    cache_salt: str | None = None
    name: str = ""  # a label for tables ("victim", "attacker, other org")

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        for field in ("api_key", "model", "cache_salt"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{field} must be a non-empty string or None, got {value!r}")

    def with_salt(self, cache_salt: str | None) -> Endpoint:
        """The same user with another ``cache_salt`` (None: none)."""
        return replace(self, cache_salt=cache_salt)

    def url(self, path: str) -> str:
        """``base_url`` joined with ``path`` ("/v1/completions" when base_url ends in "/v1":
        "/completions")."""
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and path.startswith("/v1/"):
            path = path[3:]
        return base + path

    def headers(self) -> dict[str, str]:
        """``Authorization: Bearer <key>`` when there is a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Timing:
    """One probe: its TTFT in seconds and, when the server reports them, prompt and cached
    tokens."""

    ttft: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def _client(http: Any) -> Any:
    import httpx

    return http if http is not None else httpx.Client(timeout=120.0)


def _unreachable(endpoint: Endpoint, err: Exception) -> AuditHTTPError:
    return AuditHTTPError(f"cannot reach {endpoint.base_url}: {type(err).__name__}: {err}")


def _json(text: str, what: str) -> Any:
    """``text`` decoded as JSON, or ``AuditResponseError`` naming ``what``."""
    from .wire import AuditResponseError

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise AuditResponseError(
            f"{what} answered a body that is not JSON: {text[:200]!r}"
        ) from None


def first_model(endpoint: Endpoint, http: Any = None) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    return list_models(endpoint, http)[0].id


def list_models(endpoint: Endpoint, http: Any = None) -> list[Any]:
    """The model cards ``GET /v1/models`` lists (``.id``, and ``.max_model_len`` where the server
    states it)."""
    import httpx

    from .wire import ModelList, parse

    client = _client(http)
    try:
        try:
            r = client.get(endpoint.url("/v1/models"), headers=endpoint.headers())
        except httpx.TransportError as e:
            raise _unreachable(endpoint, e) from None
        if r.status_code != 200:
            raise AuditHTTPError(f"GET /v1/models answered {r.status_code}: {r.text[:300]}")
        models = parse(ModelList, _json(r.text, "GET /v1/models"), "GET /v1/models").data
        if not models:
            raise AuditHTTPError("GET /v1/models lists no model")
        return models
    finally:
        if http is None:
            client.close()


def _body(endpoint: Endpoint, prompt: str) -> dict:
    body = {
        "model": endpoint.model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.cache_salt is not None:
        body["cache_salt"] = endpoint.cache_salt
    return body


def measure(endpoint: Endpoint, prompt: str, http: Any = None) -> Timing:
    """TTFT of ``prompt`` as ``endpoint``: a streamed completion of one token, timed on the
    client."""
    import httpx

    if endpoint.model is None:
        raise ValueError(
            "the endpoint has no model name: set Endpoint.model (first_model() lists the server's)"
        )
    client = _client(http)
    try:
        ttft, usage = _stream(client, endpoint, prompt)
    except httpx.TransportError as e:
        raise _unreachable(endpoint, e) from None
    finally:
        if http is None:
            client.close()
    if ttft is None:
        raise AuditHTTPError("the stream ended without a chunk that carries a choice")
    if usage is None:
        return Timing(ttft)
    details = usage.prompt_tokens_details
    return Timing(ttft, usage.prompt_tokens, details.cached_tokens if details is not None else None)


def _stream(client: Any, endpoint: Endpoint, prompt: str) -> tuple[float | None, Any]:
    """Send the request and read the stream: (seconds to the first chunk with a choice, the last
    ``Usage`` seen)."""
    from .wire import StreamChunk, parse

    what = "the stream of POST /v1/completions"
    ttft, usage = None, None
    t0 = time.perf_counter()
    with client.stream("POST", endpoint.url("/v1/completions"), json=_body(endpoint, prompt),
                       headers=endpoint.headers()) as r:
        if r.status_code != 200:
            r.read()
            raise AuditHTTPError(f"POST /v1/completions answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError as e:
                raise AuditHTTPError(
                    f"the stream sent a chunk that is not JSON: {data[:200]!r}"
                ) from e
            chunk = parse(StreamChunk, obj, what)
            if chunk.error is not None:
                raise AuditHTTPError(
                    f"the stream reported an error: {json.dumps(chunk.error)[:300]}"
                )
            if ttft is None and chunk.choices:
                ttft = time.perf_counter() - t0
            usage = chunk.usage or usage
    return ttft, usage
