"""Tenants and isolation policies (pure Python): every cache salt the engine uses is derived here,
once.

A tenant's salt is HMAC-SHA256(server secret, tenant id). A request's ``cache_salt`` (vLLM's request
field) is combined with its tenant's scope, never used alone (``request_salt``):

    no cache_salt  -> the tenant's salt (none under "shared": every request shares)
    cache_salt=s   -> HMAC-SHA256(server secret, "kvlab-cache-salt" | tenant scope | s)

where the tenant scope is the tenant's salt under the isolation policy ("" under "shared"). So under
"shared" two requests with the same ``cache_salt`` share, whoever sends them (vLLM's behaviour: the
salt alone is the boundary), and under "tenant"/"public-prefix" a salt only splits a tenant's own
cache further: another tenant sending the same salt lands in another scope. A salted request never
hits the unsalted cache of its tenant. Under "public-prefix" the operator's public prefixes stay
shared by every salt (the engine salts only the blocks past them). The request keeps its tenant
either way: abort and fork are scoped by it and per-tenant metrics count it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import warnings
from collections.abc import Sequence

from ..cache.hashing import salted_block
from .errors import RequestError, RequestTypeError

POLICIES = ("shared", "tenant", "public-prefix")
MIN_SECRET_BYTES = 16


class SharedTenantsWarning(UserWarning):
    """Tenants were named on an engine whose isolation is "shared": their cached prefixes are not
    kept apart."""


def warn_shared_tenants(tenant: str, stacklevel: int = 2) -> None:
    """Warn (``SharedTenantsWarning``) that ``tenant`` was named on an engine whose tenants share
    every cached prefix."""
    warnings.warn(
        SharedTenantsWarning(
            f"tenant {tenant!r} on an engine with isolation='shared': tenants share every cached "
            "prefix (one tenant's prompts can speed up, and so reveal themselves to, another's); "
            "use isolation='tenant' or 'public-prefix' to keep them apart"
        ),
        stacklevel=stacklevel + 1,
    )


def new_secret() -> bytes:
    """A fresh 32-byte server secret (keep it on the server; never derive it from request data)."""
    return secrets.token_bytes(32)


def check_secret(secret: bytes | bytearray | str | None) -> bytes:
    """The server secret as bytes (a ``str`` by its UTF-8 bytes, >= 16 of them); ``None`` gives a
    fresh random one."""
    if secret is None:
        return new_secret()
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(
            "the server secret must be bytes or str (or None for a random one), got "
            f"{type(secret).__name__}"
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the server secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
        )
    return bytes(secret)


def tenant_salt(secret: bytes, tenant: str | None) -> str:
    """The cache salt of ``tenant``: HMAC-SHA256 of its id under the server secret, in hex."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the server secret must be at least {MIN_SECRET_BYTES} bytes")
    # a scope of its own: no tenant id's message, not even "", equals this one
    if tenant is None:
        return hmac.new(bytes(secret), b"kvlab-no-tenant", hashlib.sha256).hexdigest()
    if not isinstance(tenant, str):
        raise TypeError(f"a tenant id must be a str or None, got {type(tenant).__name__}")
    return hmac.new(
        bytes(secret), b"kvlab-tenant\x00" + tenant.encode(), hashlib.sha256
    ).hexdigest()


def request_salt(
    secret: bytes, isolation: str, tenant: str | None, cache_salt: str | None = None
) -> str | None:
    """The cache salt of a request of ``tenant`` with ``cache_salt`` under ``isolation`` (see the
    module docstring).

    Without a ``cache_salt``: the tenant's salt, or None under "shared". With one: HMAC-SHA256 under
    the secret of ``b"kvlab-cache-salt\\0" + scope + b"\\0" + cache_salt``, the scope being the
    tenant's salt ("" under "shared"): the bytes ``kvlab serve`` hashed before the engine derived
    it.
    """
    scope = None if isolation == "shared" else tenant_salt(secret, tenant)
    if cache_salt is None:
        return scope
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    msg = b"kvlab-cache-salt\x00" + (scope or "").encode() + b"\x00" + cache_salt.encode()
    return hmac.new(bytes(secret), msg, hashlib.sha256).hexdigest()


def check_policy(policy: str) -> str:
    """Return ``policy`` if it is one of ``POLICIES``, else raise ``ValueError``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown isolation policy {policy!r}: use one of {POLICIES}")
    return policy


def public_prefix_length(token_ids: Sequence[int], public_prefixes: Sequence[Sequence[int]]) -> int:
    """Tokens of the longest registered public prefix that ``token_ids`` starts with (0 if none)."""
    ids = list(token_ids)
    return max(
        (len(p) for p in public_prefixes if len(p) <= len(ids) and ids[: len(p)] == list(p)),
        default=0,
    )


def shared_public_tokens(public_tokens: int, block_size: int) -> int:
    """Tokens of the public prefix that tenants really share: whole blocks only."""
    return salted_block(public_tokens, block_size) * block_size


def check_cache_salt(cache_salt: str) -> str:
    """``cache_salt`` if it is a non-empty string of valid Unicode; else ``RequestError`` of
    "cache_salt"."""
    if not isinstance(cache_salt, str):
        raise RequestTypeError(
            "cache_salt", f"cache_salt must be a str or None, got {type(cache_salt).__name__}"
        )
    if not cache_salt:
        raise RequestError("cache_salt", "cache_salt must be a non-empty string if given")
    try:
        cache_salt.encode()
    # a lone surrogate: no bytes to hash
    except UnicodeEncodeError as e:
        raise RequestError("cache_salt", f"cache_salt is not valid Unicode: {e}") from None
    return cache_salt
