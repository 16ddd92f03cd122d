"""What notebook 10_is_this_endpoint_sharing.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.audit import (
    AuditConfig,
    AuditResult,
    Endpoint,
    Level,
    Template,
    accuracy,
    chance_pvalue,
    run_audit,
    run_dictionary_attack,
    samples_to_detect,
)
from kvlab.audit.local import ServerProcess, start_kvlab
from kvlab.audit.procedure import Probe
from kvlab.lessons.common import record_files

# --- 10_is_this_endpoint_sharing.ipynb, cell 4 ---
KEYS = {"sk-alice": "acme", "sk-carol": "acme", "sk-bob": "globex"}  # API key -> org (tenant)
MODES = {"shared": "no isolation", "tenant": "per-tenant keys", "public-prefix": "public prefix"}
RECORD = "build/bench/audit_vllm.json"  # the last live vLLM audit, relative to the repository root


def start_servers(model: Any, system_prompt: str, modes: Sequence[str] = tuple(MODES),
                  device: str | None = None, dtype: str | None = None) -> dict[str, ServerProcess]:
    """A ``kvlab serve`` per isolation mode, started at once, ready on return (keys: ``KEYS``)."""
    servers = {}
    for mode in modes:
        extra = ["--public-prefix", system_prompt] if mode == "public-prefix" else []
        servers[mode] = start_kvlab(model, mode, KEYS, extra_args=extra, device=device, dtype=dtype)
    try:
        for s in servers.values():
            s.wait_ready()
    except Exception:
        for s in servers.values():
            s.close()
        raise
    return servers


# --- 10_is_this_endpoint_sharing.ipynb, cell 10 ---
@dataclass(frozen=True)
class Row:
    """An audit table row: who serves, what isolates, which level, its endpoints, what to expect."""

    server: str
    isolation: str
    level: str
    victim: Endpoint
    attacker: Endpoint
    expect: bool  # sharing expected by design
    head: str = ""
    head_in_miss: bool = True
    prefix_fraction: float | None = None  # None: the config's
    prompt_tokens: int | None = None  # None: the config's (tokens after ``head``)


def table_rows(urls: dict[str, str], model: str, system_prompt: str,
               after_tokens: int | None = None) -> list[Row]:
    """The audit table's levels: per user, per org and global on each kvlab serve mode, and per-user
    cache_salt."""
    def ep(mode: str, key: str, salt: str | None = None) -> Endpoint:
        return Endpoint(urls[mode], key, model, salt, key)

    rows, kv = [], "kvlab serve"
    per_org, cross_org = "per-org (two keys of acme)", "global (acme -> globex)"
    if "shared" in urls:
        iso, alice = MODES["shared"], ep("shared", "sk-alice")
        by_salt, salted = "per-user cache_salt", ep("shared", "sk-alice", "alice")
        rows += [Row(kv, iso, "per-user (same key)", alice, alice, True),
                 Row(kv, iso, per_org, alice, ep("shared", "sk-carol"), True),
                 Row(kv, iso, cross_org, alice, ep("shared", "sk-bob"), True),
                 Row(kv, by_salt, per_org, salted, ep("shared", "sk-carol", "carol"), False),
                 Row(kv, by_salt, cross_org, salted, ep("shared", "sk-bob", "bob"), False)]
    if "tenant" in urls:
        iso, alice = MODES["tenant"], ep("tenant", "sk-alice")
        rows += [Row(kv, iso, per_org, alice, ep("tenant", "sk-carol"), True),
                 Row(kv, iso, cross_org, alice, ep("tenant", "sk-bob"), False)]
    if "public-prefix" in urls:
        pp = MODES["public-prefix"]
        alice, bob = ep("public-prefix", "sk-alice"), ep("public-prefix", "sk-bob")
        rows += [Row(kv, pp, "global: the public system prompt", alice, bob, True, system_prompt,
                     False, 0.0, 32),
                 Row(kv, pp, "global: user text after it", alice, bob, False, system_prompt, True,
                     None, after_tokens)]
    return rows


def audit_table(rows: Sequence[Row], config: AuditConfig,
                progress: Any = None) -> tuple[list[dict], list[AuditResult]]:
    """Run every row's audit; return the table (server, isolation, level, p-value, samples,
    detected) and the results."""
    table, results = [], []
    for row in progress(rows) if progress else rows:
        opt = {"prefix_fraction": row.prefix_fraction, "prompt_tokens": row.prompt_tokens}
        cfg = AuditConfig(**{**vars(config), "head": row.head, "head_in_miss": row.head_in_miss,
                             **{k: v for k, v in opt.items() if v is not None}})
        res = run_audit(Level(row.level, row.victim, row.attacker), cfg)
        r = res.row()
        table.append({"server": row.server, "isolation": row.isolation, "sharing level": row.level,
                      "p-value": r["p-value"], "samples": r["samples"], "detected": r["detected"],
                      "expected by design": row.expect,
                      **{k: r[k] for k in ("median TTFT hit (ms)", "median TTFT miss (ms)")},
                      "cached tokens (server, hit median)":
                          r["server-reported cached tokens (hit, median)"],
                      "prompt tokens": r["prompt tokens"]})
        results.append(res)
    return table, results


# --- 10_is_this_endpoint_sharing.ipynb, cell 17 ---
def vllm_rows(url: str, model: str) -> list[Row]:
    """vLLM has no tenants: two users of an endpoint, without and with a per-user ``cache_salt``."""
    a, b = Endpoint(url, None, model, None, "alice"), Endpoint(url, None, model, None, "bob")
    return [Row("vllm serve", "no cache_salt", "global (another user)", a, b, True),
            Row("vllm serve", "per-user cache_salt", "global (another user)", a.with_salt("alice"),
                b.with_salt("bob"), False)]


def vllm_audit(server: ServerProcess, config: AuditConfig, progress: Any = None,
               root: Any = None) -> tuple[list[dict], str]:
    """Wait for ``vllm serve``, audit it (``vllm_rows``), record the table: (table, record path)."""
    from kvlab.audit import calibrate, first_model

    server.wait_ready()
    model = first_model(Endpoint(server.base_url))
    per_letter = calibrate(Endpoint(server.base_url, None, model))
    cfg = AuditConfig(**{**vars(config), "tokens_per_letter": per_letter})
    table, _ = audit_table(vllm_rows(server.base_url, model), cfg, progress)
    conf = {k: v for k, v in vars(cfg).items() if k != "head"}
    path = save_record({"rows": table, "model": model, "config": conf,
                        "vllm_started_s": server.started_s}, root)
    return table, path


save_record, load_record = record_files(RECORD)  # build/bench/audit_vllm.json, time-stamped


# --- 10_is_this_endpoint_sharing.ipynb, cell 20 ---
def dictionary_vs_k(victim: Endpoint, attacker: Endpoint, ks: Sequence[int], trials: int,
                    template: Template, tokens_per_letter: float = 1.0, seed: int = 0,
                    probe: Probe | None = None) -> list[dict]:
    """Accuracy of the fastest-candidate guess per k, unsalted and with per-user ``cache_salt``."""
    rows = []
    for salted in (False, True):
        v, a = ((victim.with_salt("victim"), attacker.with_salt("attacker")) if salted
                else (victim, attacker))
        for k in ks:
            g = run_dictionary_attack(v, a, k, trials, template,
                                      tokens_per_letter=tokens_per_letter, seed=seed + k,
                                      probe=probe)
            rows.append({"salts": "per-user cache_salt" if salted else "none", "k": k,
                         "trials": trials, "accuracy": accuracy(g), "chance (1/k)": 1 / k,
                         "p (binomial, vs chance)": chance_pvalue(g),
                         "cached right": statistics.median(_cached(g, True)),
                         "cached wrong": statistics.median(_cached(g, False))})
    return rows


def _cached(guesses: Sequence[Any], right: bool) -> list[int]:
    return [c or 0 for g in guesses for cand, c in zip(g.candidates, g.cached)
            if (cand == g.secret) == right]


# --- 10_is_this_endpoint_sharing.ipynb, cell 24 ---
def power_grid(level: Level, lengths: Sequence[int], fractions: Sequence[float],
               config: AuditConfig, target: float = 0.9, reps: int = 50,
               progress: Any = None) -> list[dict]:
    """One audit per (prompt length, prefix fraction): p-value, decision, samples to detect
    (by subsampling)."""
    cells = [(n, f) for n in lengths for f in fractions]
    rows = []
    for n, f in progress(cells) if progress else cells:
        cfg = AuditConfig(**{**vars(config), "prompt_tokens": n, "prefix_fraction": f})
        res = run_audit(level, cfg)
        need = samples_to_detect(res, target, reps, config.seed)
        rows.append({"prompt tokens": n, "prefix fraction": f, "p-value": res.pvalue,
                     "detected": res.detected, "samples to detect": need, "samples": len(res.hit),
                     "median TTFT hit (ms)": 1e3 * statistics.median(res.hit),
                     "median TTFT miss (ms)": 1e3 * statistics.median(res.miss)})
    return rows
