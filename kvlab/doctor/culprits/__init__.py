"""Find why prompts stop sharing and how to rewrite the log so they would: ``textdiff`` diffs pairs,
then the ``fields``, ``structure`` and ``blocks`` heuristics each name culprits with their fix (see
docs/doctor.md)."""

from __future__ import annotations

from ..divergence import Divergence
from ..prepare import Prepared
from ..tokenization import PromptEncoder
from .base import Culprit, record_segments, with_contents
from .blocks import alignment_culprit, padded, public_prefixes, tenant_culprit
from .fields import FieldPattern, field_culprits, move_fields, token_span_culprits
from .structure import (
    multiturn_culprit,
    order_culprits,
    template_culprit,
    tools_culprit,
    whitespace_culprit,
)
from .textdiff import Finding, scan_pairs

__all__ = [
    "Culprit",
    "FieldPattern",
    "Finding",
    "find_culprits",
    "move_fields",
    "padded",
    "public_prefixes",
    "record_segments",
    "scan_pairs",
    "with_contents",
]


def find_culprits(prep: Prepared, div: Divergence, enc: PromptEncoder | None, block_size: int, *,
                  tenants: list[str | None] | None = None, tenant_field: str | None = None,
                  salted_unsalted: tuple[int, int] | None = None, sample: int = 400,
                  seed: int = 0) -> tuple[list[Finding], dict, list[Culprit]]:
    """Diff a sample of pairs, then run every family; return (findings, what was scanned,
    culprits)."""
    findings, scan = scan_pairs(prep, div, enc, sample=sample, seed=seed)
    found = [
        whitespace_culprit(prep, findings),
        template_culprit(prep, findings, enc),
        tools_culprit(prep, findings),
        *field_culprits(prep, findings, tenants=tenants),
        *order_culprits(prep, findings),
        *token_span_culprits(prep, findings),
        multiturn_culprit(prep),
        alignment_culprit(
            prep, div, block_size, enc.token_id("\n") if enc is not None else 0, "\n"
        ),
    ]
    if tenants is not None and salted_unsalted is not None:
        found.append(
            tenant_culprit(prep, tenants, tenant_field or "", block_size, *salted_unsalted)
        )
    return findings, scan, [c for c in found if c is not None]
