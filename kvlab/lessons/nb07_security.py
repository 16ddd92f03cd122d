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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import encode
from kvlab.engine.reference import hf_generate
from kvlab.engine.tenants import POLICIES, salted_block
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict

__all__ = [
    "StressReport", "StressRequest", "attack_summary", "check_auc_fn", "check_prefill_tokens", "check_salt_split",
    "fig_roc", "fig_ttft_histogram", "isolation_cost", "ks_test", "roc_auc", "roc_curve", "run_attack", "run_stress",
    "stress_test", "stress_workload", "timing_probe",
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


def ks_test(sample_a: Sequence[float], sample_b: Sequence[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov test (two-sided): (statistic D, p-value), as in Gu et al."""
    from scipy.stats import ks_2samp

    res = ks_2samp(list(sample_a), list(sample_b), alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


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


def timing_probe(engine: Engine, prompt_ids: Sequence[int], tenant: str | None) -> tuple[float, int]:
    """Send one prompt alone as ``tenant`` and return (TTFT in seconds, prompt tokens served by the cache)."""
    out = engine.generate([list(prompt_ids)], SamplingParams(max_tokens=1), tenants=[tenant])[0]
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
                   policies: Sequence[str] = POLICIES, block_size: int = 16, seed: int = 0) -> list[dict]:
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
    need = sum(-(-(len(p) + 2) // block_size) for p in prompts) + 8
    rows = []
    for policy in policies:
        engine = Engine(model, tokenizer, num_blocks=need, block_size=block_size, isolation=policy,
                        max_num_seqs=len(prompts), max_num_batched_tokens=max(sum(map(len, prompts)), len(prompts)))
        engine.add_public_prefix(system_ids)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=2), tenants=tenants)
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
                num_blocks: int = 48, block_size: int = 16, max_num_seqs: int = 24,
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
                        bm.metrics.tenant_table())


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
