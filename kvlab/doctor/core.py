"""``diagnose``: read a log, prepare it, replay it, find the culprits, measure every fix;
``write_report``."""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import report
from .culprits import Culprit, Finding, find_culprits
from .divergence import Divergence, divergence
from .logio import BadLine, read_log, write_log
from .measure import Meter, measure_alone, measure_fixes, stats, tenant_salts
from .outdir import check_out_dir, clear, write_manifest
from .prepare import Prepared, prepare
from .replay import block_chains, replay, replay_tokens, spot_check, unbounded_hits
from .tokenization import PromptEncoder, ids, model_config
from .vllm_metrics import read_metrics

# The largest cache the doctor replays, in blocks of any block size: a billion blocks is over ten TB
# of K/V even for a 0.5B model, far past any server. The replay itself allocates no more blocks than
# the log can fill (``replay.pool_blocks``); this bound turns nonsense such as ``--kv-gib 1e30``
# into a clear error.
MAX_CAPACITY_BLOCKS = 10**9
KV_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "float8": 1,
}


@dataclass(kw_only=True)
class Diagnosis:
    """Everything the doctor measured about one log (``summary()`` prints it, ``write_report`` saves
    it)."""

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
    # the files read (a report is never written where they are)
    inputs: list[str] = field(default_factory=list)

    @property
    def cap_key(self) -> str:
        """'capacity' when a capacity was given, else 'unbounded': the replay the culprits are
        measured with."""
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
        return next(r for r in self.table if r["block_size"] == (block_size or self.block_size))

    def culprit(self, kind: str) -> Culprit | None:
        """The first culprit of a kind (``volatile``, ``per-user``, ``order``, ...), or None."""
        return next((c for c in self.culprits if c.kind == kind), None)

    def data(self) -> dict:
        """Every number of the diagnosis as one JSON-able dict: what every report is rendered
        from."""
        lens, enc, k = self.prep.lengths, self.enc, self.cap_key
        tok = (
            {}
            if enc is None
            else {
                "pieces": enc.pieces_total,
                "pieces_tokenized": enc.pieces_tokenized,
                "chars_tokenized": enc.chars_tokenized,
                "split_at_lines": enc.lines,
                "split_at_special_tokens": enc.segmented,
            }
        )
        return {
            "source": self.source,
            "model": self.model,
            "lines": self.lines,
            "requests": self.requests,
            "prompt_tokens": {
                "total": sum(lens),
                "mean": sum(lens) / len(lens) if lens else 0,
                "max": max(lens, default=0),
            },
            "tokenizer": tok,
            "malformed": [{"line": b.line, "error": b.error, "text": b.text} for b in self.bad],
            "block_sizes": self.block_sizes,
            "block_size": self.block_size,
            "capacity_blocks": {str(b): v for b, v in self.capacity_blocks.items()},
            "tenant_field": self.tenant_field,
            "cap_key": k,
            "min_effect": self.min_effect,
            "table": self.table,
            "ceiling": self.ceiling,
            "top_divergence_points": self.top_points,
            "divergence_histogram": sorted(self.div.histogram().items()),
            "culprits": [_culprit_data(c, k, self.kept) for c in self.culprits],
            "baseline": self.baseline,
            "chain": self.chain,
            "remaining_divergence_points": self.final_top_points,
            "system_only": self.system_only,
            "vllm": self.vllm,
            "spot_checks": self.spot_checks,
            "scan": self.scan,
            "timings": dict(self.timings),
            "notes": self.notes,
        }

    def summary(self) -> str:
        """The terminal summary."""
        return report.render_text(self.data())


def _culprit_data(c: Culprit, cap_key: str, kept_all: list[Culprit]) -> dict:
    kept = c in kept_all
    change = c.chained[cap_key]["hit_rate"] - c.before[cap_key]["hit_rate"] if kept else None
    return {
        "fix_order": kept_all.index(c) + 1 if kept else None,
        "kind": c.kind,
        "title": c.title,
        "position": c.position,
        "where": c.where,
        "evidence": c.evidence,
        "fix": c.fix_text,
        "affected": c.affected,
        "measurable": c.measurable,
        "kept": kept,
        "no_effect": c.no_effect,
        "quick_look": c.details.get("quick look"),
        "examples": c.examples[:1],
        "before": c.before,
        "chained": c.chained,
        "change": change,
        "alone": c.alone,
        "fixed_log": c.fixed_log,
    }


def _timed(timings: dict, phase: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its seconds recorded as ``timings[phase]``."""
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    timings[phase] = time.perf_counter() - t
    return out


def diagnose(
    log: str | Path | list,
    model: str | None = None,
    *,
    block_sizes: tuple[int, ...] = (16, 32, 64),
    capacity_blocks: int | None = None,
    kv_gib: float | None = None,
    kv_config: str | None = None,
    kv_dtype: str = "bfloat16",
    tenant_field: str | None = None,
    vllm_metrics: str | Path | None = None,
    sample: int = 400,
    seed: int = 0,
    concurrency: int = 1,
    alone: bool = False,
    encoder: PromptEncoder | None = None,
    spot_check_requests: int = 150,
    min_effect: float = 0.002,
) -> Diagnosis:
    """Diagnose a request log (JSONL path, or a list of dicts / JSON lines), phase by phase
    (docs/doctor.md)."""
    block_sizes = [int(b) for b in block_sizes]
    if not block_sizes or any(b < 1 for b in block_sizes):
        raise ValueError("block sizes must be positive ints")
    bs, timings, cpu0 = block_sizes[0], {}, time.process_time()
    # the cache's size first: a bad --kv-gib, --capacity-blocks or --kv-config fails before any work
    cap_notes: list[str] = []
    caps = _capacities(block_sizes, capacity_blocks, kv_gib, kv_config, kv_dtype, model, cap_notes)
    records, bad = _timed(timings, "read", read_log, log)
    load = encoder is None and (model is not None or any(r.kind != "token_ids" for r in records))
    enc = _timed(timings, "load tokenizer", lambda: PromptEncoder(model) if load else encoder)
    prep = _timed(timings, "render + tokenize", prepare, records, enc)
    notes = (list(enc.notes) if enc is not None else []) + cap_notes
    tenants = tenant_salts(prep, tenant_field)
    if tenants is not None and None in tenants:
        notes.append(
            f"{tenants.count(None)} requests have no {tenant_field!r} field: "
            "they are replayed without a salt"
        )
    div = _timed(timings, "divergence", divergence, prep.tokens)
    meter = Meter(bs, caps[bs], concurrency, tenant_field)
    table = _timed(
        timings,
        "replay (all block sizes)",
        _replay_table,
        prep,
        div,
        block_sizes,
        caps,
        tenants,
        concurrency,
        meter,
    )
    checks = _timed(timings, "spot check vs BlockManager", lambda: [
        spot_check(prep.tokens, bs, caps[bs], spot_check_requests, tenants, None, concurrency)
    ] if prep.tokens and spot_check_requests else [])
    if any(not c["equal"] for c in checks):
        notes.append(
            "WARNING: the fast replay and kvlab.cache.BlockManager disagree on the spot check"
        )
    salted = (table[0]["unbounded_hit_tokens"], table[0].get("unsalted_hit_tokens", 0))
    findings, scan, culprits = _timed(
        timings,
        "find culprits",
        find_culprits,
        prep,
        div,
        enc,
        bs,
        tenants=tenants,
        tenant_field=tenant_field,
        sample=sample,
        seed=seed,
        salted_unsalted=salted,
    )
    baseline, kept, chain, final = _timed(
        timings, "measure fixes", measure_fixes, culprits, prep, enc, meter, min_effect
    )
    _timed(timings, "measure fixes alone", measure_alone, kept if alone else [], prep, enc, meter)
    # a stable sort: the kept culprits first, in their order
    culprits = kept + sorted((c for c in culprits if c not in kept), key=lambda c: not c.measurable)
    top, final_top = (
        _points(div, prep.tokens, enc),
        _points(divergence(final.tokens), final.tokens, enc),
    )
    timings["cpu (process time, all phases)"] = time.process_time() - cpu0
    lines = len(records) + len(bad)
    return Diagnosis(
        source=str(log) if isinstance(log, (str, Path)) else f"<{lines} records>",
        model=enc.name if enc is not None else "none (token ids)",
        block_sizes=block_sizes,
        capacity_blocks=caps,
        lines=lines,
        bad=sorted(bad + prep.bad, key=lambda b: b.line),
        prep=prep,
        tenants=tenants,
        tenant_field=tenant_field,
        div=div,
        table=table,
        ceiling=div.ceiling(),
        top_points=top,
        findings=findings,
        scan=scan,
        culprits=culprits,
        baseline=baseline,
        chain=chain,
        final_top_points=final_top,
        system_only=_system_only(final, bs),
        spot_checks=checks,
        timings=timings,
        notes=notes,
        vllm=None
        if vllm_metrics is None
        else {**read_metrics(vllm_metrics), "file": str(vllm_metrics)},
        final=final,
        enc=enc,
        min_effect=min_effect,
        inputs=input_paths(log, model, kv_config, vllm_metrics),
    )


def _capacities(
    block_sizes: list[int],
    capacity_blocks: int | None,
    kv_gib: float | None,
    kv_config: str | None,
    kv_dtype: str,
    model: str | None,
    notes: list[str],
) -> dict[int, int | None]:
    """Blocks of each block size for the same KV memory (``capacity_blocks`` counts blocks of the
    first size).

    ``ValueError`` naming the option when a size is not a positive number or comes to more than
    ``MAX_CAPACITY_BLOCKS`` blocks of some block size (checked before anything is allocated).
    """
    if capacity_blocks is not None and (
        isinstance(capacity_blocks, bool)
        or not isinstance(capacity_blocks, numbers.Integral)
        or capacity_blocks < 1
    ):
        raise ValueError(f"--capacity-blocks must be a positive integer, got {capacity_blocks!r}")
    if kv_gib is not None and (isinstance(kv_gib, bool) or not isinstance(kv_gib, (int, float))
                               or not math.isfinite(kv_gib) or kv_gib <= 0):
        raise ValueError(f"--kv-gib must be a positive number, got {kv_gib!r}")
    if kv_gib is not None:
        where = f"{kv_config or model or 'the bundled model'}'s config"
        kvb = kv_bytes_per_token_of(_kv_config(kv_config, model), kv_dtype, where)
        notes.append(f"--kv-gib {kv_gib}: {kvb} KV bytes per token ({kv_dtype}) from {where}")
    if capacity_blocks is not None:
        caps = {bs: int(capacity_blocks) * block_sizes[0] // bs for bs in block_sizes}
        option = "--capacity-blocks"
    elif kv_gib is not None:
        # a float (inf or nan when kv_gib * 2**30 overflows): compared with the limit before int()
        caps, option = {bs: kv_gib * 2**30 // (bs * kvb) for bs in block_sizes}, "--kv-gib"
    else:
        return dict.fromkeys(block_sizes)
    given = capacity_blocks if option == "--capacity-blocks" else kv_gib
    for bs, n in caps.items():
        if not n <= MAX_CAPACITY_BLOCKS:  # nan too
            raise ValueError(
                f"{option} {given} comes to more than {MAX_CAPACITY_BLOCKS:,} blocks of {bs} "
                "tokens, the largest cache the doctor replays (MAX_CAPACITY_BLOCKS): give a "
                f"smaller {option}"
            )
        if n < 1:
            raise ValueError(
                f"--kv-gib {kv_gib} holds no whole block of {bs} tokens ({kvb} KV bytes per token)"
            )
    return {bs: int(n) for bs, n in caps.items()}


MAX_CONFIG_BYTES = 4 << 20  # a model's config.json is a few KiB


def _kv_config(kv_config: str | None, model: str | None) -> dict:
    """The config.json of --kv-config (a folder, a file or a shipped name), else of --model: a JSON
    object."""
    if not kv_config:
        config = model_config(model)
    else:
        path = Path(kv_config)
        path = path / "config.json" if path.is_dir() else path
        if path.exists():
            from ..inputs import read_input
            # /dev/zero, a FIFO, a huge file: one line
            data = read_input(path, "--kv-config", MAX_CONFIG_BYTES)
            try:
                config = json.loads(data.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(
                    f"--kv-config {kv_config}: {path} is not valid JSON ({e})"
                ) from None
        else:
            from kvlab.engine.models import load_public_config
            config = load_public_config(kv_config)
    if not isinstance(config, dict):
        raise ValueError(f"--kv-config {kv_config or model}: a model config is a JSON object, got "
                         f"{type(config).__name__}")
    return config


def _replay_table(
    prep: Prepared,
    div: Divergence,
    block_sizes: list[int],
    caps: dict,
    tenants: list | None,
    concurrency: int,
    meter: Meter,
) -> list[dict]:
    """One row per block size: unbounded (from the divergence positions), at capacity, without
    salts."""
    lengths, queries = prep.lengths, sum(prep.lengths)
    # an unbounded cache hits their whole blocks
    shared = [min(d, n - 1) for d, n in zip(div.position, lengths)]
    salted = shared if tenants is None else unbounded_hits(prep.tokens, 1, tenants)
    table = []
    for bs in block_sizes:
        hits = sum(x // bs * bs for x in salted)
        row = {
            "block_size": bs,
            "capacity_blocks": caps[bs],
            "requests": len(lengths),
            "query_tokens": queries,
            "unbounded_hit_rate": _rate(hits, queries),
            "unbounded_hit_tokens": hits,
        }
        if caps[bs] is not None:
            chains = block_chains(prep.tokens, bs, tenants)
            c = replay(chains, lengths, bs, caps[bs], concurrency)
            row.update(
                capacity_hit_rate=c.hit_rate, capacity_hit_tokens=c.hit_tokens, too_big=c.too_big
            )
            if bs == block_sizes[0]:  # the culprits' baseline: the same replay, kept for the meter
                meter.last = (
                    (id(prep.tokens), None),
                    prep.tokens,
                    chains,
                    {"unbounded": stats(replay(chains, lengths, bs, None)), "capacity": stats(c)},
                )
        if tenants is not None:
            unsalted = sum(x // bs * bs for x in shared)
            row.update(unsalted_hit_rate=_rate(unsalted, queries), unsalted_hit_tokens=unsalted)
        row["short_requests"] = sum(1 for s in shared if 0 < s < bs)
        table.append(row)
    return table


def _rate(hits: int, queries: int) -> float:
    return hits / queries if queries else 0.0


def _system_only(final: Prepared, bs: int) -> dict | None:
    """The fixed log's hit rate when only the system prompt is shared (article 5.4) vs the history
    too."""
    if not any(final.sys_tokens):
        return None
    st = replay_tokens(final.tokens, bs, None)
    capped = sum(min(h, (s // bs) * bs) for h, s in zip(st.per_request, final.sys_tokens))
    return {
        "hit_rate_history_shared": st.hit_rate,
        "hit_rate_system_only": _rate(capped, st.query_tokens),
        "hit_tokens_history_shared": st.hit_tokens,
        "hit_tokens_system_only": capped,
        "query_tokens": st.query_tokens,
    }


def _points(
    div: Divergence, tokens: list[str], enc: PromptEncoder | None, k: int = 5
) -> list[dict]:
    """The most common divergence positions with the text around them (request | partner)."""
    out, (show, w) = (
        [],
        (enc.decode, (24, 16)) if enc is not None else ((lambda x: str(ids(x))), (8, 8)),
    )
    for pos, count in div.top_points(k):
        i = next(
            (j for j, (d, p) in enumerate(zip(div.position, div.partner)) if d == pos and p >= 0),
            None,
        )
        if i is None:
            continue
        s, t = tokens[i], tokens[div.partner[i]]
        out.append(
            {
                "position": pos,
                "requests": count,
                "example_request": i,
                "partner": div.partner[i],
                "before": show(s[max(0, pos - w[0]) : pos]),
                "after_request": show(s[pos : pos + w[1]]),
                "after_partner": show(t[pos : pos + w[1]]),
            }
        )
    return out


def _positive_int(cfg: dict, name: str, where: str, default: int | None = None) -> int:
    """``cfg[name]`` checked to be a positive int (``default`` when absent or null, if there is
    one)."""
    value = cfg.get(name)
    if value is None and default is not None:
        return default
    if type(value) is not int or value < 1:
        what = "missing" if name not in cfg else f"{value!r}"
        raise ValueError(f"{where}: {name} must be a positive integer, got {what}")
    return value


def kv_bytes_per_token_of(
    config: dict, dtype: str = "bfloat16", where: str = "the model config"
) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element, from a config.json dict.

    Every field used must be a positive integer (``num_key_value_heads`` defaults to the attention
    heads, ``head_dim`` to ``hidden_size // num_attention_heads``); ``ValueError`` names the field
    and ``where``.
    """
    if dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"--kv-dtype {dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
    cfg = config.get("text_config") or config
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: text_config must be a JSON object, got {type(cfg).__name__}")
    heads = _positive_int(cfg, "num_attention_heads", where)
    kv = _positive_int(cfg, "num_key_value_heads", where, default=heads)
    if cfg.get("head_dim") is not None:
        hd = _positive_int(cfg, "head_dim", where)
    else:
        hd = _positive_int(cfg, "hidden_size", where) // heads
        if hd < 1:
            raise ValueError(
                f"{where}: hidden_size {cfg['hidden_size']} / num_attention_heads {heads} leaves a "
                "head dim of 0 (give head_dim)"
            )
    return 2 * _positive_int(cfg, "num_hidden_layers", where) * kv * hd * KV_DTYPE_BYTES[dtype]


def input_paths(*given: object) -> list[str]:
    """Those of ``given`` that are files or folders here (the inputs a report must never be written
    over)."""
    return [str(p) for p in given if isinstance(p, (str, Path)) and Path(p).expanduser().exists()]


def fixed_logs(d: Diagnosis, out_dir: str | Path) -> dict[str, Path]:
    """Write, per culprit, the log after its fix and the fixes before it, then ``all_fixes.jsonl``;
    return paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for n, c in enumerate(d.kept, 1):
        # none: a replay policy (the public prefix), the log itself does not change
        if "state" in c.details:
            paths[c.title] = write_log(
                _rows(c.details["state"]), out_dir / f"{n:02d}_{c.kind}.jsonl", exclusive=True
            )
            c.fixed_log = str(paths[c.title])
    if d.final is not None:
        paths["all fixes"] = write_log(_rows(d.final), out_dir / "all_fixes.jsonl", exclusive=True)
    return paths


def _rows(log: Prepared) -> Iterable:
    """A fixed log's records, or its padded tokens (alignment) as token-id lines with each record's
    metadata."""
    return (
        ({"token_ids": ids(s), **r.meta} for s, r in zip(log.tokens, log.records))
        if log.padded
        else log.records
    )


def write_report(d: Diagnosis, out_dir: str | Path, fixed: bool = True) -> dict[str, Path]:
    """summary.json, figures, fixed logs and report.html (all from one ``data()``) under a checked
    ``out_dir``."""
    out = Path(out_dir)
    clear(out, check_out_dir(out, d.inputs))
    try:
        logs = _timed(d.timings, "write fixed logs",
                      lambda: fixed_logs(d, out / "fixed") if fixed and d.requests else {})
        paths: dict[str, Path] = {f"fixed: {k}": v for k, v in logs.items()}
        data = d.data()
        figs = _timed(d.timings, "figures", report.figures, data, out)
        paths.update(figs)
        data["timings"] = dict(d.timings)
        for name, render in (("summary.json", lambda: json.dumps(data, indent=1, default=str)),
                             ("report.html", lambda: report.render_html(data, figs))):
            # created new: never over an existing file
            with open(out / name, "x", encoding="utf-8") as f:
                f.write(render())
            paths[name] = out / name
    finally:  # what was written, even when a write failed half-way: the next run deletes it
        write_manifest(out)
    return paths
