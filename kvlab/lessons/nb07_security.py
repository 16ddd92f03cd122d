"""Notebook 07's experiment runners (the attack, the cost of isolation, the stress test, the closing
decision table), figures and checkers. The mechanisms (the tenant's salt, the salted chain, the
timing probe, the ROC AUC) are written in the notebook's ``#| export`` cells (``kvlab.built.nb07``).
References: InputSnatch (arXiv 2411.18191); "The Early Bird Catches the Leak" (arXiv 2409.20002); Gu
et al., ICML 2025; vLLM ``cache_salt`` (CVE-2025-46570)."""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from kvlab.audit.procedure import ks_test
from kvlab.built.nb07 import roc_auc, timing_probe
from kvlab.cache import BlockManager, cdiv
from kvlab.cache.block_pool import InvariantError
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import encode
from kvlab.engine.reference import hf_generate
from kvlab.engine.tenants import POLICIES, SharedTenantsWarning, salted_block
from kvlab.lessons import nb03_position as X
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Evidence, Verdict, as_number, call_answer, unanswered, verdict


def quietly(fn, *args, **kwargs):
    """Call ``fn`` without the engine's SharedTenantsWarning: the notebook runs "shared" on purpose
    and says why."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedTenantsWarning)
        return fn(*args, **kwargs)


# --- section 2: the attack ------------------------------------------------------------------------
def operator_system_prompt(n_lines: int = 12, seed: int = 0) -> str:
    """The operator's system turn (ChatML): filler lines, no secret. Every tenant's prompt starts
    with it."""
    rng = random.Random(f"kvlab-operator:{seed}")
    return P.chatml("system",
                    "\n".join(rng.choice(P.FILLER_EN + P.FILLER_ZH) for _ in range(n_lines)))


def victim_message(secret: str, n_document_lines: int = 8) -> str:
    """The victim's user turn and the assistant header: the secret first, then a document the
    attacker knows."""
    doc = "\n".join(P.FILLER_EN[i % len(P.FILLER_EN)] for i in range(n_document_lines))
    return (P.chatml("user", f'My passphrase is "{secret}". Keep it safe.\n{doc}')
            + f"{P.IM_START}assistant\n")


def random_secret(rng: random.Random) -> str:
    """A 6-character passphrase from A-Z2-9 (every candidate the attacker tries has this form)."""
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


def run_attack(engine: Engine, tokenizer: Any, n_trials: int, n_wrong: int, system_text: str,
               n_document_lines: int = 8, seed: int = 0) -> list[Probe]:
    """Per trial the victim sends a fresh secret; the attacker probes it and ``n_wrong`` wrong
    guesses (each once: a repeat would hit the attacker's own probe), shuffled. "public-prefix"
    registers the operator prompt as public."""
    rng = random.Random(seed)
    if engine.isolation == "public-prefix":
        engine.add_public_prefix(system_text)
    system_ids = encode(tokenizer, system_text)

    def prompt(secret):
        return system_ids + encode(tokenizer, victim_message(secret, n_document_lines))

    quietly(timing_probe, engine, prompt(random_secret(rng)), "attacker")  # warm-up, not recorded
    probes = []
    for trial in range(n_trials):
        secret = random_secret(rng)
        quietly(engine.generate, [prompt(secret)], SamplingParams(max_tokens=1), tenants=["victim"])
        candidates = ([secret]
                      + [c for c in (random_secret(rng) for _ in range(n_wrong)) if c != secret])
        rng.shuffle(candidates)
        for cand in candidates:
            ids = prompt(cand)
            ttft, cached = quietly(timing_probe, engine, ids, "attacker")
            probes.append(Probe(trial, cand, cand == secret, ttft, cached, len(ids)))
    return probes


def attack_table(probes_by_policy: dict[str, Sequence[Probe]], alpha: float = 0.01) -> Any:
    """Per policy, the classifier "faster means the secret was cached" (score = -TTFT): ROC AUC, KS
    test, medians."""
    import pandas as pd

    rows = []
    for policy, probes in probes_by_policy.items():
        right, wrong = _right_wrong(probes, 1.0)
        d, pvalue = ks_test(right, wrong)
        rows.append({"policy": policy, "probes": len(probes), "right guesses": len(right),
                     "median TTFT right (ms)": 1e3 * median(right),
                     "median TTFT wrong (ms)": 1e3 * median(wrong),
                     "cached tokens right": median(p.cached_tokens for p in probes if p.is_secret),
                     "cached tokens wrong": median(p.cached_tokens for p in probes
                                                   if not p.is_secret),
                     "ROC AUC": roc_auc([-t for t in right], [-t for t in wrong]), "KS D": d,
                     "KS p-value": pvalue,
                     f"sharing detected (p < {alpha})": pvalue < alpha})
    return pd.DataFrame(rows).set_index("policy")


def attack_verdicts(attack: Any, alpha: float = 0.01) -> list[str]:
    """One line per policy, read from ``attack_table``: what the cached tokens say, and what the
    timing shows."""
    lines = []
    for policy, r in attack.iterrows():
        says = ("the timing separates right from wrong guesses: the secret leaks one guess at a "
                "time" if r[f"sharing detected (p < {alpha})"] else
                f"no sharing detected at p < {alpha}; "
                + ("right guesses had more cached tokens, these few probes did not show it"
                   if r["cached tokens right"] > r["cached tokens wrong"] else
                   "right and wrong guesses had the same cached tokens, so the AUC's distance "
                   "from 0.5 is timing noise"))
        lines.append(f"{policy:>14}: cached tokens {r['cached tokens right']:.0f} (right) vs "
                     f"{r['cached tokens wrong']:.0f} (wrong); median TTFT "
                     f"{r['median TTFT right (ms)']:.1f} vs {r['median TTFT wrong (ms)']:.1f} ms; "
                     f"AUC {r['ROC AUC']:.2f}, KS p = {r['KS p-value']:.2g} → {says}")
    return lines


def histogram_explorer(probes_by_policy: dict[str, Sequence[Probe]]) -> None:
    """Every policy's TTFT histograms drawn once (static, headless), then a policy dropdown and a
    bins slider."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    fig_ttft_histogram(probes_by_policy)
    plt.show()
    policy = widgets.Dropdown(options=list(probes_by_policy), description="policy")
    bins = widgets.IntSlider(value=20, min=5, max=60, description="bins", continuous_update=False)
    out = widgets.Output()

    def redraw(_change):
        with out:
            out.clear_output(wait=True)
            fig_ttft_histogram({policy.value: probes_by_policy[policy.value]}, bins=bins.value)
            plt.show()

    policy.observe(redraw, "value")
    bins.observe(redraw, "value")
    display(widgets.HBox([policy, bins]), out)


# --- section 3: the cost of isolation -------------------------------------------------------------
def isolation_cost(model: Any, tokenizer: Any, n_tenants: int, system_text: str,
                   per_tenant: int = 1,
                   policies: Sequence[str] = POLICIES, block_size: int = 16, seed: int = 0) -> Any:
    """Per policy: prefill tokens computed, hits, peak KV blocks, outputs equal to the first
    policy's. Every tenant sends ``per_tenant`` requests (the public operator prompt + its own
    question) at once, on a pool that never evicts."""
    import pandas as pd

    rng = random.Random(seed)
    system_ids = encode(tokenizer, system_text)
    prompts, tenants = [], []
    for t in range(n_tenants):
        for j in range(per_tenant):
            user = P.chatml("user",
                            f"Request {j} of tenant {t}. {rng.choice(P.ASK_EN + P.CHAT_EN)}")
            prompts.append(system_ids + encode(tokenizer, user + f"{P.IM_START}assistant\n"))
            tenants.append(f"tenant-{t}")
    rows, outputs = [], {}
    for policy in policies:
        engine = Engine(model, tokenizer,
                        num_blocks=sum(cdiv(len(p) + 2, block_size) for p in prompts) + 8,
                        block_size=block_size, isolation=policy, max_num_seqs=len(prompts),
                        max_num_batched_tokens=sum(map(len, prompts)))
        engine.add_public_prefix(system_ids)
        outs = quietly(engine.generate, prompts, SamplingParams(max_tokens=2), tenants=tenants)
        st, outputs[policy] = engine.stats(), [o.output_ids for o in outs]
        rows.append({"policy": policy, "requests": len(prompts),
                     "prompt tokens": sum(map(len, prompts)),
                     "prefill tokens computed": sum(len(o.prompt_ids) - o.num_cached_tokens
                                                    for o in outs),
                     "hit tokens": st["hit_tokens"], "public hits (blocks)": st["public_hits"],
                     "cross-tenant hits (blocks)": st["cross_tenant_hits"],
                     "peak KV blocks": st["peak_kv_bytes"] // engine.store.bytes_per_block})
    first = outputs[policies[0]]
    return pd.DataFrame([r | {"outputs equal": outputs[r["policy"]] == first}
                         for r in rows]).set_index("policy")


def cost_verdict(cost: Any, block_size: int) -> str:
    """How much of sharing's prefill saving the public-prefix policy recovers, read from
    ``isolation_cost``."""
    pf = cost["prefill tokens computed"]
    saving = pf["tenant"] - pf["shared"]
    recovered = (pf["tenant"] - pf["public-prefix"]) / saving if saving else float("nan")
    rest = pf["public-prefix"] - pf["shared"]
    return (f"prefill tokens: per-tenant salt {pf['tenant']}, public-prefix {pf['public-prefix']}, "
            f"shared {pf['shared']}: the public-prefix policy recovers {recovered:.0%} of the "
            f"saving sharing everything gives; the rest, {rest} tokens, lies past the public "
            f"prefix's last whole block of {block_size} (salted there) → "
            + ("outputs equal under every policy" if cost["outputs equal"].all()
               else "the OUTPUTS differ: investigate"))


# --- section 4: the concurrency stress test -------------------------------------------------------
@dataclass(slots=True)
class StressRequest:
    """One request of the stress workload: its prompt, tenant, sampling and the step it arrives
    at."""

    prompt_ids: list[int]
    tenant: str
    sampling: SamplingParams
    arrival_step: int


def stress_workload(tokenizer: Any, n_requests: int, n_tenants: int = 6, n_systems: int = 3,
                    seed: int = 0,
                    max_tokens: tuple[int, int] = (1, 16), sampled_fraction: float = 0.2,
                    arrivals_per_step: float = 3.0) -> tuple[list[StressRequest], list[list[int]]]:
    """Mixed tenants, overlapping prefixes (public system prompts, history turns every tenant uses,
    private turns), random lengths, arrivals over time, greedy and seeded sampling. Returns
    (requests, public prefixes)."""
    rng = random.Random(f"kvlab-stress:{seed}")
    systems = [P.make_example(seed * 100 + i, "heldout", n_filler=rng.randint(1, 14)).prefix_text
               for i in range(n_systems)]
    common = [P.chatml("user", rng.choice(P.CHAT_EN + P.CHAT_ZH))
              + P.chatml("assistant", rng.choice(P.ACK_EN))
              for _ in range(3)]
    private = {f"tenant-{t}": [P.chatml("user", rng.choice(P.UPDATE_EN + P.UPDATE_ZH).format(
                                   p=P.random_passphrase(rng, "heldout")))
                               + P.chatml("assistant", rng.choice(P.ACK_EN + P.ACK_ZH))
                               for _ in range(2)]
               for t in range(n_tenants)}
    weights = [1 / (t + 1) for t in range(n_tenants)]  # a few heavy tenants, a long tail
    requests, step = [], 0.0
    for _ in range(n_requests):
        tenant = f"tenant-{rng.choices(range(n_tenants), weights)[0]}"
        text = rng.choice(systems)
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            text += rng.choice(common + private[tenant])
        doc = "\n".join(rng.choice(P.FILLER_EN + P.FILLER_ZH)
                        for _ in range(rng.choice((0, 0, 1, 3, 6))))
        question = rng.choice(P.ASK_EN + P.ASK_ZH + P.CHAT_EN)
        text += (P.chatml("user", f"{doc}\n{question}" if doc else question)
                 + f"{P.IM_START}assistant\n")
        n_new = rng.randint(*max_tokens)
        if rng.random() < sampled_fraction:
            sp = SamplingParams(max_tokens=n_new, temperature=0.9, top_p=0.95, top_k=40,
                                seed=rng.randrange(2 ** 31))
        else:
            sp = SamplingParams(max_tokens=n_new)
        step += rng.expovariate(arrivals_per_step)
        requests.append(StressRequest(encode(tokenizer, text), tenant, sp, int(step)))
    return requests, [encode(tokenizer, s) for s in systems]


def isolated_outputs(model: Any, tokenizer: Any,
                     requests: Sequence[StressRequest]) -> list[list[int]]:
    """Each request generated alone by transformers' ``model.generate`` (``hf_generate``): the
    reference. Requests with the same prompt and sampling share one run of the longest
    ``max_tokens`` (a shorter one is its prefix)."""
    def key(r):
        sp = r.sampling
        return (tuple(r.prompt_ids), sp.temperature, sp.top_p, sp.top_k,
                None if sp.greedy else sp.seed)

    longest: dict = {}
    for r in requests:
        longest[key(r)] = max(longest.get(key(r), 0), r.sampling.max_tokens)
    ref = {}
    for (ids, temperature, top_p, top_k, seed), n in longest.items():
        sp = ({} if temperature == 0
              else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=seed))
        ref[(ids, temperature, top_p, top_k, seed)] = hf_generate(model, tokenizer, list(ids),
                                                                  max_new_tokens=n, **sp)
    return [ref[key(r)][: r.sampling.max_tokens] for r in requests]


@dataclass
class StressReport:
    """What the stress run found; ``line()`` is the one-line verdict scripts/stress.py prints
    last."""

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
    mismatched: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """0 mismatches, 0 leaked blocks, 0 cross-tenant hits (unless nothing is salted)."""
        return (self.mismatches == 0 and self.leaked_blocks == 0
                and (self.cross_tenant_hits == 0 or self.policy == "shared"))

    def line(self) -> str:
        return (f"requests={self.requests} mismatches={self.mismatches} "
                f"cross_tenant_hits={self.cross_tenant_hits} leaked_blocks={self.leaked_blocks}")


def stress_test(model: Any, tokenizer: Any, workload: tuple, reference: Sequence[list[int]],
                policy: str = "public-prefix",
                seed: int = 0, num_blocks: int = 48, block_size: int = 16, max_num_seqs: int = 24,
                check_every: int = 16) -> StressReport:
    """``workload`` through one engine under ``policy`` (arrivals by step, invariants checked),
    against ``reference``."""
    requests, publics = workload
    engine = Engine(model, tokenizer, num_blocks=num_blocks, block_size=block_size,
                    isolation=policy,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, seed=seed)
    for ids in publics:
        engine.add_public_prefix(ids)
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
    outs, step, k, t0 = {}, 0, 0, time.perf_counter()
    while k < len(pending) or engine.has_unfinished():
        while k < len(pending) and requests[pending[k]].arrival_step <= step:
            r = requests[pending[k]]
            quietly(engine.add_request, r.prompt_ids, r.sampling, request_id=pending[k],
                    tenant=r.tenant)
            k += 1
        if engine.has_unfinished():
            outs.update((out.request_id, out) for out in engine.step())
        step += 1
        if step % check_every == 0:
            engine.check_invariants()
    engine.check_invariants()
    seconds = time.perf_counter() - t0
    mismatched = [i for i in range(len(requests))
                  if i not in outs or outs[i].finish_reason == "error"
                  or outs[i].output_ids != reference[i]]
    st, bm = engine.stats(), engine.block_manager
    # after the drain: none may be held
    leaked = sum(b.ref_count > 0 for b in bm.pool.blocks) + len(bm.seqs)
    return StressReport(len(requests), len(mismatched), st["cross_tenant_hits"], leaked,
                        st["public_hits"],
                        st["evictions"], st["num_preemptions"], st["hit_rate"], policy, seconds,
                        num_blocks, mismatched)


def stress_verdict(reports: dict[str, StressReport]) -> str:
    """One line over every policy's report: did every output equal the request generated alone?"""
    n, total, sh = (next(iter(reports.values())).requests,
                    sum(r.mismatches for r in reports.values()), reports["shared"])
    pressure = (sum(r.evictions for r in reports.values()),
                sum(r.preemptions for r in reports.values()))
    return (f"{n} requests under {len(reports)} policies ({pressure[0]} evictions, {pressure[1]} "
            "preemptions in all): "
            + ("every output equals the request generated alone, including 'shared', where "
               f"{sh.cross_tenant_hits} block hits crossed tenants" if total == 0
               else f"{total} outputs differ from the request generated alone: investigate"))


# --- section 5: the closing decision table --------------------------------------------------------
def write_shared_block(cow: bool) -> dict[str, bool]:
    """Fork a sequence and let both continue differently: does the parent read its own tokens, do
    the invariants hold?"""
    m = BlockManager(8, 4, cow=cow)
    m.allocate("parent", [1, 2, 3, 4, 5, 6])
    m.fork("parent", "child")
    m.append("parent", 7)
    m.append("child", 8)
    try:
        m.check_invariants()
        ok = True
    except InvariantError:
        ok = False
    return {"copy-on-write": cow,
            "parent reads its own tokens": m.read_tokens("parent") == m.seqs["parent"].token_ids,
            "invariants hold": ok}


def closing_evidence(table: Any, errors: Any, shift: int, attack: Any, cost: Any,
                     reports: dict[str, StressReport],
                     cow: Any) -> dict[str, Evidence]:
    """Each row of the article's decision table: a verdict from the numbers 03 and 07 measured, and
    where."""
    ident, n = table["identical"], int(table["prompts"].min())

    def k_of(case):
        return f"{round(ident[case] * n)}/{n}"

    rr_k = errors[(errors["tensor"] == "K") & (errors["treatment"] == X.REROTATED)].set_index(
        "layer")["relative error"]
    sh, tn, pp = reports["shared"], reports["tenant"], reports["public-prefix"]
    a, pf = attack["ROC AUC"], cost["prefill tokens computed"]
    cow_ok, bug = (cow.set_index("copy-on-write").loc[True],
                   cow.set_index("copy-on-write").loc[False])
    distances = ident[X.ALL_SHIFTED] - ident[X.SHIFTED] >= 2 / n
    held = ident[X.REROTATED] == 1
    return {
        "identical-prefix": Evidence("confirmed" if sh.mismatches == 0 else "contradicted",
                                     f"{sh.requests} concurrent requests sharing every identical "
                                     f"block (hit rate {sh.hit_rate:.0%}): {sh.mismatches} differ "
                                     "from the request run alone", "07 §4"),
        "same-start": Evidence("refined" if distances else "confirmed",
                               f"prefix at +{shift}, suffix at len(prefix): {k_of(X.SHIFTED)} "
                               f"answers identical; everything at +{shift}: {k_of(X.ALL_SHIFTED)}"
                               + (" → equal distances, not equal starts" if distances else ""),
                               "03 §2 = 07 §5"),
        "no-writes-to-shared": Evidence("confirmed" if cow_ok["parent reads its own tokens"]
                                        else "contradicted",
                                        "with copy-on-write a forked parent reads its own tokens: "
                                        f"{bool(cow_ok['parent reads its own tokens'])}", "07 §5"),
        "positions-agree": Evidence("confirmed" if ident[X.RESTART] < 1 else "refined",
                                    f"suffix restarting at 0: {k_of(X.RESTART)} answers identical, "
                                    "first-token logits off by up to "
                                    f"{table.loc[X.RESTART, 'max |Δ logit|, first token']:.1f}",
                                    "03 §2 = 07 §5"),
        "independent-context": Evidence("confirmed" if sh.mismatches + tn.mismatches
                                        + pp.mismatches == 0 else "contradicted",
                                        "tenants with different histories after shared system "
                                        f"prompts, {sh.requests} requests: "
                                        f"{pp.mismatches + tn.mismatches + sh.mismatches} outputs "
                                        "differ under the three policies", "07 §4"),
        "shared-may-be-written": Evidence("refined" if not bug["parent reads its own tokens"]
                                          else "contradicted",
                                          "written in place (cow=False): parent reads its own "
                                          f"tokens {bool(bug['parent reads its own tokens'])}, "
                                          f"invariants hold {bool(bug['invariants hold'])}; with "
                                          "copy-on-write such blocks stay shareable",
                                          "07 §5"),
        "overlap-different-start": Evidence("refined" if held else "confirmed",
                                            f"A's segment as is: {k_of(X.AS_IS)} identical, "
                                            f"re-rotated: {k_of(X.REROTATED)}; re-rotated keys "
                                            f"exact at layer 0 ({rr_k[0]:.0e}), not deeper (up to "
                                            f"{rr_k.drop(index=0).max():.2f})"
                                            + (": the answers held, the K/V did not" if held
                                               else ""), "03 §3 = 07 §5"),
        "full-isolation": Evidence("refined" if pf["public-prefix"] < pf["tenant"] else "confirmed",
                                   f"timing attack AUC {a['shared']:.2f} shared → "
                                   f"{a['tenant']:.2f} per-tenant salt, {a['public-prefix']:.2f} "
                                   f"public-prefix; prefill tokens {pf['tenant']} salted vs "
                                   f"{pf['public-prefix']} sharing a declared public prefix",
                                   "07 §2–3"),
    }


# --- figures (pure: data in, matplotlib Figure out) -----------------------------------------------
def _right_wrong(probes: Sequence[Any], scale: float) -> tuple[list[float], list[float]]:
    return ([scale * p.ttft for p in probes if p.is_secret],
            [scale * p.ttft for p in probes if not p.is_secret])


def fig_ttft_histogram(probes_by_policy: dict[str, Sequence[Any]], bins: int = 20) -> Any:
    """One panel per policy: TTFT histograms (ms) of right guesses (hits if shared) and wrong
    guesses."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(probes_by_policy), figsize=(4.2 * len(probes_by_policy), 3.2),
                             squeeze=False)
    for ax, (policy, probes) in zip(axes[0], probes_by_policy.items()):
        right, wrong = _right_wrong(probes, 1e3)
        lo, hi = min(right + wrong), max(right + wrong)
        edges = [lo + (hi - lo) * i / bins for i in range(bins + 1)] if hi > lo else bins
        ax.hist(wrong, bins=edges, alpha=0.6, label=f"wrong guess (n={len(wrong)})", density=True)
        ax.hist(right, bins=edges, alpha=0.6, label=f"right guess (n={len(right)})", density=True)
        ax.set(title=f"policy: {policy}", xlabel="TTFT (ms)", ylabel="density")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- exercise checkers ----------------------------------------------------------------------------
def check_salt_split(salted: int | None, shared_tokens: int | None, public_tokens: int,
                     block_size: int) -> Verdict:
    """Exercise 07.1: which block index takes the salt, and how many public tokens tenants share."""
    hint = ("the salt goes into the first block that extends past the public prefix; only whole "
            "public blocks before it are shared")
    if salted is None or shared_tokens is None:
        return unanswered(hint)
    want = salted_block(public_tokens, block_size)
    return verdict((salted, shared_tokens) == (want, want * block_size),
                   f"block {want} takes the salt; {want * block_size} public tokens are shared",
                   hint)


def check_prefill_tokens(per_tenant_salt: int | None, public_prefix: int | None, n_tenants: int,
                         system_tokens: int,
                         question_tokens: int, block_size: int) -> Verdict:
    """Exercise 07.2: prompt tokens prefilled under per-tenant salts and under the public-prefix
    policy."""
    hint = ("with salts nobody shares; with a public prefix every tenant after the first reuses "
            "its whole blocks")
    if per_tenant_salt is None or public_prefix is None:
        return unanswered(hint)
    n = system_tokens + question_tokens
    # question_tokens >= 1, so the n - 1 cap never bites
    shared = (system_tokens // block_size) * block_size
    want = (n_tenants * n, n_tenants * n - (n_tenants - 1) * shared)
    return verdict((per_tenant_salt, public_prefix) == want,
                   f"{want[0]} tokens with per-tenant salts, {want[1]} with the public prefix",
                   hint)


def check_auc_fn(fn: Any) -> Verdict:
    """Exercise 07.3: ``fn(positives, negatives)`` must equal notebook 07's ``roc_auc`` (ties count
    one half)."""
    hint = "AUC = P(positive > negative) + P(tie) / 2 over all positive-negative pairs"
    rng = random.Random(7)
    cases = [([3.0, 4.0], [1.0, 2.0]), ([1.0, 2.0], [3.0, 4.0]), ([1.0, 1.0], [1.0, 1.0]),
             ([2.0, 1.0, 3.0], [2.0])]
    cases += [([rng.randint(0, 5) for _ in range(9)], [rng.randint(0, 5) for _ in range(7)])
              for _ in range(5)]
    for p, n in cases:
        got, failed = call_answer(fn, p, n, hint=hint, name="your function")
        if failed is not None:
            return failed
        value = as_number(got)
        if value is None or abs(value - roc_auc(p, n)) >= 1e-9:
            return verdict(False,
                           hint=f"for positives {p} and negatives {n} you return {got!r}; {hint}")
    return verdict(True, f"equal to roc_auc on {len(cases)} cases, ties included")
