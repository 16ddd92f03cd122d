"""Find why prompts stop sharing, and rewrite the log so they would.

A sample of requests is diffed against their partners (``textdiff``: each difference becomes a
``Finding``); the findings and the records are then read by three families of heuristics:

- ``fields``: a line whose value differs per request, per user or per conversation (timestamps, ids,
  names), or a span between fixed token contexts in a token-id log; the fix moves it to the end;
- ``structure``: whitespace, chat markup, tools order, items in varying order, history rebuilt instead
  of appended; the fix normalises, re-renders, sorts or appends;
- ``blocks``: shared prefixes that end inside a block (the fix pads them) and tenant salts that split a
  prefix several tenants send (the fix is a replay policy, the public prefix).

Every culprit carries its fix (``base.Culprit``); ``kvlab.doctor.core`` measures each one.
"""

from __future__ import annotations

from ..divergence import Divergence
from ..prepare import Prepared
from ..tokenization import PromptEncoder
from .base import Culprit, record_segments, with_contents
from .blocks import alignment_culprit, padded, public_prefixes, tenant_culprit
from .fields import FieldPattern, field_culprits, move_fields, token_span_culprits
from .structure import multiturn_culprit, order_culprits, template_culprit, tools_culprit, whitespace_culprit
from .textdiff import Finding, scan_pairs

__all__ = ["Culprit", "FieldPattern", "Finding", "find_culprits", "move_fields", "padded", "public_prefixes",
           "record_segments", "scan_pairs", "with_contents"]


def find_culprits(prep: Prepared, div: Divergence, enc: PromptEncoder | None, block_size: int, *,
                  tenants: list[str | None] | None = None, tenant_field: str | None = None,
                  salted_unsalted: tuple[int, int] | None = None, sample: int = 400,
                  seed: int = 0) -> tuple[list[Finding], dict, list[Culprit]]:
    """Diff a sample of pairs, then run every family; return (findings, what was scanned, culprits)."""
    findings, scan = scan_pairs(prep, div, enc, sample=sample, seed=seed)
    found = [whitespace_culprit(prep, findings), template_culprit(prep, findings, enc), tools_culprit(prep, findings)]
    found += field_culprits(prep, findings, tenants=tenants)
    found += order_culprits(prep, findings)
    found += token_span_culprits(prep, findings)
    found.append(multiturn_culprit(prep))
    pad = enc.token_id("\n") if enc is not None else 0
    found.append(alignment_culprit(prep, div, block_size, pad, "\n"))
    if tenants is not None and salted_unsalted is not None:
        found.append(tenant_culprit(prep, tenants, tenant_field or "", block_size, *salted_unsalted))
    return findings, scan, [c for c in found if c is not None]
