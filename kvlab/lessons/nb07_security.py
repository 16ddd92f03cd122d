"""Notebook 07's workloads, figures, checkers and the build solution; the mechanisms (salt, attack, classifier,
isolation cost, stress runner) are written in the notebook's ``#| export`` cells (``kvlab.built.nb07``).

References: InputSnatch (arXiv 2411.18191); "The Early Bird Catches the Leak" (arXiv 2409.20002);
"I Know What You Asked" (NDSS 2025); Gu et al., ICML 2025; vLLM ``cache_salt`` (CVE-2025-46570).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.cache.hashing import hash_block, prompt_block_hashes
from kvlab.engine import SamplingParams
from kvlab.engine.models import encode
from kvlab.engine.tenants import salted_block
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict


# --- workloads -----------------------------------------------------------------------------------------
def operator_system_prompt(n_lines: int = 12, seed: int = 0) -> str:
    """The operator's system turn (ChatML): filler lines, no secret. Every tenant's prompt starts with it."""
    rng = random.Random(f"kvlab-operator:{seed}")
    return P.chatml("system", "\n".join(rng.choice(P.FILLER_EN + P.FILLER_ZH) for _ in range(n_lines)))


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


# --- figures (pure: data in, matplotlib Figure out) -----------------------------------------------------
def _right_wrong(probes: Sequence[Any], scale: float) -> tuple[list[float], list[float]]:
    return ([scale * p.ttft for p in probes if p.is_secret], [scale * p.ttft for p in probes if not p.is_secret])


def fig_ttft_histogram(probes_by_policy: dict[str, Sequence[Any]], bins: int = 20) -> Any:
    """One panel per policy: TTFT histograms (ms) of right guesses (hits if shared) and wrong guesses."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(probes_by_policy), figsize=(4.2 * len(probes_by_policy), 3.2), squeeze=False)
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


def fig_roc(probes_by_policy: dict[str, Sequence[Any]]) -> Any:
    """ROC curves of the "faster means hit" classifier (notebook 07's ``roc_curve``), one line per policy."""
    import matplotlib.pyplot as plt

    from kvlab.built.nb07 import roc_auc, roc_curve

    fig, ax = plt.subplots(figsize=(4.2, 4))
    for policy, probes in probes_by_policy.items():
        right, wrong = _right_wrong(probes, -1.0)
        ax.plot(*roc_curve(right, wrong), label=f"{policy} (AUC {roc_auc(right, wrong):.2f})")
    ax.plot([0, 1], [0, 1], "k:", lw=1, label="chance")
    ax.set(xlabel="false-positive rate (wrong guess called a hit)", ylabel="true-positive rate (right guess called a hit)",
           title="timing attack: ROC")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- build exercise 07.B: the salted chain --------------------------------------------------------------
def reference_salted_hashes(token_ids: Sequence[int], block_size: int, salt: str, salt_block: int = 0) -> list[bytes]:
    """kvlab's chain with the exercise's arguments: ``kvlab.cache.hashing.prompt_block_hashes``."""
    return prompt_block_hashes(token_ids, block_size, cache_salt=salt, salt_block=salt_block)


def build_07_salted_hashes(token_ids: Sequence[int], block_size: int, salt: str, salt_block: int = 0) -> list[bytes]:
    """07.B worked solution: notebook 04's chain, with ``("salt", salt)`` hashed into block ``salt_block`` only."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = (("salt", salt),) if i == salt_block else ()
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


def check_salted_hashes(fn: Any) -> Verdict:
    """Build exercise 07.B: ``fn(token_ids, block_size, salt, salt_block)`` equals kvlab's salted chain. Never raises."""
    hint = ("notebook 04's chain: hash_block(parent, the block's tokens, keys) per full block, parent None for block 0; "
            "keys = (('salt', salt),) in block salt_block only, () in the others")
    rng = random.Random(7)
    for bs, n, k in ((4, 13, 0), (16, 70, 0), (16, 70, 2), (4, 16, 3), (2, 1, 0)):
        tokens = [rng.randrange(1000) for _ in range(n)]
        want = reference_salted_hashes(tokens, bs, "salt-a", k)
        got, failed = call_answer(fn, tokens, bs, "salt-a", k, hint=hint, name="my_salted_hashes")
        if failed is not None:
            return failed
        got = list(got) if isinstance(got, list | tuple) else got
        where = f"{n} tokens in blocks of {bs}, salt in block {k}"
        if not isinstance(got, list) or len(got) != len(want):
            return verdict(False, hint=f"{where}: expected {len(want)} hashes (one per full block), got "
                                       f"{len(got) if isinstance(got, list) else type(got).__name__}")
        bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if bad is not None:
            return verdict(False, hint=f"{where}: block {bad}'s hash differs from kvlab's; {hint}")
    return verdict(True, "the same chain as kvlab's prompt_block_hashes, the salt in block 0 or further on")


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
    """Exercise 07.3: ``fn(positives, negatives)`` must equal notebook 07's ``roc_auc`` (ties count one half)."""
    from kvlab.built.nb07 import roc_auc

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
