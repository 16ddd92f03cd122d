"""``diagnose``: read a log, replay it, find the culprits, measure every fix.

The numbers, per block size: the hit rate with an unbounded cache and with the given capacity (what
vLLM's ``prefix_cache_hits / prefix_cache_queries`` would show for this traffic replayed in order),
and the token-level ceiling (a cache of block size 1 with unlimited room). Then, at the first block
size, each culprit's fix applied to the original log (*alone*) and the fixes applied one after the
other in the order of their position in the prompt (*chained*), each re-measured the same way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from .culprits import (
    Culprit,
    Finding,
    alignment_culprit,
    field_culprits,
    multiturn_culprit,
    order_culprits,
    public_prefixes,
    scan_pairs,
    simple_culprits,
    tenant_culprit,
    token_span_culprits,
)
from .divergence import Divergence, divergence
from .logio import BadLine, read_log, write_log
from .prepare import Prepared, prepare
from .replay import HitStats, block_chains, replay, replay_tokens, spot_check, unbounded_hits
from .tokenize import PromptEncoder, ids, model_config
from .vllm_metrics import read_metrics

FIELD_KINDS = ("volatile", "per-user", "per-session")  # noisy candidates: a quick look on a few windows first
QUICK_MIN, QUICK_WINDOWS, QUICK_SIZE = 3000, 4, 400  # logs above QUICK_MIN requests: 4 windows of 400
SECOND_LOOK = ("template", "whitespace", "order", "tools-order", "alignment", "tenant-salt")  # can hide behind later ones
KIND_ORDER = {"template": 0, "volatile": 1, "per-session": 1, "per-user": 1, "whitespace": 1, "order": 1,
              "tools-order": 1, "multi-turn": 2, "alignment": 3, "tenant-salt": 4}


@dataclass
class Diagnosis:
    """Everything the doctor measured about one log (``summary()`` prints it, ``report.write_report`` saves it)."""

    source: str
    model: str
    block_sizes: list[int]
    capacity_blocks: dict[int, int | None]
    lines: int  # non-blank lines read
    bad: list[BadLine]
    prep: Prepared
    tenants: list[str | None] | None
    tenant_field: str | None
    div: Divergence
    table: list[dict]  # one row per block size
    ceiling: dict
    top_points: list[dict]
    findings: list[Finding]
    scan: dict
    culprits: list[Culprit]
    baseline: dict
    chain: list[dict]
    final_top_points: list[dict]
    system_only: dict | None
    vllm: dict | None
    spot_checks: list[dict]
    timings: dict
    notes: list[str] = field(default_factory=list)
    final: Prepared | None = field(default=None, repr=False)  # the log with every fix applied
    enc: PromptEncoder | None = field(default=None, repr=False)

    min_effect: float = 0.002
    inputs: list[str] = field(default_factory=list)  # the files read (a report is never written where they are)

    @property
    def cap_key(self) -> str:
        """'capacity' when a capacity was given, else 'unbounded': the replay the culprits are measured with."""
        return "capacity" if self.baseline.get("capacity") else "unbounded"

    @property
    def kept(self) -> list[Culprit]:
        """The culprits whose fix changed the measurement, in fix order."""
        return [c for c in self.culprits if c.chained is not None and not c.no_effect]

    @property
    def requests(self) -> int:
        """Requests replayed (bad lines excluded)."""
        return len(self.prep.records)

    @property
    def block_size(self) -> int:
        """The block size the culprits are measured at (the first one given)."""
        return self.block_sizes[0]

    def row(self, block_size: int | None = None) -> dict:
        """The table row of one block size (default: the first)."""
        bs = self.block_size if block_size is None else block_size
        return next(r for r in self.table if r["block_size"] == bs)

    def culprit(self, kind: str) -> Culprit | None:
        """The first culprit of a kind (``volatile``, ``per-user``, ``order``, ...), or None."""
        return next((c for c in self.culprits if c.kind == kind), None)

    def summary(self) -> str:
        """The terminal summary."""
        from .report import format_summary

        return format_summary(self)


def _stats(st: HitStats) -> dict:
    return {"hit_rate": st.hit_rate, "hit_tokens": st.hit_tokens, "query_tokens": st.query_tokens,
            "computed_tokens": st.computed_tokens, "requests": st.requests, "too_big": st.too_big}


class _Meter:
    """Measures a log (records or token strs) at one block size the same way every time."""

    def __init__(self, bs: int, capacity: int | None, concurrency: int, tenant_field: str | None):
        self.bs, self.capacity, self.concurrency, self.tenant_field = bs, capacity, concurrency, tenant_field
        self._last: tuple | None = None  # (key, tokens, chains, result) of the last call

    def salts(self, prep: Prepared) -> list[str | None] | None:
        if not self.tenant_field:
            return None
        return [None if r.get(self.tenant_field) is None else str(r.get(self.tenant_field)) for r in prep.records]

    def __call__(self, prep: Prepared, policy: str | None = None, capacity: bool = True) -> dict:
        key = (id(prep.tokens), policy)
        if self._last is not None and self._last[0] == key and self._last[1] is prep.tokens:
            chains, out = self._last[2], dict(self._last[3])  # the same log measured just before (unbounded first)
        elif policy is None and not (self.capacity is not None and capacity):
            # unbounded only: the divergence positions give the hits, no block ids needed
            t0 = time.perf_counter()
            per = unbounded_hits(prep.tokens, self.bs, self.salts(prep))
            lengths = prep.lengths
            st = HitStats(self.bs, None, len(per), sum(lengths), sum(per), 0, time.perf_counter() - t0, per)
            self._last = None
            return {"unbounded": _stats(st)}
        else:
            salts = self.salts(prep)
            public = public_prefixes(prep, salts) if policy == "public-prefix" and salts else None
            chains = block_chains(prep.tokens, self.bs, salts, public)
            out = {"unbounded": _stats(replay(chains, prep.lengths, self.bs, None))}
        if self.capacity is not None and capacity and "capacity" not in out:
            out["capacity"] = _stats(replay(chains, prep.lengths, self.bs, self.capacity, self.concurrency))
        self._last = (key, prep.tokens, chains, out)
        return out


def _points(div: Divergence, tokens: list[str], enc: PromptEncoder | None, k: int = 5) -> list[dict]:
    """The most common divergence positions with the text around them (request | partner)."""
    out = []
    for pos, count in div.top_points(k):
        i = next(j for j, d in enumerate(div.position) if d == pos and div.partner[j] >= 0) \
            if any(d == pos and p >= 0 for d, p in zip(div.position, div.partner)) else None
        if i is None:
            continue
        p = div.partner[i]
        row = {"position": pos, "requests": count, "example_request": i, "partner": p}
        s, t = tokens[i], tokens[p]
        if enc is not None:
            row["before"] = enc.decode(s[max(0, pos - 24):pos])
            row["after_request"] = enc.decode(s[pos:pos + 16])
            row["after_partner"] = enc.decode(t[pos:pos + 16])
        else:
            row["before"] = str(ids(s[max(0, pos - 8):pos]))
            row["after_request"] = str(ids(s[pos:pos + 8]))
            row["after_partner"] = str(ids(t[pos:pos + 8]))
        out.append(row)
    return out


def capacity_for(block_sizes: list[int], capacity_blocks: int | None, kv_gib: float | None,
                 kv_bytes_per_token: int | None) -> dict[int, int | None]:
    """Blocks of each block size for the same KV memory (``capacity_blocks`` counts blocks of the first size)."""
    if capacity_blocks is not None:
        tokens = capacity_blocks * block_sizes[0]
        return {bs: tokens // bs for bs in block_sizes}
    if kv_gib is not None:
        if not kv_bytes_per_token:
            raise ValueError("--kv-gib needs the KV bytes per token of a model config")
        return {bs: int(kv_gib * 2**30 // (bs * kv_bytes_per_token)) for bs in block_sizes}
    return {bs: None for bs in block_sizes}


def kv_bytes_per_token_of(config: dict, dtype: str = "bfloat16") -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element, from a config.json dict."""
    cfg = config.get("text_config") or config
    layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    size = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "fp8": 1, "float8": 1}[dtype]
    return 2 * layers * kv * hd * size


def diagnose(log: str | Path | list, model: str | None = None, *, block_sizes: tuple[int, ...] = (16, 32, 64),
             capacity_blocks: int | None = None, kv_gib: float | None = None, kv_config: str | None = None,
             kv_dtype: str = "bfloat16", tenant_field: str | None = None, vllm_metrics: str | Path | None = None,
             sample: int = 400, seed: int = 0, concurrency: int = 1, alone: bool = False,
             encoder: PromptEncoder | None = None, spot_check_requests: int = 150,
             min_effect: float = 0.002) -> Diagnosis:
    """Diagnose a request log (JSONL path, or a list of dicts / JSON lines); see the module docstring."""
    timings: dict[str, float] = {}
    t = time.perf_counter()
    block_sizes = [int(b) for b in block_sizes]
    if not block_sizes or any(b < 1 for b in block_sizes):
        raise ValueError("block sizes must be positive ints")
    cpu0 = time.process_time()
    records, bad = read_log(log)
    lines = len(records) + len(bad)
    timings["read"] = time.perf_counter() - t
    notes: list[str] = []
    enc = encoder
    needs_text = any(r.kind != "token_ids" for r in records)
    t = time.perf_counter()
    if enc is None and (needs_text or model is not None):
        enc = PromptEncoder(model)
    timings["load tokenizer"] = time.perf_counter() - t
    t = time.perf_counter()
    prep = prepare(records, enc)
    bad = sorted(bad + prep.bad, key=lambda b: b.line)
    timings["render + tokenize"] = time.perf_counter() - t
    if enc is not None:
        notes += enc.notes
    kvb = None
    if kv_gib is not None:
        if kv_config:
            import json as _json
            from pathlib import Path as _P

            cfg_path = _P(kv_config)
            if cfg_path.is_dir():
                cfg_path = cfg_path / "config.json"
            if cfg_path.exists():
                cfg = _json.loads(cfg_path.read_text())
            else:
                from kvlab.engine.models import load_public_config

                cfg = load_public_config(kv_config)
        else:
            cfg = model_config(model)
        kvb = kv_bytes_per_token_of(cfg, kv_dtype)
        notes.append(f"--kv-gib {kv_gib}: {kvb} KV bytes per token ({kv_dtype}) from "
                     f"{kv_config or model or 'the bundled model'}'s config")
    caps = capacity_for(block_sizes, capacity_blocks, kv_gib, kvb)
    tenants = None
    if tenant_field:
        tenants = [None if r.get(tenant_field) is None else str(r.get(tenant_field)) for r in prep.records]
        missing = sum(x is None for x in tenants)
        if missing:
            notes.append(f"{missing} requests have no {tenant_field!r} field: they are replayed without a salt")

    # --- the numbers as the log is --------------------------------------------------------------------
    t = time.perf_counter()
    div = divergence(prep.tokens)
    timings["divergence"] = time.perf_counter() - t
    t = time.perf_counter()
    lengths = prep.lengths
    queries = sum(lengths)
    table = []
    meters = {bs: _Meter(bs, caps[bs], concurrency, tenant_field) for bs in block_sizes}
    salted_div = None if tenants is None else unbounded_hits(prep.tokens, 1, tenants)  # per request: min(d, n-1)
    shared = [min(d, n - 1) for d, n in zip(div.position, lengths)]
    for bs in block_sizes:
        row = {"block_size": bs, "capacity_blocks": caps[bs], "requests": len(lengths), "query_tokens": queries}
        u = sum(x // bs * bs for x in (salted_div if tenants is not None else shared))  # unbounded: from divergence
        row["unbounded_hit_rate"], row["unbounded_hit_tokens"] = u / queries if queries else 0.0, u
        if caps[bs] is not None:
            chains = block_chains(prep.tokens, bs, tenants)
            c = replay(chains, lengths, bs, caps[bs], concurrency)
            row["capacity_hit_rate"], row["capacity_hit_tokens"], row["too_big"] = c.hit_rate, c.hit_tokens, c.too_big
            if bs == block_sizes[0]:  # the culprits' baseline: the same replay
                u = replay(chains, lengths, bs, None)
                meters[bs]._last = ((id(prep.tokens), None), prep.tokens, chains,
                                    {"unbounded": _stats(u), "capacity": _stats(c)})
        if tenants is not None:
            un = sum(x // bs * bs for x in shared)
            row["unsalted_hit_rate"], row["unsalted_hit_tokens"] = un / queries if queries else 0.0, un
        row["short_requests"] = sum(1 for d, n in zip(div.position, lengths) if 0 < min(d, n - 1) < bs)
        table.append(row)
    ceiling_tokens = div.ceiling_hit_tokens()
    ceiling = {"hit_tokens": ceiling_tokens, "hit_rate": ceiling_tokens / queries if queries else 0.0,
               "repeat_requests": sum(1 for d, n in zip(div.position, lengths) if d >= n)}
    timings["replay (all block sizes)"] = time.perf_counter() - t
    t = time.perf_counter()
    checks = []
    if prep.tokens and spot_check_requests:
        bs0 = block_sizes[0]
        checks.append(spot_check(prep.tokens, bs0, caps[bs0], spot_check_requests, tenants, None, concurrency))
    timings["spot check vs BlockManager"] = time.perf_counter() - t
    if any(not c["equal"] for c in checks):
        notes.append("WARNING: the fast replay and kvlab.cache.BlockManager disagree on the spot check")
    top = _points(div, prep.tokens, enc)

    # --- culprits ------------------------------------------------------------------------------------------
    t = time.perf_counter()
    findings, scan = scan_pairs(prep, div, enc, sample=sample, seed=seed)
    culprits: list[Culprit] = []
    culprits += simple_culprits(prep, findings, enc)
    culprits += field_culprits(prep, findings, tenants=tenants)
    culprits += order_culprits(prep, findings)
    culprits += token_span_culprits(prep, findings)
    mt = multiturn_culprit(prep)
    if mt is not None:
        culprits.append(mt)
    bs0 = block_sizes[0]
    pad_text = "\n"
    pad = enc.token_id("\n") if enc is not None else 0
    al = alignment_culprit(prep, div, bs0, pad, pad_text)
    if al is not None:
        culprits.append(al)
    if tenants is not None:
        row0 = table[0]
        tc = tenant_culprit(prep, tenants, tenant_field, bs0, row0["unbounded_hit_tokens"], row0["unsalted_hit_tokens"])
        if tc is not None:
            culprits.append(tc)
    timings["find culprits"] = time.perf_counter() - t

    # --- measure every fix: one after the other, in the order they appear in the prompt ------------------
    t = time.perf_counter()
    meter = meters[bs0]
    baseline = meter(prep)
    cap_key = "capacity" if caps[bs0] is not None else "unbounded"
    order = sorted([c for c in culprits if c.measurable],
                   key=lambda c: (KIND_ORDER.get(c.kind, 1), c.position if c.position is not None else 10**9))
    chain = [{"step": "as logged", "kind": "", **_flat(baseline)}]
    cur, policy, last = prep, None, baseline
    effect = max(1, int(min_effect * max(1, baseline["unbounded"]["query_tokens"])))
    kept: list[Culprit] = []
    # In prompt order most differences are only hidden by one before them, fixed first; a fix that
    # changed nothing gets a second look once all the others are in (a difference after it hid it).
    groups = [[c for c in order if c.fix is not None], [c for c in order if c.fix is None]]  # rewrites, then tokens/policy
    n = len(prep.records)
    windows = [] if n <= QUICK_MIN else sorted({i for w in range(QUICK_WINDOWS)
                                                for i in range(w * n // QUICK_WINDOWS, w * n // QUICK_WINDOWS + QUICK_SIZE)})
    for group, attempt in ((g, a) for g in groups for a in (1, 2)):
        for c in list(group):
            if attempt == 2 and c.kind not in SECOND_LOOK:
                continue
            if windows and c.kind in FIELD_KINDS and not _quick_look(c, cur, windows, policy, enc, meter, min_effect / 2):
                c.chained, c.before, c.no_effect = None, {"unbounded": last["unbounded"]}, True
                c.details["quick look"] = f"no effect on {len(windows)} requests in {QUICK_WINDOWS} windows of the log"
                continue
            new, res, new_policy = _chain_step(c, cur, policy, enc, meter,
                                               capacity=c.policy is not None)  # unbounded only: cheap
            key = cap_key if c.policy is not None else "unbounded"
            # the prefill it saves (not the hits: padding and longer histories add hit tokens of their own)
            if last[key]["computed_tokens"] - res[key]["computed_tokens"] >= effect:
                res = meter(new, policy=new_policy) if c.policy is None else res
                c.chained, c.before, c.no_effect = res, last, False
                if new is not cur:  # what the fixed log holds: the log after this fix and the ones before it
                    c.details["state"] = new.tokens if new.padded else new.records
                    c.details["state_padded"] = new.padded
                cur, policy, last = new, new_policy, res
                kept.append(c)
                group.remove(c)
                chain.append({"step": c.title, "kind": c.kind, **_flat(res)})
            else:
                c.chained, c.before, c.no_effect = res, {k: last[k] for k in res}, True
    timings["measure fixes"] = time.perf_counter() - t
    t = time.perf_counter()
    if alone:
        for c in kept:
            c.alone = _apply_and_measure(c, prep, enc, meter)
    timings["measure fixes alone"] = time.perf_counter() - t
    culprits = kept + [c for c in culprits if c not in kept and c.measurable] + [c for c in culprits if not c.measurable]
    final_div = divergence(cur.tokens)
    final_top = _points(final_div, cur.tokens, enc)
    system_only = None
    if any(cur.sys_tokens):
        st = replay_tokens(cur.tokens, bs0, None)
        capped = sum(min(h, (s // bs0) * bs0) for h, s in zip(st.per_request, cur.sys_tokens))
        system_only = {"hit_rate_history_shared": st.hit_rate, "hit_rate_system_only": capped / st.query_tokens
                       if st.query_tokens else 0.0, "hit_tokens_history_shared": st.hit_tokens,
                       "hit_tokens_system_only": capped, "query_tokens": st.query_tokens}
    timings["cpu (process time, all phases)"] = time.process_time() - cpu0
    vllm = None
    if vllm_metrics is not None:
        vllm = read_metrics(vllm_metrics)
        vllm["file"] = str(vllm_metrics)
    return Diagnosis(str(log) if isinstance(log, (str, Path)) else f"<{len(records) + len(bad)} records>",
                     enc.name if enc is not None else "none (token ids)", block_sizes, caps, lines, bad, prep,
                     tenants, tenant_field, div, table, ceiling, top, findings, scan, culprits, baseline, chain,
                     final_top, system_only, vllm, checks, timings, notes, cur, enc, min_effect,
                     input_paths(log, model, kv_config, vllm_metrics))


def input_paths(*given: object) -> list[str]:
    """Those of ``given`` that are files or folders here (the inputs a report must never be written over)."""
    return [str(p) for p in given if isinstance(p, (str, Path)) and Path(p).expanduser().exists()]


def _flat(res: dict) -> dict:
    out = {}
    for cap, st in res.items():
        out[f"{cap}_hit_rate"] = st["hit_rate"]
        out[f"{cap}_computed_tokens"] = st["computed_tokens"]
        out[f"{cap}_query_tokens"] = st["query_tokens"]
    return out


def _apply_and_measure(c: Culprit, prep: Prepared, enc, meter: _Meter) -> dict | None:
    """One fix applied to the original log, measured."""
    if c.fix is not None:
        return meter(prepare(c.fix(prep.records), enc, base=prep))
    if c.token_fix is not None:
        return meter(c.token_fix(prep))
    if c.policy is not None:
        return meter(prep, policy=c.policy)
    return None


def _quick_look(c: Culprit, prep: Prepared, idx: list[int], policy: str | None, enc, meter: _Meter,
                share: float) -> bool:
    """Whether a field fix saves at least ``share`` of the prefill in a few windows of the log (cheap pre-check)."""
    sub = prep.subset(idx)
    quick = _Meter(meter.bs, None, 1, meter.tenant_field)
    before = quick(sub, policy=policy, capacity=False)["unbounded"]
    _, after, _ = _chain_step(c, sub, policy, enc, quick)
    return before["computed_tokens"] - after["unbounded"]["computed_tokens"] >= share * before["query_tokens"]


def _chain_step(c: Culprit, prep: Prepared, policy: str | None, enc, meter: _Meter, capacity: bool = False):
    """Apply one more fix on top of the ones before; return (log, measured, policy)."""
    if c.fix is not None:
        if prep.padded:
            raise RuntimeError("record fixes must come before token fixes (KIND_ORDER)")
        new = prepare(c.fix(prep.records), enc, base=prep)
        return new, meter(new, policy=policy, capacity=capacity), policy
    if c.token_fix is not None:
        new = c.token_fix(prep)
        return new, meter(new, policy=policy, capacity=capacity), policy
    if c.policy is not None:
        return prep, meter(prep, policy=c.policy, capacity=capacity), c.policy
    return prep, None, policy


def fixed_logs(d: Diagnosis, out_dir: str | Path) -> dict[str, Path]:
    """Write, per culprit, the log after its fix and the fixes before it (what its numbers measure); return paths.

    ``all_fixes.jsonl`` is the last of them. A padded log (alignment) is written as token ids. Every file is
    created new (FileExistsError if it is there: ``write_report`` clears the earlier run's files first).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for n, c in enumerate(d.kept, 1):
        name = f"{n:02d}_{c.kind}.jsonl"
        state = c.details.get("state")
        if state is None:
            continue  # a replay policy (the public prefix): the log itself does not change
        if c.details.get("state_padded"):
            paths[c.title] = write_log(({"token_ids": ids(s), **r.meta} for s, r in zip(state, d.prep.records)),
                                       out_dir / name, exclusive=True)
        else:
            paths[c.title] = write_log(state, out_dir / name, exclusive=True)
        c.fixed_log = str(paths[c.title])
    if d.final is not None:
        paths["all fixes"] = (_write_tokens(d.final, out_dir / "all_fixes.jsonl") if d.final.padded
                              else write_log(d.final.records, out_dir / "all_fixes.jsonl"))
    return paths


def _write_tokens(prep: Prepared, path: Path) -> Path:
    return write_log(({"token_ids": ids(s), **r.meta} for s, r in zip(prep.tokens, prep.records)), path, exclusive=True)


def median_or_none(xs: list[int]) -> int | None:
    """Median of a list, None when empty."""
    return int(statistics.median(xs)) if xs else None
