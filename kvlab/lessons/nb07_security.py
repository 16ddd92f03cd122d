"""Isolation between tenants, measured: the timing side channel of a shared prefix cache, its defence,
what the defence costs, and a concurrency stress test.

- **The probe.** A cache hit skips prefill, so a hit is faster. A victim's prompt holds a secret after
  the operator's system prompt; an attacker sends candidate prompts and times each one's TTFT through
  the engine. Hits (right guess) and misses (wrong guess) are told apart by ``roc_auc`` (the
  Mann-Whitney statistic, written out) and by the two-sample Kolmogorov-Smirnov test, the test Gu et
  al. (ICML 2025, "Auditing Prompt Caching in Language Model APIs") used to detect cache sharing.
- **The cost.** Salting gives up every cross-tenant hit: each tenant prefills the operator's system
  prompt again and holds its own copy of its K/V. The public-prefix policy (``kvlab.engine.tenants``) keeps
  those blocks shared and salts only what follows.
- **The stress test.** Many tenants, overlapping prompts, random lengths, arrivals over time and a pool
  small enough to evict and preempt; every output must equal the same request generated alone by
  transformers' ``model.generate`` (``kvlab.engine.reference.hf_generate``: no paging, no block manager, no
  scheduler, no batching: an independent reference), with 0 cross-tenant hits and 0 leaked blocks.

References: InputSnatch (arXiv 2411.18191); "The Early Bird Catches the Leak" (arXiv 2409.20002);
"I Know What You Asked" (NDSS 2025); Gu et al., ICML 2025; vLLM ``cache_salt`` (CVE-2025-46570).
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# the one KS test (two-sample, two-sided, as in Gu et al.): the audit's, re-exported here for the notebook
from kvlab.audit.procedure import ks_test
from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import encode
from kvlab.engine.reference import hf_generate
from kvlab.engine.tenants import POLICIES, SharedTenantsWarning, salted_block
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict

__all__ = [
    "StressReport", "StressRequest", "attack_summary", "check_auc_fn", "check_prefill_tokens", "check_salt_split",
    "fig_roc", "fig_ttft_histogram", "isolation_cost", "ks_test", "roc_auc", "roc_curve", "run_attack", "run_stress",
    "stress_test", "stress_workload", "tenant_table", "timing_probe", "param_count", "memory_column", "CHECKLIST",
    "TEMPLATE", "FRAMEWORKS", "takeaways",
]


# --- statistics ----------------------------------------------------------------------------------------
def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the average of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def roc_auc(positive_scores: Sequence[float], negative_scores: Sequence[float]) -> float:
    """Area under the ROC curve = P(a positive scores higher than a negative), ties counting 1/2.

    Computed as the Mann-Whitney U statistic of the positives divided by ``n_pos * n_neg``:
    ``U = (sum of the positives' ranks in the pooled sample) - n_pos (n_pos + 1) / 2``.
    """
    pos, neg = [float(x) for x in positive_scores], [float(x) for x in negative_scores]
    if not pos or not neg:
        raise ValueError("need at least one positive and one negative score")
    ranks = _ranks(pos + neg)
    u = sum(ranks[: len(pos)]) - len(pos) * (len(pos) + 1) / 2
    return u / (len(pos) * len(neg))


def roc_curve(positive_scores: Sequence[float], negative_scores: Sequence[float]) -> tuple[list[float], list[float]]:
    """(false-positive rates, true-positive rates) as the threshold sweeps down over every score."""
    pos, neg = sorted(positive_scores, reverse=True), sorted(negative_scores, reverse=True)
    fpr, tpr = [0.0], [0.0]
    for t in sorted(set(pos) | set(neg), reverse=True):
        tpr.append(sum(p >= t for p in pos) / len(pos))
        fpr.append(sum(n >= t for n in neg) / len(neg))
    return fpr, tpr


# --- the attack ----------------------------------------------------------------------------------------
DOCUMENT_LINES = P.FILLER_EN  # the part of the victim's message the attacker knows (a form, a template)


def operator_system_prompt(n_lines: int = 12, seed: int = 0) -> str:
    """The operator's system turn (ChatML): filler lines, no secret. Every tenant's prompt starts with it."""
    rng = random.Random(f"kvlab-operator:{seed}")
    return P.chatml("system", "\n".join(rng.choice(P.FILLER_EN + P.FILLER_ZH) for _ in range(n_lines)))


def victim_message(secret: str, n_document_lines: int = 8) -> str:
    """The victim's user turn and the assistant header: the secret first, then a known document."""
    doc = "\n".join(DOCUMENT_LINES[i % len(DOCUMENT_LINES)] for i in range(n_document_lines))
    return P.chatml("user", f'My passphrase is "{secret}". Keep it safe.\n{doc}') + f"{P.IM_START}assistant\n"


def random_secret(rng: random.Random) -> str:
    """A 6-character passphrase from A-Z2-9 (all candidates have this form)."""
    return "".join(rng.choice(P.ALPHABET) for _ in range(6))


@dataclass(slots=True)
class Probe:
    """One timed request of the attacker."""

    trial: int
    candidate: str
    is_secret: bool  # the right guess: a hit if the cache is shared with the victim
    ttft: float  # seconds, arrival -> first token, measured by the engine
    cached_tokens: int
    prompt_tokens: int


def _generate(engine: Engine, prompts: list, sampling: SamplingParams, tenants: list) -> list:
    """``engine.generate`` with tenants; on the ``"shared"`` baseline the notebook states the risk itself, so the
    engine's ``SharedTenantsWarning`` (meant for operators who did not choose it knowingly) is not shown again."""
    with warnings.catch_warnings():
        if engine.isolation == "shared":
            warnings.simplefilter("ignore", SharedTenantsWarning)
        return engine.generate(prompts, sampling, tenants=tenants)


def timing_probe(engine: Engine, prompt_ids: Sequence[int], tenant: str | None) -> tuple[float, int]:
    """Send one prompt alone as ``tenant`` and return (TTFT in seconds, prompt tokens served by the cache)."""
    out = _generate(engine, [list(prompt_ids)], SamplingParams(max_tokens=1), [tenant])[0]
    return out.ttft, out.num_cached_tokens


def run_attack(engine: Engine, tokenizer: Any, n_trials: int, n_wrong: int, seed: int = 0,
               system_text: str | None = None, n_document_lines: int = 8,
               victim: str = "victim", attacker: str = "attacker") -> list[Probe]:
    """Per trial: the victim sends a fresh secret; the attacker probes it and ``n_wrong`` wrong candidates.

    The candidates are probed in a random order, each once (a repeated wrong guess would hit the
    attacker's own earlier probe). Under ``"public-prefix"`` the system prompt is registered as public.
    """
    rng = random.Random(seed)
    system_text = operator_system_prompt(seed=seed) if system_text is None else system_text
    if engine.isolation == "public-prefix":
        engine.add_public_prefix(system_text)
    system_ids = encode(tokenizer, system_text)
    # warm-up, not recorded: first calls are slow, and the attacker's own system-prompt blocks get cached
    timing_probe(engine, system_ids + encode(tokenizer, victim_message(random_secret(rng), n_document_lines)), attacker)
    probes: list[Probe] = []
    for trial in range(n_trials):
        secret = random_secret(rng)
        engine.generate([system_ids + encode(tokenizer, victim_message(secret, n_document_lines))],
                        SamplingParams(max_tokens=1), tenants=[victim])
        candidates = [secret] + [c for c in (random_secret(rng) for _ in range(n_wrong)) if c != secret]
        rng.shuffle(candidates)
        for cand in candidates:
            ids = system_ids + encode(tokenizer, victim_message(cand, n_document_lines))
            ttft, cached = timing_probe(engine, ids, attacker)
            probes.append(Probe(trial, cand, cand == secret, ttft, cached, len(ids)))
    return probes


def attack_summary(probes: Sequence[Probe], alpha: float = 0.01) -> dict:
    """ROC AUC (score = -TTFT: faster means "hit"), KS statistic and p-value, median TTFTs, the verdict."""
    hits = [p.ttft for p in probes if p.is_secret]
    misses = [p.ttft for p in probes if not p.is_secret]
    d, pvalue = ks_test(hits, misses)
    return {"probes": len(probes), "right guesses": len(hits),
            "median TTFT right (ms)": 1e3 * _median(hits), "median TTFT wrong (ms)": 1e3 * _median(misses),
            "cached tokens right": _median([p.cached_tokens for p in probes if p.is_secret]),
            "cached tokens wrong": _median([p.cached_tokens for p in probes if not p.is_secret]),
            "ROC AUC": roc_auc([-t for t in hits], [-t for t in misses]), "KS D": d, "KS p-value": pvalue,
            f"sharing detected (p < {alpha})": pvalue < alpha}


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float("nan") if not n else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


# --- the cost of isolation -----------------------------------------------------------------------------
def isolation_cost(model: Any, tokenizer: Any, n_tenants: int, per_tenant: int = 1, system_text: str | None = None,
                   policies: Sequence[str] = POLICIES, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> list[dict]:
    """One row per policy: prefill tokens computed, cross-tenant/public hits, peak KV bytes, wall time.

    Every tenant sends ``per_tenant`` requests that start with the same operator system prompt and end
    with a question of their own; all are submitted at once. ``outputs`` (token ids) lets the caller
    check that the policy changes what is computed, never what is answered.
    """
    system_text = operator_system_prompt(seed=seed) if system_text is None else system_text
    rng = random.Random(seed)
    system_ids = encode(tokenizer, system_text)
    prompts, tenants = [], []
    for t in range(n_tenants):
        for j in range(per_tenant):
            q = rng.choice(P.ASK_EN + P.CHAT_EN)
            user = P.chatml("user", f"Request {j} of tenant {t}. {q}") + f"{P.IM_START}assistant\n"
            prompts.append(system_ids + encode(tokenizer, user))
            tenants.append(f"tenant-{t}")
    need = sum(cdiv(len(p) + 2, block_size) for p in prompts) + 8
    rows = []
    for policy in policies:
        engine = Engine(model, tokenizer, num_blocks=need, block_size=block_size, isolation=policy,
                        max_num_seqs=len(prompts), max_num_batched_tokens=max(sum(map(len, prompts)), len(prompts)))
        engine.add_public_prefix(system_ids)
        t0 = time.perf_counter()
        outs = _generate(engine, prompts, SamplingParams(max_tokens=2), tenants)
        wall = time.perf_counter() - t0
        st = engine.stats()
        rows.append({"policy": policy, "requests": len(prompts), "prompt tokens": sum(map(len, prompts)),
                     "prefill tokens computed": sum(len(o.prompt_ids) - o.num_cached_tokens for o in outs),
                     "hit tokens": st["hit_tokens"], "public hits (blocks)": st["public_hits"],
                     "cross-tenant hits (blocks)": st["cross_tenant_hits"],
                     "peak KV blocks": st["peak_kv_bytes"] // engine.store.bytes_per_block,
                     "peak KV bytes": st["peak_kv_bytes"], "wall (s)": wall,
                     "median TTFT (ms)": 1e3 * _median([o.ttft for o in outs]),
                     "outputs": [o.output_ids for o in outs]})
    return rows


# --- the concurrency stress test ------------------------------------------------------------------------
@dataclass(slots=True)
class StressRequest:
    """One request of the stress workload: its prompt, tenant, sampling and the step it arrives at."""

    prompt_ids: list[int]
    tenant: str
    sampling: SamplingParams
    arrival_step: int


def stress_workload(tokenizer: Any, n_requests: int, n_tenants: int = 6, n_systems: int = 3, seed: int = 0,
                    max_tokens: tuple[int, int] = (1, 16), sampled_fraction: float = 0.2,
                    arrivals_per_step: float = 3.0) -> tuple[list[StressRequest], list[list[int]]]:
    """Mixed tenants, heavily overlapping prefixes, random lengths, arrivals over time.

    Prompts = one of ``n_systems`` operator system prompts (public), 0-2 history turns drawn from turns
    every tenant uses (identical text across tenants: the temptation to share) and the tenant's own
    turns, an optional document of random length, and a question. Returns (requests, public prefixes).
    """
    rng = random.Random(f"kvlab-stress:{seed}")
    systems = [P.make_example(seed * 100 + i, "heldout", n_filler=rng.randint(1, 14)).prefix_text
               for i in range(n_systems)]
    common = [P.chatml("user", rng.choice(P.CHAT_EN + P.CHAT_ZH)) + P.chatml("assistant", rng.choice(P.ACK_EN))
              for _ in range(3)]
    private = {f"tenant-{t}": [P.chatml("user", rng.choice(P.UPDATE_EN + P.UPDATE_ZH).format(p=P.random_passphrase(rng, "heldout")))
                               + P.chatml("assistant", rng.choice(P.ACK_EN + P.ACK_ZH)) for _ in range(2)]
               for t in range(n_tenants)}
    weights = [1 / (t + 1) for t in range(n_tenants)]  # a few heavy tenants, a long tail
    requests, step = [], 0.0
    for _ in range(n_requests):
        tenant = f"tenant-{rng.choices(range(n_tenants), weights)[0]}"
        text = rng.choice(systems)
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            text += rng.choice(common + private[tenant])
        doc = "\n".join(rng.choice(P.FILLER_EN + P.FILLER_ZH) for _ in range(rng.choice((0, 0, 1, 3, 6))))
        question = rng.choice(P.ASK_EN + P.ASK_ZH + P.CHAT_EN)
        text += P.chatml("user", f"{doc}\n{question}" if doc else question) + f"{P.IM_START}assistant\n"
        n_new = rng.randint(*max_tokens)
        if rng.random() < sampled_fraction:
            sp = SamplingParams(max_tokens=n_new, temperature=0.9, top_p=0.95, top_k=40, seed=rng.randrange(2 ** 31))
        else:
            sp = SamplingParams(max_tokens=n_new)
        step += rng.expovariate(arrivals_per_step)
        requests.append(StressRequest(encode(tokenizer, text), tenant, sp, int(step)))
    return requests, [encode(tokenizer, s) for s in systems]


def isolated_outputs(model: Any, tokenizer: Any, requests: Sequence[StressRequest]) -> list[list[int]]:
    """Each request generated alone by transformers' ``model.generate`` (``hf_generate``): the reference.

    Requests with the same prompt and sampling share one run of the longest ``max_tokens`` (a shorter
    one is its prefix: greedy and seeded sampling draw token by token).
    """
    longest: dict[tuple, int] = {}
    for r in requests:
        key = _ref_key(r)
        longest[key] = max(longest.get(key, 0), r.sampling.max_tokens)
    ref = {}
    for key, n in longest.items():
        ids, temperature, top_p, top_k, seed = key
        sp = {} if temperature == 0 else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        ref[key] = hf_generate(model, tokenizer, list(ids), max_new_tokens=n, **sp)
    return [ref[_ref_key(r)][: r.sampling.max_tokens] for r in requests]


def _ref_key(r: StressRequest) -> tuple:
    sp = r.sampling
    return (tuple(r.prompt_ids), sp.temperature, sp.top_p, sp.top_k, sp.seed if not sp.greedy else None)


@contextmanager
def _warnings_as_text() -> Iterator[None]:
    """Inside, a warning that is shown is formatted as ``Category: message`` only (filters and recording unchanged).

    The engine's warnings point at their caller (``stacklevel``), which here is this module, not the notebook:
    the default format would echo this module's source line under the warning, on the participant's page.
    """
    before = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_, **__: f"{category.__name__}: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = before


def run_stress(engine: Engine, requests: Sequence[StressRequest], check_every: int = 16) -> dict:
    """Feed requests at their arrival steps, step until drained, check invariants every ``check_every`` steps.

    Returns the outputs by request index and the engine's stats after the drain.
    """
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
    outs: dict[int, Any] = {}
    step, k = 0, 0
    t0 = time.perf_counter()
    while k < len(pending) or engine.has_unfinished():
        while k < len(pending) and requests[pending[k]].arrival_step <= step:
            r = requests[pending[k]]
            with _warnings_as_text():  # "shared" warns once: its text, not this line
                engine.add_request(r.prompt_ids, r.sampling, request_id=pending[k], tenant=r.tenant)
            k += 1
        if engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
        step += 1
        if step % check_every == 0:
            engine.check_invariants()
    engine.check_invariants()
    return {"outputs": outs, "stats": engine.stats(), "steps": step, "seconds": time.perf_counter() - t0}


@dataclass
class StressReport:
    """What the stress run found; ``line()`` is the one-line verdict scripts print last."""

    requests: int
    mismatches: int
    cross_tenant_hits: int
    leaked_blocks: int
    public_hits: int
    evictions: int
    preemptions: int
    hit_rate: float
    policy: str
    seconds: float
    num_blocks: int = 0  # the pool's size: small, so blocks are evicted and sequences preempted
    mismatched: list[int] = field(default_factory=list)
    tenant_table: list[dict] = field(default_factory=list)  # per-tenant requests, hits, misses by reason
    preempted_lookups: int = 0  # the block manager's lookups of re-admitted (preempted) requests

    @property
    def ok(self) -> bool:
        """0 mismatches, 0 cross-tenant hits (unless nothing is salted), 0 leaked blocks."""
        return (self.mismatches == 0 and self.leaked_blocks == 0
                and (self.cross_tenant_hits == 0 or self.policy == "shared"))

    def line(self) -> str:
        """``requests=<n> mismatches=<m> cross_tenant_hits=<h> leaked_blocks=<b>``."""
        return (f"requests={self.requests} mismatches={self.mismatches} "
                f"cross_tenant_hits={self.cross_tenant_hits} leaked_blocks={self.leaked_blocks}")


def stress_test(model: Any, tokenizer: Any, n_requests: int, policy: str = "public-prefix", seed: int = 0,
                num_blocks: int = 48, block_size: int = DEFAULT_BLOCK_SIZE, max_num_seqs: int = 24,
                reference: list[list[int]] | None = None, workload: tuple | None = None,
                check_every: int = 16) -> StressReport:
    """Run the stress workload through one engine under ``policy`` and compare with ``isolated_outputs``."""
    requests, publics = stress_workload(tokenizer, n_requests, seed=seed) if workload is None else workload
    engine = Engine(model, tokenizer, num_blocks=num_blocks, block_size=block_size, isolation=policy,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, seed=seed)
    for ids in publics:
        engine.add_public_prefix(ids)
    run = run_stress(engine, requests, check_every)
    if reference is None:
        reference = isolated_outputs(model, tokenizer, requests)
    outs = run["outputs"]
    mismatched = [i for i in range(len(requests))
                  if i not in outs or outs[i].finish_reason == "error" or outs[i].output_ids != reference[i]]
    st, bm = run["stats"], engine.block_manager
    leaked = sum(b.ref_count > 0 for b in bm.pool.blocks) + len(bm.seqs)
    return StressReport(len(requests), len(mismatched), st["cross_tenant_hits"], leaked, st["public_hits"],
                        st["evictions"], st["num_preemptions"], st["hit_rate"], policy, run["seconds"], num_blocks, mismatched,
                        tenant_table(requests, outs, bm.metrics.tenant_table()), bm.metrics.preempted.requests)


def tenant_table(requests: Sequence[StressRequest], outputs: dict[int, Any], lookups: Sequence[dict]) -> list[dict]:
    """One row per tenant, counted per *request* (each request once).

    ``requests``, ``prompt tokens`` and ``cached at first admission`` come from the workload and the outputs;
    ``re-admissions`` is the sum of the outputs' ``num_preemptions``. The block manager counts a preempted
    request's later lookups apart (as vLLM does), so its per-tenant ``requests`` must equal the workload's:
    checked, a ValueError says otherwise.
    """
    by_label = {row["tenant"]: row["requests"] for row in lookups}
    rows: dict[str, dict] = {}
    for i, r in enumerate(requests):
        row = rows.setdefault(r.tenant, {"tenant": r.tenant, "requests": 0, "prompt tokens": 0,
                                         "cached at first admission": 0, "re-admissions": 0})
        out = outputs.get(i)
        row["requests"] += 1
        row["prompt tokens"] += len(r.prompt_ids)
        row["cached at first admission"] += out.num_cached_tokens if out is not None else 0
        row["re-admissions"] += out.num_preemptions if out is not None else 0
    for row in rows.values():
        row["hit rate (first admission)"] = row["cached at first admission"] / max(row["prompt tokens"], 1)
    if by_label and set(by_label) == set(rows):  # the manager labels sequences by tenant: counts must agree
        for row in rows.values():
            if by_label[row["tenant"]] != row["requests"]:
                raise ValueError(f"tenant {row['tenant']}: the block manager counted {by_label[row['tenant']]} "
                                 f"requests, the workload has {row['requests']}")
    return sorted(rows.values(), key=lambda row: row["tenant"])


# --- figures (pure: data in, matplotlib Figure out) -----------------------------------------------------
def fig_ttft_histogram(probes_by_policy: dict[str, Sequence[Probe]], bins: int = 20) -> Any:
    """One panel per policy: TTFT histograms (ms) of right guesses (hits if shared) and wrong guesses."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(probes_by_policy), figsize=(4.2 * len(probes_by_policy), 3.2), squeeze=False)
    for ax, (policy, probes) in zip(axes[0], probes_by_policy.items()):
        right = [1e3 * p.ttft for p in probes if p.is_secret]
        wrong = [1e3 * p.ttft for p in probes if not p.is_secret]
        lo, hi = min(right + wrong), max(right + wrong)
        edges = [lo + (hi - lo) * i / bins for i in range(bins + 1)] if hi > lo else bins
        ax.hist(wrong, bins=edges, alpha=0.6, label=f"wrong guess (n={len(wrong)})", density=True)
        ax.hist(right, bins=edges, alpha=0.6, label=f"right guess (n={len(right)})", density=True)
        ax.set_title(f"policy: {policy}")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("density")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_roc(probes_by_policy: dict[str, Sequence[Probe]]) -> Any:
    """ROC curves of the "faster means hit" detector, one line per policy."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 4))
    for policy, probes in probes_by_policy.items():
        right = [-p.ttft for p in probes if p.is_secret]
        wrong = [-p.ttft for p in probes if not p.is_secret]
        fpr, tpr = roc_curve(right, wrong)
        ax.plot(fpr, tpr, label=f"{policy} (AUC {roc_auc(right, wrong):.2f})")
    ax.plot([0, 1], [0, 1], "k:", lw=1, label="chance")
    ax.set_xlabel("false-positive rate (wrong guess called a hit)")
    ax.set_ylabel("true-positive rate (right guess called a hit)")
    ax.set_title("timing attack: ROC")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- exercise checkers ----------------------------------------------------------------------------------
def check_salt_split(salted: int | None, shared_tokens: int | None, public_tokens: int, block_size: int) -> Verdict:
    """Exercise 07.1: which block index takes the salt, and how many public tokens tenants share."""
    hint = ("the salt goes into the first block that extends past the public prefix; only whole public blocks "
            "before it are shared")
    if salted is None or shared_tokens is None:
        return unanswered(hint)
    want = salted_block(public_tokens, block_size)
    return verdict((salted, shared_tokens) == (want, want * block_size),
                   f"block {want} takes the salt; {want * block_size} public tokens are shared", hint)


def check_prefill_tokens(per_tenant_salt: int | None, public_prefix: int | None, n_tenants: int, system_tokens: int,
                         question_tokens: int, block_size: int) -> Verdict:
    """Exercise 07.2: prompt tokens prefilled under per-tenant salts and under the public-prefix policy."""
    hint = "with salts nobody shares; with a public prefix every tenant after the first reuses its whole blocks"
    if per_tenant_salt is None or public_prefix is None:
        return unanswered(hint)
    n = system_tokens + question_tokens
    shared = (system_tokens // block_size) * block_size  # question_tokens >= 1, so the n - 1 cap never bites
    want = (n_tenants * n, n_tenants * n - (n_tenants - 1) * shared)
    return verdict((per_tenant_salt, public_prefix) == want,
                   f"{want[0]} tokens with per-tenant salts, {want[1]} with the public prefix", hint)


def check_auc_fn(fn: Any) -> Verdict:
    """Exercise 07.3: ``fn(positives, negatives)`` must equal ``roc_auc`` (ties count one half)."""
    hint = "AUC = P(positive > negative) + P(tie) / 2 over all positive-negative pairs"
    rng = random.Random(7)
    cases = [([3.0, 4.0], [1.0, 2.0]), ([1.0, 2.0], [3.0, 4.0]), ([1.0, 1.0], [1.0, 1.0]), ([2.0, 1.0, 3.0], [2.0])]
    cases += [([rng.randint(0, 5) for _ in range(9)], [rng.randint(0, 5) for _ in range(7)]) for _ in range(5)]
    for p, n in cases:
        got, failed = call_answer(fn, p, n, hint=hint, name="your function")
        if failed is not None:
            return failed
        value = as_number(got)
        if value is None or abs(value - roc_auc(p, n)) >= 1e-9:
            return verdict(False, hint=f"for positives {p} and negatives {n} you return {got!r}; {hint}")
    return verdict(True, f"equal to roc_auc on {len(cases)} cases, ties included")


# --- takeaways: the article's memory column, checklist (4.4), strategy template (5.4), frameworks (5.3) ---------
def param_count(config: dict) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its ``config.json`` (no weights needed).

    Embedding + per layer (q/k/v/o projections, with q/k/v biases for ``qwen2``, gate/up/down MLP, two
    RMSNorms) + final norm + the LM head (0 extra when ``tie_word_embeddings``).
    """
    h, inter, layers, vocab = (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                               config["vocab_size"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = config.get("attention_bias", config.get("model_type") == "qwen2")
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if bias else 0)
    per_layer = attn + 3 * h * inter + 2 * h
    head = 0 if config.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * per_layer + h + head


def memory_column(config: dict, article_total_gb: float = 14.2, article_saved_gb: float = 0.4,
                  dtype_bytes: int = 2) -> dict:
    """What the article's "GPU memory (GB)" column can and cannot show, in numbers.

    Weights alone (``param_count`` x ``dtype_bytes``) against the article's total; the KV bytes per token of
    the same model, and how many tokens of K/V the article's drop between isolated and shared stands for.
    """
    n = param_count(config)
    heads = config["num_attention_heads"]
    kv_per_token = (2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads)
                    * (config.get("head_dim") or config["hidden_size"] // heads) * dtype_bytes)
    weights = n * dtype_bytes
    return {"parameters": n, "weights GB (1e9 bytes)": weights / 1e9, "weights GiB": weights / 2 ** 30,
            "article total GB": article_total_gb,
            "weights exceed the article's total": weights / 1e9 > article_total_gb and weights / 2 ** 30 > article_total_gb,
            "KV bytes per token": kv_per_token,
            "tokens of K/V in the article's drop": article_saved_gb * 1e9 / kv_per_token}


# The article's 4.4 checklist: (symptom, cause, check, fix), in its words, then where the series measured it.
CHECKLIST = [
    ("outputs differ", "prefix not exactly identical", "compare tokenizer output", "make the prefix token ids identical",
     "02 §6 (tokenization: the same text tokenized in pieces vs whole); 05 §1–4 (group 1, identical prefix: shared vs isolated outputs)",
     "compare token ids, never strings; fix the chat template and add_special_tokens; let the engine hash tokens"),
    ("outputs differ", "position encoding wrong", "print the position range", "fix the start position",
     "03 §2–3 and §5 (shifted prefix, suffix restarting at 0: identical-output fraction and per-layer key error); "
     "07 §5 repeats a small version",
     "reuse K/V only at the positions it was computed at; a paged engine with full-block hashes does this by construction"),
    ("outputs differ", "cache block written", "check writes", "copy-on-write or read-only sharing",
     "04 §6 (copy-on-write on fork); 07 §5 runs the mistake (cow=False) live",
     "share only full, immutable blocks; copy before writing a block whose ref count is above 1"),
    ("memory rises instead of falling", "ref-count leak", "inspect block ref counts", "fix the ref-counting",
     "04 §4 (a leak found with the trace); 07 §4 counts leaked blocks after every stress run",
     "after draining, assert no block has a ref count > 0; watch free blocks, not GPU memory (the pool is pre-allocated)"),
    ("low hit rate", "dynamic content in the prefix", "check how the prefix is built", "move dynamic parts out",
     "04 §3.3 (a timestamp at the start vs the end of the system prompt); 08 (optional: why is my hit rate low)",
     "keep the first tokens static; put time, user id, request id after the shared part"),
    ("low hit rate", "prefix length not aligned", "check the prefix token count", "align to a multiple of the block size",
     "04 §3.1–3.2 (block-size sweep, aligned vs unaligned prefix); 04b (optional: radix tree vs blocks)",
     "at most block_size − 1 tokens of a prefix are lost to the partial block; measure before padding prompts"),
    ("high time to first token", "sharing not in effect", "look at the hit-rate metric", "make sure prefix sharing is on",
     "05 §4–5 and 06 §2.2–3 (cached tokens, hit rate and TTFT with and without a cached prefix)",
     "export cached tokens per request and the hit rate in tokens, with the reason of every miss"),
    ("small throughput gain", "concurrency too low", "—", "raise concurrency",
     "05 §6 (prefix length and request count)",
     "measure the gain at your real prefix length and concurrency; sharing saves prefill, not decode"),
]

# The article's 5.4 strategy template, item by item.
TEMPLATE = [
    ("keep the system prompt fixed: it is the body of the shared prefix",
     "04 §2, 05 §5 (the headline workload: the recorded run or a small live one, printed there), "
     "07 §3 (the operator prompt under three policies)",
     "version the system prompt; changing one token early changes every later block's hash"),
    ("align the prefix length to a multiple of 16 tokens",
     "04 §3.1–3.2 (the loss is under one block per request)",
     "block size is an engine setting (vLLM 16 by default, TensorRT-LLM configurable); align only if the measured loss matters"),
    ("put dynamic content (time, user id) in the suffix",
     "04 §3.3 (timestamp at the start vs the end)",
     "keep per-user data after the shared part; it then also stays out of other tenants' reach (07 §1)"),
    ("multi-turn: share only the system prompt, not the history",
     "04 §3.4 (multi-turn conversations); 07 §4 (identical history turns across tenants stay correct when shared)",
     "sharing a conversation's own history is correct and saves prefill; across tenants, isolate with salts (07 §2)"),
    ("turn on copy-on-write so shared blocks are read-only",
     "04 §6; 07 §5 (the cow=False mistake, live)",
     "paged engines (vLLM, TensorRT-LLM, kvlab) share only full blocks; the risk is in hand-written caches (02 §5)"),
    ("monitor hit rate and GPU memory, with alert thresholds",
     "05, 06 §2.2 (hit rate in tokens); 07 §4 (per-tenant table)",
     "alert on hit rate per tenant and on free blocks; GPU memory is flat under a pre-allocated pool"),
    ("re-check prefix consistency after every model or tokenizer update",
     "02 §6; 06 §1 (one list of token ids fed to every engine)",
     "the engine's block hash includes a model fingerprint in kvlab; in any engine, re-run a token-identity test"),
    ("(not in the article) decide who may share with whom",
     "07 §2–3 (timing attack with and without salts; the cost of isolation)",
     "salt per tenant from a server secret; share only a declared public prefix"),
]

# The article's 5.3 framework table, its claims, and where each claim was checked.
FRAMEWORKS = [
    {"framework": "HF Transformers", "source": "measured in this series (02, 03)",
     "article: prefix sharing / blocks / copy-on-write / positions": "manual / none / implement yourself / handle yourself",
     "what we found": "manual: pass a copy of past_key_values (02 §2–3); generate extends the cache object in place, "
                      "so reusing it unchanged pollutes the next request (02 §5); positions follow the cache length (03)"},
    {"framework": "vLLM", "source": "measured in this series (06)",
     "article: prefix sharing / blocks / copy-on-write / positions": "automatic / 16-token blocks / yes / automatic",
     "what we found": "automatic, hash-chained full blocks (the block size is a setting; 06 runs both sides at 32, "
                      "as vLLM's CPU attention needs a multiple of 32); cached tokens, hit rate and outputs compared "
                      "with kvlab on one list of token ids (06 §2); only full blocks are shared, so a shared block is "
                      "never written (its design doc; 06 does not test writes)"},
    {"framework": "kvlab", "source": "measured in this series (04, 05, 07)",
     "article: prefix sharing / blocks / copy-on-write / positions": "—",
     "what we found": "automatic, hash-chained full blocks, block size a parameter (04 §3.1); copy-on-write on fork "
                      "(04 §6, 07 §5); cached K/V keep their positions (03); per-tenant salts and a public prefix (07)"},
    {"framework": "TensorRT-LLM", "source": "from the project's documentation, not run here",
     "article: prefix sharing / blocks / copy-on-write / positions": "automatic / configurable / yes / automatic",
     "what we found": "KV cache reuse across requests (KvCacheConfig.enable_block_reuse) through a radix search "
                      "structure over blocks; tokens_per_block configurable, a power of two; a partially matched "
                      "block is copied (copy_on_partial_reuse). Docs: nvidia.github.io/TensorRT-LLM, features/kvcache"},
    {"framework": "TGI", "source": "from the project's documentation and source, not run here",
     "article: prefix sharing / blocks / copy-on-write / positions": "automatic / block level / yes / automatic",
     "what we found": "prefix caching in v3 (keeps a conversation's prefix, docs 'TGI v3 overview'); with the "
                      "flashinfer attention backend, which prefix caching requires, the block size is 1 token "
                      "(server/text_generation_server/models/globals.py)"},
]


def takeaways(kind: str, evidence07: dict[str, str] | None = None) -> Any:
    """The article's checklist (``kind="checklist"``), template (``"template"``) or framework table (``"frameworks"``)
    as a DataFrame; ``evidence07`` maps a row's first column to a string computed in notebook 07."""
    import pandas as pd

    ev = evidence07 or {}
    if kind == "checklist":
        rows = [{"symptom": s, "cause (article)": c, "check (article)": k, "fix (article)": f,
                 "measured in this series": m, "measured here (07)": ev.get(c, ""), "in your deployment": d}
                for s, c, k, f, m, d in CHECKLIST]
    elif kind == "template":
        rows = [{"template item (article 5.4)": t, "measured in this series": m, "measured here (07)": ev.get(t, ""),
                 "in your deployment": d} for t, m, d in TEMPLATE]
    elif kind == "frameworks":
        rows = [dict(r) for r in FRAMEWORKS]
    else:
        raise ValueError(f"kind must be 'checklist', 'template' or 'frameworks', got {kind!r}")
    return pd.DataFrame(rows)
