"""Measure a log and every fix the same way: unbounded and at capacity, fixes chained in prompt
order."""

from __future__ import annotations

from .culprits import Culprit, public_prefixes
from .prepare import Prepared, prepare
from .replay import HitStats, block_chains, replay, unbounded_hits
from .tokenization import PromptEncoder

# one replay, as a dict
STATS = ("hit_rate", "hit_tokens", "query_tokens", "computed_tokens", "requests", "too_big")
# noisy candidates: a quick look on a few windows first
FIELD_KINDS = ("volatile", "per-user", "per-session")
# logs above QUICK_MIN requests: 4 windows of 400
QUICK_MIN, QUICK_WINDOWS, QUICK_SIZE = 3000, 4, 400
# hidden by later ones
SECOND_LOOK = ("template", "whitespace", "order", "tools-order", "alignment", "tenant-salt")
KIND_ORDER = {
    "template": 0,
    "volatile": 1,
    "per-session": 1,
    "per-user": 1,
    "whitespace": 1,
    "order": 1,
    "tools-order": 1,
    "multi-turn": 2,
    "alignment": 3,
    "tenant-salt": 4,
}


def stats(st: HitStats) -> dict:
    """The counters of one replay as a plain dict."""
    return {k: getattr(st, k) for k in STATS}


def tenant_salts(prep: Prepared, tenant_field: str | None) -> list[str | None] | None:
    """Each request's tenant (its cache salt; None without one), or None without a tenant field."""
    if not tenant_field:
        return None
    return [None if r.get(tenant_field) is None else str(r.get(tenant_field)) for r in prep.records]


class Meter:
    """Measures a log (records or token strs) at one block size the same way every time."""

    def __init__(self, bs: int, capacity: int | None, concurrency: int, tenant_field: str | None):
        self.bs, self.capacity, self.concurrency, self.tenant_field = (
            bs,
            capacity,
            concurrency,
            tenant_field,
        )
        self.last: tuple | None = None  # (key, tokens, chains, result) of the last call

    def __call__(self, prep: Prepared, policy: str | None = None, capacity: bool = True) -> dict:
        key, salts = (id(prep.tokens), policy), tenant_salts(prep, self.tenant_field)
        if self.last is not None and self.last[0] == key and self.last[1] is prep.tokens:
            # the same log measured just before (unbounded first)
            chains, out = self.last[2], dict(self.last[3])
        elif policy is None and not (self.capacity is not None and capacity):
            # unbounded: no block ids needed
            per, self.last = unbounded_hits(prep.tokens, self.bs, salts), None
            return {
                "unbounded": stats(HitStats(self.bs, None, len(per), sum(prep.lengths), sum(per)))
            }
        else:
            public = public_prefixes(prep, salts) if policy == "public-prefix" and salts else None
            chains = block_chains(prep.tokens, self.bs, salts, public)
            out = {"unbounded": stats(replay(chains, prep.lengths, self.bs, None))}
        if self.capacity is not None and capacity and "capacity" not in out:
            out["capacity"] = stats(
                replay(chains, prep.lengths, self.bs, self.capacity, self.concurrency)
            )
        self.last = (key, prep.tokens, chains, out)
        return out


def flat(res: dict) -> dict:
    """{"unbounded": {...}, "capacity": {...}} -> {"unbounded_hit_rate": ..., ...} (a row of the
    chain)."""
    return {
        f"{cap}_{k}": st[k]
        for cap, st in res.items()
        for k in ("hit_rate", "computed_tokens", "query_tokens")
    }


def measure_fixes(culprits: list[Culprit], prep: Prepared, enc: PromptEncoder | None, meter: Meter,
                  min_effect: float) -> tuple[dict, list[Culprit], list[dict], Prepared]:
    """Apply the measurable fixes one after the other; return (baseline, kept culprits, chain rows,
    fixed log)."""
    cap_key, baseline = "capacity" if meter.capacity is not None else "unbounded", meter(prep)
    order = sorted(
        [c for c in culprits if c.measurable],
        key=lambda c: (KIND_ORDER.get(c.kind, 1), c.position if c.position is not None else 10**9),
    )
    chain = [{"step": "as logged", "kind": "", **flat(baseline)}]
    cur, policy, last, kept = prep, None, baseline, []
    effect = max(1, int(min_effect * max(1, baseline["unbounded"]["query_tokens"])))
    # In prompt order most differences are only hidden by one before them, fixed first; a fix that
    # changed nothing gets a second look once all the others are in (a difference after it hid it).
    # records, then the rest
    groups = [[c for c in order if c.fix is not None], [c for c in order if c.fix is None]]
    n, w = len(prep.records), QUICK_WINDOWS
    starts = [k * n // w for k in range(w)] if n > QUICK_MIN else []
    windows = sorted({i for s in starts for i in range(s, s + QUICK_SIZE)})
    for group, attempt in ((g, a) for g in groups for a in (1, 2)):
        for c in list(group):
            if attempt == 2 and c.kind not in SECOND_LOOK:
                continue
            if (
                windows
                and c.kind in FIELD_KINDS
                and not _quick_look(c, cur, windows, policy, enc, meter, min_effect)
            ):
                c.chained, c.before, c.no_effect = None, {"unbounded": last["unbounded"]}, True
                c.details["quick look"] = (
                    f"no effect on {len(windows)} requests in {QUICK_WINDOWS} windows of the log"
                )
                continue
            new, res, new_policy = chain_step(
                c, cur, policy, enc, meter, capacity=c.policy is not None
            )
            key = cap_key if c.policy is not None else "unbounded"
            # the prefill it saves (not the hits: padding and longer histories add hit tokens of
            # their own)
            if last[key]["computed_tokens"] - res[key]["computed_tokens"] >= effect:
                res = meter(new, policy=new_policy) if c.policy is None else res
                c.chained, c.before, c.no_effect = res, last, False
                # what the fixed log holds: the log after this fix and the ones before it
                if new is not cur:
                    c.details["state"] = new
                cur, policy, last = new, new_policy, res
                kept.append(c)
                group.remove(c)
                chain.append({"step": c.title, "kind": c.kind, **flat(res)})
            else:
                c.chained, c.before, c.no_effect = res, {k: last[k] for k in res}, True
    return baseline, kept, chain, cur


def measure_alone(
    culprits: list[Culprit], prep: Prepared, enc: PromptEncoder | None, meter: Meter
) -> None:
    """Each culprit's fix applied alone to the original log, measured (``c.alone``)."""
    for c in culprits:
        c.alone = chain_step(c, prep, None, enc, meter, capacity=True)[1]


def _quick_look(
    c: Culprit,
    prep: Prepared,
    idx: list[int],
    policy: str | None,
    enc: PromptEncoder | None,
    meter: Meter,
    min_effect: float,
) -> bool:
    """Whether a field fix saves half of ``min_effect`` of the prefill in a few windows of the log
    (cheap pre-check)."""
    sub = prep.subset(idx)
    quick = Meter(meter.bs, None, 1, meter.tenant_field)
    before = quick(sub, policy=policy, capacity=False)["unbounded"]
    _, after, _ = chain_step(c, sub, policy, enc, quick)
    return (
        before["computed_tokens"] - after["unbounded"]["computed_tokens"]
        >= min_effect / 2 * before["query_tokens"]
    )


def chain_step(
    c: Culprit,
    prep: Prepared,
    policy: str | None,
    enc: PromptEncoder | None,
    meter: Meter,
    capacity: bool = False,
) -> tuple[Prepared, dict | None, str | None]:
    """Apply one more fix on top of the ones before; return (log, measured, policy)."""
    if c.fix is not None and prep.padded:
        raise RuntimeError("record fixes must come before token fixes (KIND_ORDER)")
    if c.fix is not None or c.token_fix is not None:
        new = (
            prepare(c.fix(prep.records), enc, base=prep) if c.fix is not None else c.token_fix(prep)
        )
        return new, meter(new, policy=policy, capacity=capacity), policy
    if c.policy is not None:
        return prep, meter(prep, policy=c.policy, capacity=capacity), c.policy
    return prep, None, policy

