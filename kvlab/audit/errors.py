"""The audit's error for a server that answers badly; its own module so ``client`` and ``wire``
share it without a circle."""

from __future__ import annotations

__all__ = ["AuditHTTPError"]


class AuditHTTPError(RuntimeError):
    """The server answered a probe with an error status, an unreadable stream or JSON of the wrong
    shape."""
