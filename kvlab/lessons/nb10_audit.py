"""Notebook 10: is this endpoint sharing its cache? ``kvlab.audit`` against ``kvlab serve`` and ``vllm serve``.

The experiments of the notebook, each a function: the audit table over every isolation mode of
``kvlab serve`` (section 1) and of real ``vllm serve`` (section 2, recorded to ``build/bench/`` when
live), the dictionary attack vs candidates and vs block size (section 3), detection power vs prompt
length and prefix fraction (section 4), and what each defence costs a shared public system prompt
(section 5); figures and the exercise checkers.

Reference: Gu et al., "Auditing Prompt Caching in Language Model APIs", ICML 2025.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.audit import (
    AuditConfig,
    AuditResult,
    Endpoint,
    Level,
    Template,
    Timing,
    accuracy,
    chance_pvalue,
    run_audit,
    run_dictionary_attack,
    samples_to_detect,
)
from kvlab.audit.local import ServerProcess, start_kvlab
from kvlab.audit.procedure import Probe
from kvlab.audit.prompts import letters_for, random_letters
from kvlab.lessons.common import Verdict, as_number, unanswered, verdict

__all__ = ["KEYS", "MODES", "RECORD", "Row", "audit_table", "check_min_samples", "check_right_guess_gain", "vllm_audit",
           "defence_cost", "dictionary_vs_block", "dictionary_vs_k", "engine_probe", "fig_dictionary", "fig_ecdf",
           "fig_power", "load_record", "power_grid", "public_system_prompt", "save_record", "start_servers",
           "table_rows", "vllm_rows"]

KEYS = {"sk-alice": "acme", "sk-carol": "acme", "sk-bob": "globex"}  # API key -> organisation (tenant)
MODES = {"shared": "no isolation", "tenant": "per-tenant keys", "public-prefix": "public prefix"}
RECORD = "build/bench/audit_vllm.json"  # the last live vLLM audit, relative to the repository root


def public_system_prompt(tokens: int, tokens_per_letter: float = 1.0, seed: int = 0) -> str:
    """The operator's public system prompt: about ``tokens`` tokens of spaced letters and a newline."""
    rng = random.Random(f"kvlab-nb10-system:{seed}")
    return "System: " + " ".join(random_letters(rng, letters_for(tokens, tokens_per_letter))) + "\n"


def start_servers(model: Any, system_prompt: str, modes: Sequence[str] = tuple(MODES), device: str | None = None,
                  dtype: str | None = None) -> dict[str, ServerProcess]:
    """One ``kvlab serve`` per isolation mode, all started at once, each ready on return (keys: ``KEYS``)."""
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


@dataclass(frozen=True)
class Row:
    """One line of the audit table: who serves, what isolates, which level, the level's endpoints, what to expect."""

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


def table_rows(urls: dict[str, str], model: str, system_prompt: str, after_tokens: int | None = None) -> list[Row]:
    """The audit table's levels: per user, per org and global on each kvlab serve mode, and per-user cache_salt.

    ``after_tokens``: the length of the user text after the public system prompt (None: the config's).
    """
    def ep(mode: str, key: str, salt: str | None = None) -> Endpoint:
        return Endpoint(urls[mode], key, model, salt, key)

    rows = []
    if "shared" in urls:
        rows += [Row("kvlab serve", MODES["shared"], "per-user (same key)", ep("shared", "sk-alice"), ep("shared", "sk-alice"), True),
                 Row("kvlab serve", MODES["shared"], "per-org (two keys of acme)", ep("shared", "sk-alice"), ep("shared", "sk-carol"), True),
                 Row("kvlab serve", MODES["shared"], "global (acme -> globex)", ep("shared", "sk-alice"), ep("shared", "sk-bob"), True),
                 Row("kvlab serve", "per-user cache_salt", "per-org (two keys of acme)", ep("shared", "sk-alice", "alice"),
                     ep("shared", "sk-carol", "carol"), False),
                 Row("kvlab serve", "per-user cache_salt", "global (acme -> globex)", ep("shared", "sk-alice", "alice"),
                     ep("shared", "sk-bob", "bob"), False)]
    if "tenant" in urls:
        rows += [Row("kvlab serve", MODES["tenant"], "per-org (two keys of acme)", ep("tenant", "sk-alice"), ep("tenant", "sk-carol"), True),
                 Row("kvlab serve", MODES["tenant"], "global (acme -> globex)", ep("tenant", "sk-alice"), ep("tenant", "sk-bob"), False)]
    if "public-prefix" in urls:
        pp = MODES["public-prefix"]
        rows += [Row("kvlab serve", pp, "global: the public system prompt", ep("public-prefix", "sk-alice"),
                     ep("public-prefix", "sk-bob"), True, system_prompt, False, 0.0, 32),
                 Row("kvlab serve", pp, "global: user text after it", ep("public-prefix", "sk-alice"),
                     ep("public-prefix", "sk-bob"), False, system_prompt, True, None, after_tokens)]
    return rows


def vllm_rows(url: str, model: str) -> list[Row]:
    """vLLM has no tenants: two users of one endpoint, without and with a per-user ``cache_salt``."""
    return [Row("vllm serve", "no cache_salt", "global (another user)", Endpoint(url, None, model, None, "alice"),
                Endpoint(url, None, model, None, "bob"), True),
            Row("vllm serve", "per-user cache_salt", "global (another user)", Endpoint(url, None, model, "alice", "alice"),
                Endpoint(url, None, model, "bob", "bob"), False)]


def audit_table(rows: Sequence[Row], config: AuditConfig, progress: Any = None) -> tuple[list[dict], list[AuditResult]]:
    """Run every row's audit; return the table (server, isolation, level, p-value, samples, detected) and results."""
    table, results = [], []
    for row in progress(rows) if progress else rows:
        cfg = AuditConfig(**{**vars(config), "head": row.head, "head_in_miss": row.head_in_miss,
                             **({} if row.prefix_fraction is None else {"prefix_fraction": row.prefix_fraction}),
                             **({} if row.prompt_tokens is None else {"prompt_tokens": row.prompt_tokens})})
        res = run_audit(Level(row.level, row.victim, row.attacker), cfg)
        r = res.row()
        table.append({"server": row.server, "isolation": row.isolation, "sharing level": row.level,
                      "p-value": r["p-value"], "samples": r["samples"], "detected": r["detected"],
                      "expected by design": row.expect, "median TTFT hit (ms)": r["median TTFT hit (ms)"],
                      "median TTFT miss (ms)": r["median TTFT miss (ms)"],
                      "cached tokens (server, hit median)": r["server-reported cached tokens (hit, median)"],
                      "prompt tokens": r["prompt tokens"]})
        results.append(res)
    return table, results


# --- section 2: vllm serve, live or the record of its last live audit ----------------------------------------
def vllm_audit(server: ServerProcess, config: AuditConfig, progress: Any = None, root: Any = None) -> tuple[list[dict], str]:
    """Wait for ``vllm serve``, audit it (``vllm_rows``) and record the table; return (table, record path)."""
    from kvlab.audit import calibrate, first_model

    server.wait_ready()
    model = first_model(Endpoint(server.base_url))
    cfg = AuditConfig(**{**vars(config), "tokens_per_letter": calibrate(Endpoint(server.base_url, None, model))})
    table, _ = audit_table(vllm_rows(server.base_url, model), cfg, progress)
    path = save_record({"rows": table, "model": model, "config": {k: v for k, v in vars(cfg).items() if k != "head"},
                        "vllm_started_s": server.started_s}, root)
    return table, path


def _root(root: Any) -> Path:
    return Path(root) if root is not None else Path(__file__).resolve().parents[2]


def save_record(record: dict, root: Any = None) -> str:
    """Write the vLLM audit to ``build/bench/audit_vllm.json`` with the time, so a run without vLLM can show it."""
    path = _root(root) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**record, "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
                               indent=1, default=str))
    return str(path)


def load_record(root: Any = None) -> dict | None:
    """The last recorded vLLM audit, or None when there is none (or it cannot be read)."""
    path = _root(root) / RECORD
    try:
        return json.loads(path.read_text()) | {"path": str(path)}
    except (OSError, json.JSONDecodeError):
        return None


# --- section 3: the dictionary attack --------------------------------------------------------------------------
def dictionary_vs_k(victim: Endpoint, attacker: Endpoint, ks: Sequence[int], trials: int, template: Template,
                    tokens_per_letter: float = 1.0, seed: int = 0, probe: Probe | None = None) -> list[dict]:
    """Accuracy of the fastest-candidate guess per k, unsalted and with a per-user ``cache_salt``."""
    rows = []
    for salted in (False, True):
        v, a = (victim.with_salt("victim"), attacker.with_salt("attacker")) if salted else (victim, attacker)
        for k in ks:
            g = run_dictionary_attack(v, a, k, trials, template, tokens_per_letter=tokens_per_letter, seed=seed + k,
                                      probe=probe)
            rows.append({"salts": "per-user cache_salt" if salted else "none", "k": k, "trials": trials,
                         "accuracy": accuracy(g), "chance (1/k)": 1 / k, "p (binomial, vs chance)": chance_pvalue(g),
                         "cached right": statistics.median(_cached(g, True)),
                         "cached wrong": statistics.median(_cached(g, False))})
    return rows


def _cached(guesses: Sequence[Any], right: bool) -> list[int]:
    return [c or 0 for g in guesses for cand, c in zip(g.candidates, g.cached) if (cand == g.secret) == right]


def engine_probe(engine: Any, tokenizer: Any) -> Probe:
    """A probe that runs in-process on an ``Engine`` (its own TTFT; ``cache_salt`` as the raw salt): no HTTP."""
    from kvlab.engine.models import encode
    from kvlab.engine.sampling import SamplingParams

    def probe(ep: Endpoint, prompt: str) -> Timing:
        ids = encode(tokenizer, prompt)
        out = engine.generate([ids], SamplingParams(max_tokens=1), unsafe_salts=[ep.cache_salt])[0]
        return Timing(out.ttft, len(ids), out.num_cached_tokens)

    return probe


def dictionary_vs_block(model: Any, tokenizer: Any, block_sizes: Sequence[int], k: int, trials: int,
                        template: Template, seed: int = 0) -> list[dict]:
    """Accuracy per block size, in-process on a fresh engine each (a cache property: no server restart needed)."""
    from kvlab.engine import Engine
    from kvlab.engine.models import encode

    before = len(encode(tokenizer, template.before))
    rows = []
    for bs in block_sizes:
        engine = Engine(model, tokenizer, num_blocks=max(64, 8192 // bs), block_size=bs)
        ep = Endpoint("http://in-process", None, "m")
        g = run_dictionary_attack(ep, ep, k, trials, template, seed=seed, probe=engine_probe(engine, tokenizer))
        right, wrong = _cached(g, True), _cached(g, False)
        rows.append({"block size": bs, "k": k, "trials": trials, "accuracy": accuracy(g), "chance (1/k)": 1 / k,
                     "p (binomial, vs chance)": chance_pvalue(g), "tokens before the secret": before,
                     "cached right": statistics.median(right), "cached wrong": statistics.median(wrong)})
    return rows


# --- section 4: power vs prompt length and prefix fraction -----------------------------------------------------
def power_grid(level: Level, lengths: Sequence[int], fractions: Sequence[float], config: AuditConfig,
               target: float = 0.9, reps: int = 50, progress: Any = None) -> list[dict]:
    """One audit per (prompt length, prefix fraction): p-value, decision, and samples to detect by subsampling."""
    cells = [(n, f) for n in lengths for f in fractions]
    rows = []
    for n, f in progress(cells) if progress else cells:
        res = run_audit(level, AuditConfig(**{**vars(config), "prompt_tokens": n, "prefix_fraction": f}))
        need = samples_to_detect(res, target, reps, config.seed)
        rows.append({"prompt tokens": n, "prefix fraction": f, "p-value": res.pvalue, "detected": res.detected,
                     "samples to detect": need, "samples": len(res.hit),
                     "median TTFT hit (ms)": 1e3 * statistics.median(res.hit),
                     "median TTFT miss (ms)": 1e3 * statistics.median(res.miss)})
    return rows


# --- section 5: what the defences cost -------------------------------------------------------------------------
def defence_cost(urls: dict[str, str], model: str, system_prompt: str, n_users: int = 6, question_tokens: int = 16,
                 tokens_per_letter: float = 1.0, seed: int = 0) -> list[dict]:
    """Users of both orgs send the public system prompt and a question of their own, one after another, per mode.

    Rows: the mode, requests, the hit rate (server-reported cached / prompt tokens) and the median TTFT of every
    user but the first (who always misses).
    """
    import httpx

    from kvlab.audit import measure

    keys = list(KEYS)
    modes = [("shared", False, MODES["shared"]), ("shared", True, "per-user cache_salt"),
             ("tenant", False, MODES["tenant"]), ("public-prefix", False, MODES["public-prefix"])]
    rows = []
    with httpx.Client(timeout=120.0) as http:
        for mode, salted, label in modes:
            if mode not in urls:
                continue
            rng = random.Random(f"kvlab-nb10-cost:{seed}:{label}")
            sys_text = system_prompt.replace("System:", f"System ({label}):", 1)  # a copy of its own per row
            if mode == "public-prefix":
                sys_text = system_prompt  # the one the server registered as public
            timings = []
            for u in range(n_users):
                key = keys[u % len(keys)]
                ep = Endpoint(urls[mode], key, model, f"user-{u}" if salted else None)
                q = " ".join(random_letters(rng, letters_for(question_tokens, tokens_per_letter)))
                timings.append(measure(ep, sys_text + q, http))
            later = timings[1:]
            rows.append({"isolation": label, "requests": n_users,
                         "hit rate": sum(t.cached_tokens or 0 for t in later) / sum(t.prompt_tokens or 1 for t in later),
                         "median TTFT (ms)": 1e3 * statistics.median(t.ttft for t in later),
                         "first user's TTFT (ms)": 1e3 * timings[0].ttft})
    return rows


# --- figures (pure: data in, matplotlib Figure out) -------------------------------------------------------------
def fig_ecdf(table: Sequence[dict], results: Sequence[AuditResult], cols: int = 3) -> Any:
    """One panel per audit: the empirical CDFs of hit and miss TTFTs (the KS statistic is their largest gap)."""
    import matplotlib.pyplot as plt

    n = len(results)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), squeeze=False)
    for ax, row, res in zip(axes.flat, table, results):
        for name, xs in (("hit procedure", res.hit), ("miss procedure", res.miss)):
            s = sorted(1e3 * x for x in xs)
            ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=name)
        ax.set_title(f"{row['isolation']}\n{row['sharing level']}: p={res.pvalue:.2g}", fontsize=8)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of probes")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def fig_dictionary(by_k: Sequence[dict], by_block: Sequence[dict]) -> Any:
    """Accuracy vs k (unsalted, salted, chance) and vs block size."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4.0))
    for salts in sorted({r["salts"] for r in by_k}):
        rs = [r for r in by_k if r["salts"] == salts]
        a.plot([r["k"] for r in rs], [r["accuracy"] for r in rs], "o-", label=f"salts: {salts}")
    ks = sorted({r["k"] for r in by_k})
    a.plot(ks, [1 / k for k in ks], "k:", label="chance (1/k)")
    a.set_xscale("log", base=2)
    a.set_xlabel("candidates k")
    a.set_ylabel("accuracy (fastest = secret)")
    a.set_title("over the wire (kvlab serve)")
    # legends below the axes: inside, they covered the chance line at small accuracies
    a.set_ylim(0, 1.05)
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    b.plot([r["block size"] for r in by_block], [r["accuracy"] for r in by_block], "o-", label="accuracy")
    b.axhline(by_block[0]["chance (1/k)"], color="k", ls=":", label="chance")
    b.set_xscale("log", base=2)
    b.set_xlabel("block size (tokens)")
    b.set_ylabel("accuracy")
    b.set_title(f"k = {by_block[0]['k']}, in-process engine")
    b.set_ylim(0, 1.05)
    b.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def fig_power(grid: Sequence[dict]) -> Any:
    """Samples per procedure needed to detect (power 0.9) vs prompt length, one line per prefix fraction."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    top = max(r["samples"] for r in grid)
    for f in sorted({r["prefix fraction"] for r in grid}):
        rs = [r for r in grid if r["prefix fraction"] == f]
        ax.plot([r["prompt tokens"] for r in rs], [r["samples to detect"] or top + 1 for r in rs], "o-",
                label=f"prefix fraction {f}")
    ax.axhline(top + 1, color="k", ls=":", lw=1, label=f"not detected with {top}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("samples per procedure to detect")
    ax.set_title("detection power (subsampled, power 0.9)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- exercise checkers ---------------------------------------------------------------------------------------------
def check_min_samples(answer: int | None, alpha: float = 1e-3) -> Verdict:
    """Exercise 10.1: the fewest samples per procedure for which an exact two-sided KS p-value can fall below alpha."""
    hint = ("the smallest p-value comes from D = 1 (no overlap at all): with n per side its exact two-sided p is "
            "2 / C(2n, n); find the first n where that is below alpha")
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of samples, not {answer!r}")
    n = 1
    while 2 / math.comb(2 * n, n) >= alpha:
        n += 1
    return verdict(value == n, f"{n} samples per procedure: 2 / C({2 * n}, {n}) = {2 / math.comb(2 * n, n):.2g} < {alpha}",
                   hint)


def check_right_guess_gain(answer: int | None, before: int, secret: int, after: int, block_size: int) -> Verdict:
    """Exercise 10.2: cached tokens a right guess gains over a wrong one (whole blocks only)."""
    hint = ("a wrong guess hits the whole blocks before the secret starts; a right one hits every whole block up to "
            "the end of the known text after it (and never the prompt's last token)")
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of tokens, not {answer!r}")
    want = (before + secret + after) // block_size * block_size - before // block_size * block_size
    return verdict(value == want, f"{want} tokens: whole blocks through the known text, minus those before the secret",
                   hint)
