"""Whose cached blocks a sequence may share: ``TenantScope`` (its ``cache_salt``, the public prefix
before it, its label) and ``NO_SCOPE`` (pure Python; re-exported by ``kvlab.cache.interface``).

The salt has one name from the request to the block hash (vLLM's ``cache_salt``) and one rule for
the block it enters (``kvlab.cache.hashing.salted_block``). An engine builds a scope for each
request (``kvlab.engine.intake``); ``NO_SCOPE``, equal to a scope with no salt, public prefix or
label, is the caches' default for a caller that gives none.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["NO_SCOPE", "TenantScope"]


@dataclass(slots=True, frozen=True, init=False)
class TenantScope:
    """Whose cached blocks a sequence may share: its ``cache_salt``, the public prefix before it,
    and its label.

    ``cache_salt`` enters the hash of one block (``kvlab.cache.hashing.salted_block``: block 0 by
    default, as in vLLM): from there on a tenant's blocks are its own, the whole blocks of an
    operator's public prefix before it stay shared. ``tenant`` labels the sequence in per-tenant
    metrics (default: the salt). An engine derives the salt from the request's ``cache_salt`` and
    its tenant (``kvlab.engine.tenants.request_salt``).
    """

    cache_salt: str | None = None
    public_tokens: int = 0
    tenant: Hashable = None
    # the name metrics use: the tenant, or the salt when no tenant is given (set from the fields)
    label: Hashable = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        cache_salt: str | None = None,
        public_tokens: int = 0,
        tenant: Hashable = None,
        *,
        salt: str | None = None,
    ) -> None:
        """``salt=``: the keyword's name before issue 51, still accepted from notebooks 04 and
        04b."""
        if salt is not None:
            if cache_salt is not None:
                raise TypeError("give cache_salt or its old name salt, not both")
            cache_salt = salt
        object.__setattr__(self, "cache_salt", cache_salt)
        object.__setattr__(self, "public_tokens", public_tokens)
        object.__setattr__(self, "tenant", tenant)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(
                f"cache_salt must be a str or None, got {type(self.cache_salt).__name__}"
            )
        if type(self.public_tokens) is not int or self.public_tokens < 0:
            raise ValueError(f"public_tokens must be an int >= 0, got {self.public_tokens!r}")
        try:
            # a key of the per-tenant metrics
            hash(self.tenant)
        except TypeError:
            raise TypeError(f"tenant must be hashable, got {type(self.tenant).__name__}") from None
        object.__setattr__(self, "label", self.cache_salt if self.tenant is None else self.tenant)

    @property
    def salt(self) -> str | None:
        """``cache_salt`` by its name before issue 51 (notebooks 04, 04b and 05 still read it)."""
        return self.cache_salt


# no salt, no public prefix: every request may hit every cached block
NO_SCOPE = TenantScope()
