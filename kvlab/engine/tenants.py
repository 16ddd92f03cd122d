"""Tenants and cache-isolation policies: who may share which cached blocks (pure Python, no torch).

A tenant never chooses its salt. The engine derives it from the tenant id and a server secret,

    salt = HMAC-SHA256(server_secret, tenant_id)

so a tenant that knows another tenant's id still cannot compute that tenant's salt, and a request
cannot carry one (vLLM's ``cache_salt`` is a request field; its docs say the salt "is not an isolation
boundary" precisely because a client supplies it). Three policies:

- ``"shared"``: no salt; every request may hit every cached block (vLLM without ``cache_salt``). Naming
  tenants on such an engine is allowed (notebook 07 measures what they leak to each other) but warns once
  per engine with ``SharedTenantsWarning``: their prefixes are shared, not isolated.
- ``"tenant"``: the tenant's salt enters the first block, so tenants share nothing.
- ``"public-prefix"``: the operator registers public prefixes (a system prompt every tenant may
  share). Their whole blocks are shared by all tenants; the salt enters the first block that extends
  past the public prefix, so a block straddling the boundary, and everything after it, is private.

References: vLLM ``cache_salt`` (its answer to CVE-2025-46570) and its prefix-caching design docs;
RFC 2104 (HMAC).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from ..cache.hashing import salted_block

POLICIES = ("shared", "tenant", "public-prefix")
DEFAULT_TENANT = ""  # kept for compatibility: no longer the scope of a request that names no tenant
MIN_SECRET_BYTES = 16


class SharedTenantsWarning(UserWarning):
    """Tenants were named on an engine whose isolation is "shared": their cached prefixes are not kept apart."""


def new_secret() -> bytes:
    """A fresh 32-byte server secret (keep it on the server; never derive it from request data)."""
    return secrets.token_bytes(32)


def check_secret(secret: bytes | bytearray | str | None) -> bytes:
    """The server secret as bytes: ``None`` gives a fresh random one; else ``bytes``/``str`` of >= 16 bytes.

    A ``str`` counts by its UTF-8 bytes. Anything else (an int such as ``32`` that ``bytes()`` would turn
    into zeros, a float, a list) raises ``TypeError``; a shorter secret raises ``ValueError``.
    """
    if secret is None:
        return new_secret()
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"the server secret must be bytes or str (or None for a random one), got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the server secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def tenant_salt(secret: bytes, tenant: str | None) -> str:
    """The cache salt of ``tenant``: HMAC-SHA256 of its id under the server secret, in hex.

    ``None`` (a request that names no tenant) is a scope of its own: its message can never equal a
    tenant id's, so no tenant id, not even ``""``, shares its salt.
    """
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the server secret must be at least {MIN_SECRET_BYTES} bytes")
    if tenant is None:
        return hmac.new(bytes(secret), b"kvlab-no-tenant", hashlib.sha256).hexdigest()
    if not isinstance(tenant, str):
        raise TypeError(f"a tenant id must be a str or None, got {type(tenant).__name__}")
    return hmac.new(bytes(secret), b"kvlab-tenant\x00" + tenant.encode(), hashlib.sha256).hexdigest()


def check_policy(policy: str) -> str:
    """Return ``policy`` if it is one of ``POLICIES``, else raise ``ValueError``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown isolation policy {policy!r}: use one of {POLICIES}")
    return policy


def public_prefix_length(token_ids: Sequence[int], public_prefixes: Sequence[Sequence[int]]) -> int:
    """Tokens of the longest registered public prefix that ``token_ids`` starts with (0 if none)."""
    ids = list(token_ids)
    return max((len(p) for p in public_prefixes if len(p) <= len(ids) and ids[: len(p)] == list(p)), default=0)


def shared_public_tokens(public_tokens: int, block_size: int) -> int:
    """Tokens of the public prefix that tenants really share: whole blocks only."""
    return salted_block(public_tokens, block_size) * block_size
