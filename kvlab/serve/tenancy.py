"""API keys -> tenants, and how a request's ``cache_salt`` combines with the engine's tenant isolation.

Keys come from a JSON file (``--api-keys FILE``) or the ``KVLAB_API_KEYS`` environment variable, both
a JSON object ``{"<key>": "<tenant>", ...}``; several keys may name one tenant. A request presents its
key as ``Authorization: Bearer <key>``; a missing or unknown key is refused (401), never served under
some other scope. With no keys configured the server is open: every request is the one anonymous
tenant (``None``), whatever key it sends.

``cache_salt`` (vLLM's request field) is combined with the tenant's scope, never used alone:

    no cache_salt  -> the engine derives the salt from the tenant (none under "shared")
    cache_salt=s   -> salt = HMAC-SHA256(server secret, "kvlab-cache-salt" | tenant scope | s)

where the tenant scope is the engine's salt for the tenant under its isolation policy ("" under
"shared"). So under "shared" two requests with the same ``cache_salt`` share, whoever sends them
(vLLM's behaviour: the salt alone is the boundary), and under "tenant"/"public-prefix" a salt only
splits a tenant's own cache further: another tenant sending the same salt lands in another scope.
A salted request never hits the unsalted cache of its tenant. Under "public-prefix" the operator's
public prefixes stay shared by every salt (the engine salts only the blocks past them).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from ..engine.engine import Engine

__all__ = ["ENV_KEYS", "AuthError", "KeyTable", "load_api_keys", "request_scope"]

ENV_KEYS = "KVLAB_API_KEYS"


class AuthError(Exception):
    """A request's API key is missing or unknown (the server answers 401)."""


def _check_table(table: object, where: str) -> dict[str, str]:
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: expected a non-empty JSON object mapping API key -> tenant id")
    for key, tenant in table.items():
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ValueError(f"{where}: every API key must be a non-empty string without surrounding spaces")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}: the tenant of key {key[:4]}... must be a non-empty string, got {tenant!r}")
    return dict(table)


def load_api_keys(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The key -> tenant table from ``path`` (JSON) or ``$KVLAB_API_KEYS``; ``{}`` (open server) if neither is set."""
    env = os.environ if env is None else env
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the API key file {p}: {e}") from e
        where = str(p)
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
        """The tenant of ``Authorization: Bearer <key>``; raise ``AuthError`` for a missing or unknown key."""
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


def request_scope(engine: Engine, secret: bytes, tenant: str | None,
                  cache_salt: str | None) -> tuple[str | None, str | None]:
    """``(tenant, unsafe_salt)`` to pass to ``Engine.add_request`` for a request of ``tenant`` with ``cache_salt``.

    Without a salt the engine derives the scope from the tenant itself. With one, the salt is
    HMAC(secret, tenant scope + cache_salt) and the request is added without a tenant (the engine
    takes one or the other); see the module docstring.
    """
    if cache_salt is None:
        return tenant, None
    scope = engine.salt_for(tenant) or ""
    msg = b"kvlab-cache-salt\x00" + scope.encode() + b"\x00" + cache_salt.encode()
    return None, hmac.new(secret, msg, hashlib.sha256).hexdigest()
