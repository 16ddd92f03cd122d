"""The cache's own rules as culprits: shared prefixes that end inside a block (padded), and tenant
salts."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from ..divergence import Divergence, divergence, lcp
from ..prepare import Prepared
from .base import Culprit


def alignment_boundaries(tokens: list[str], div: Divergence, min_count: int = 3) -> list[str]:
    """Shared prefixes at which many requests diverge (template boundaries), as token strs."""
    counts: Counter = Counter()
    for i, (d, p) in enumerate(zip(div.position, div.partner)):
        if p >= 0 and 0 < d < len(tokens[i]):
            counts[tokens[i][:d]] += 1
    thresh = max(min_count, len(tokens) // 100)
    return sorted((pfx for pfx, c in counts.items() if c >= thresh), key=len)


def pad_to_blocks(tokens: list[str], boundaries: list[str], block_size: int, pad: int
                  ) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Pad every shared prefix a prompt starts with to a block boundary; return tokens, (position,
    pads) a prompt."""
    out, inserts = [], []
    for s in tokens:
        new, done, ins = [], 0, []
        # ascending length: each boundary is padded where it ends, shifted by earlier pads
        for b in boundaries:
            if s.startswith(b):
                new.append(s[done:len(b)])
                done = len(b)
                if k := -sum(map(len, new)) % block_size:
                    new.append(chr(pad) * k)
                    ins.append((done, k))
        new.append(s[done:])
        out.append("".join(new))
        inserts.append(ins)
    return out, inserts


def padded(prep: Prepared, block_size: int, pad: int) -> Prepared:
    """``prep`` with its shared prefixes padded to block boundaries (system-part lengths shifted
    alike)."""
    bounds = alignment_boundaries(prep.tokens, divergence(prep.tokens))
    toks, inserts = pad_to_blocks(prep.tokens, bounds, block_size, pad)
    sys_tokens = [
        st + sum(k for p, k in ins if p <= st) if st else 0
        for st, ins in zip(prep.sys_tokens, inserts)
    ]
    return Prepared(
        prep.records,
        prep.texts,
        toks,
        prep.segments,
        sys_tokens,
        prep.bad,
        padded=True,
        sys_chars=prep.sys_chars,
    )


def alignment_culprit(
    prep: Prepared, div: Divergence, block_size: int, pad: int, pad_text: str
) -> Culprit | None:
    """Shared prefixes that end inside a block (or are shorter than one): tokens shared but not
    cached."""
    shared = [min(d, n - 1) for d, n in zip(div.position, prep.lengths)]
    lost, short = sum(s % block_size for s in shared), sum(1 for s in shared if 0 < s < block_size)
    if not lost:
        return None
    bounds, frac = alignment_boundaries(prep.tokens, div), lost / max(sum(prep.lengths), 1)
    return Culprit(
        "alignment",
        f"shared prefixes end inside a {block_size}-token block"
        + (
            f"; {short} request{'s share' if short != 1 else ' shares'} less than one block"
            if short
            else ""
        ),
        int(statistics.median(len(b) for b in bounds)) if bounds else None,
        "block boundaries",
        [
            f"{lost} prompt tokens ({frac:.2%} of all) match an earlier prompt but sit in a block "
            f"that is not full of shared tokens, so they are recomputed",
            f"{short} requests share 1..{block_size - 1} tokens with an earlier prompt: less than "
            "one block, 0 hits",
            f"{len(bounds)} shared prefixes end where many requests diverge (template boundaries)",
        ],
        f"pad each of those shared prefixes to a multiple of {block_size} tokens with {pad_text!r} "
        "(the article's 5.4 advice); written as token ids",
        short,
        token_fix=lambda prep: padded(prep, block_size, pad),
        details={"lost_tokens": lost, "short_requests": short, "boundaries": len(bounds)},
    )


def public_prefixes(prep: Prepared, tenants: list[str | None], scan: int = 64) -> list[int]:
    """Per request, the length of its system part's prefix that another tenant sends too
    (tokens)."""
    heads: dict[str, set] = defaultdict(set)
    for ts, st, t in zip(prep.tokens, prep.sys_tokens, tenants):
        if st and t is not None:
            heads[ts[:st]].add(t)
    keys = sorted(heads)

    # the nearest head in sorted order another tenant sends
    def nearest_other(j: int, step: int) -> str | None:
        return next((keys[k] for k in range(j + step, j + step * (scan + 1), step)
                     if 0 <= k < len(keys) and heads[keys[k]] - heads[keys[j]]), None)

    best: dict[str, int] = {}
    # sent by several tenants: all of it; else the most it shares with a neighbour's
    for j, h in enumerate(keys):
        near = [o for o in (nearest_other(j, -1), nearest_other(j, 1)) if o is not None]
        best[h] = len(h) if len(heads[h]) > 1 else max((lcp(h, o) for o in near), default=0)
    return [best.get(ts[:st], 0) if st and t is not None else 0
            for ts, st, t in zip(prep.tokens, prep.sys_tokens, tenants)]


def tenant_culprit(prep: Prepared, tenants: list[str | None], field_name: str, block_size: int,
                   salted: int, unsalted: int) -> Culprit | None:
    """Tenant salts (vLLM's cache_salt) that split a prefix several tenants send."""
    distinct = sorted({t for t in tenants if t is not None})
    if len(distinct) < 2 or unsalted <= salted:
        return None
    pub = public_prefixes(prep, tenants)
    with_pub, median = (
        sum(p >= block_size for p in pub),
        int(statistics.median([p for p in pub if p] or [0])),
    )
    names = ", ".join(distinct[:6]) + (", ..." if len(distinct) > 6 else "")
    return Culprit(
        "tenant-salt",
        f"per-tenant cache salts split a prefix that {len(distinct)} tenants all send",
        median,
        f"field {field_name!r}",
        [
            f"{len(distinct)} tenants ({names}); salted per tenant the replay hits {salted} "
            f"tokens, without salts {unsalted}: salting gives up {unsalted - salted} hit tokens",
            f"{with_pub} requests start with a system-prompt prefix of >= one block that another "
            f"tenant sends too (median {median} tokens)",
        ],
        "public-prefix policy: share the operator's prefix that several tenants send, salt from "
        "the first block past it (kvlab Engine(isolation='public-prefix')); never drop the salts",
        with_pub,
        policy="public-prefix",
        details={"tenants": distinct},
    )
