"""API keys -> tenants; a request's tenant and ``cache_salt`` go to the engine, which derives the
salt.

Keys come from a JSON file (``--api-keys FILE``) or the ``KVLAB_API_KEYS`` environment variable,
both a JSON object ``{"<key>": "<tenant>", ...}``; several keys may name one tenant. A request
presents its key as ``Authorization: Bearer <key>``; a missing or unknown key is refused (401),
never served under some other scope. With no keys configured the server is open: every request is
the one anonymous tenant (``None``), whatever key it sends.

A request's tenant and its ``cache_salt`` (vLLM's request field) go to ``Engine.add_request`` as
they are: the engine holds the one server secret and derives the salt
(``kvlab.engine.tenants.request_salt``: a ``cache_salt`` is combined with the tenant's scope, never
used alone). The server holds no secret.
"""

from __future__ import annotations

import hmac
import json
import os

__all__ = ["ENV_KEYS", "AuthError", "KeyTable", "load_api_keys"]

ENV_KEYS = "KVLAB_API_KEYS"
MAX_KEYS_FILE_BYTES = 1 << 20


class AuthError(Exception):
    """A request's API key is missing or unknown (the server answers 401)."""


def _check_table(table: object, where: str) -> dict[str, str]:
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: expected a non-empty JSON object mapping API key -> tenant id")
    for key, tenant in table.items():
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ValueError(
                f"{where}: every API key must be a non-empty string without surrounding spaces"
            )
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(
                f"{where}: the tenant of key {key[:4]}... must be a non-empty string, got "
                f"{tenant!r}"
            )
    return dict(table)


def load_api_keys(
    path: str | os.PathLike | None = None, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The key -> tenant table from ``path`` (JSON) or ``$KVLAB_API_KEYS``; ``{}`` (open server) if
    neither is set."""
    env = os.environ if env is None else env
    if path is not None:
        from ..inputs import read_input

        # a regular file of at most 1 MiB: /dev/zero, a FIFO or a folder refused by name
        where = os.fspath(path)
        data = read_input(where, "--api-keys", MAX_KEYS_FILE_BYTES)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte {e.start + 1})"
            ) from None
    elif env.get(ENV_KEYS):
        text, where = env[ENV_KEYS], f"${ENV_KEYS}"
    else:
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
    return _check_table(table, where)


class KeyTable:
    """Resolves an ``Authorization`` header to a tenant (``None`` on an open server)."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = _check_table(keys, "api keys") if keys else {}

    @property
    def open(self) -> bool:
        """True when no keys are configured: every request is the anonymous tenant."""
        return not self._keys

    @property
    def tenants(self) -> list[str]:
        """The distinct tenant ids, sorted."""
        return sorted(set(self._keys.values()))

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of ``Authorization: Bearer <key>``; raise ``AuthError`` for a missing or
        unknown key."""
        if self.open:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        found = None
        for known, tenant in self._keys.items():  # compare every key, in constant time each
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            raise AuthError("incorrect API key provided")
        return found

