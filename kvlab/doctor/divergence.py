"""Where prompts stop matching: each request's longest prefix shared with an earlier one (its
partner)."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def lcp(a: str, b: str) -> int:
    """Length of the common prefix of two strs (binary search on slices: C-speed compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


@dataclass(slots=True)
class Divergence:
    """Per request: the divergence position (tokens) and the partner (-1 when nothing came
    before)."""

    position: list[int]
    partner: list[int]
    lengths: list[int]

    def ceiling(self) -> dict:
        """A token-granular cache with unlimited room and no salts: it hits min(divergence, n - 1)
        of each prompt."""
        hits, queries = (
            sum(min(d, n - 1) for d, n in zip(self.position, self.lengths)),
            sum(self.lengths),
        )
        return {"hit_tokens": hits, "hit_rate": hits / queries if queries else 0.0,
                "repeat_requests": sum(1 for d, n in zip(self.position, self.lengths) if d >= n)}

    def histogram(self) -> Counter:
        """Divergence position -> number of requests (requests that repeat an earlier prompt whole
        excluded)."""
        return Counter(d for d, n in zip(self.position, self.lengths) if d < n)

    def top_points(self, k: int = 5, min_position: int = 1) -> list[tuple[int, int]]:
        """The ``k`` most common divergence positions (>= ``min_position``) with their counts."""
        h = self.histogram()
        return [
            (p, c)
            for p, c in sorted(h.items(), key=lambda pc: (-pc[1], pc[0]))
            if p >= min_position
        ][:k]


def divergence(prompts: Sequence[str]) -> Divergence:
    """Divergence position and partner of every prompt against all earlier ones, in log order."""
    keys, owner, found = [], [], []  # keys: the earlier prompts, sorted; owner: the request of each
    for i, s in enumerate(prompts):
        # the longest match is a neighbour in sorted order; ties go to the one after
        j = bisect_left(keys, s)
        near = [(lcp(s, keys[n]), owner[n]) for n in (j, j - 1) if 0 <= n < len(keys)]
        found.append(max(near, key=lambda m: m[0], default=(0, -1)))  # (position, partner)
        keys.insert(j, s)
        owner.insert(j, i)
    return Divergence([d for d, _ in found], [p for _, p in found], [len(p) for p in prompts])
