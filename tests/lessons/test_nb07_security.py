"""Notebook 07 (its exported cells, ``kvlab.built.nb07``, and its lesson module ``S``) on the
engine: the isolation cost, the timing probe (by the cached-token counts that cause the timing), its
statistics, and a fast concurrency stress test (hundreds of requests, outputs equal to HF generate
alone).

Nothing here asserts on a timing: the probe's TTFTs are noisy by nature, so the tests check the
cached-token counts that cause them, and the statistics on synthetic samples.
"""

import random

import pytest

from kvlab.built import nb07 as N
from kvlab.engine import Engine, SamplingParams
from kvlab.lessons import nb07_security as S

BS = 16


def test_isolation_cost_matches_the_formula(lm):
    model, tok = lm
    cost = S.isolation_cost(model, tok, 4, S.operator_system_prompt(), per_tenant=1, block_size=BS)
    rows = {p: r for p, r in cost.iterrows()}
    assert cost["outputs equal"].all()
    n, computed = (
        rows["tenant"]["prompt tokens"],
        {p: r["prefill tokens computed"] for p, r in rows.items()},
    )
    assert computed["tenant"] == n and rows["tenant"]["hit tokens"] == 0
    assert computed["shared"] <= computed["public-prefix"] < computed["tenant"]
    system_tokens = len(tok(S.operator_system_prompt(), add_special_tokens=False)["input_ids"])
    assert computed["public-prefix"] == n - 3 * (system_tokens // BS) * BS
    assert rows["public-prefix"]["peak KV blocks"] < rows["tenant"]["peak KV blocks"]
    assert (
        rows["public-prefix"]["cross-tenant hits (blocks)"]
        == 0
        < rows["shared"]["cross-tenant hits (blocks)"]
    )


# --- the probe: hits are what the timing would show -----------------------------------------------
@pytest.mark.parametrize("policy", ["shared", "tenant", "public-prefix"])
def test_the_probe_hits_only_without_isolation(lm, policy):
    model, tok = lm
    engine = Engine(model, tok, num_blocks=256, block_size=BS, isolation=policy, debug=True)
    probes = S.run_attack(engine, tok, 2, 2, S.operator_system_prompt(seed=1), seed=1)
    right = {p.cached_tokens for p in probes if p.is_secret}
    wrong = {p.cached_tokens for p in probes if not p.is_secret}
    if policy == "shared":
        assert min(right) > max(wrong)  # the right guess is served from the victim's blocks
        assert engine.stats()["cross_tenant_hits"] > 0
    else:
        assert right == wrong  # both only hit the attacker's own (or the public) blocks
        assert engine.stats()["cross_tenant_hits"] == 0
    assert (engine.stats()["public_hits"] > 0) == (policy == "public-prefix")


# --- statistics -----------------------------------------------------------------------------------
def test_roc_auc_is_the_mann_whitney_statistic():
    from scipy.stats import mannwhitneyu

    rng = random.Random(0)
    for _ in range(20):
        pos = [rng.randint(0, 9) for _ in range(rng.randint(1, 15))]
        neg = [rng.randint(0, 9) for _ in range(rng.randint(1, 15))]
        u = mannwhitneyu(pos, neg, alternative="two-sided").statistic
        assert N.roc_auc(pos, neg) == pytest.approx(u / (len(pos) * len(neg)))
    assert (
        N.roc_auc([3, 4], [1, 2]) == 1.0
        and N.roc_auc([1, 2], [3, 4]) == 0.0
        and N.roc_auc([1], [1]) == 0.5
    )
    with pytest.raises(ValueError):
        N.roc_auc([], [1.0])


def test_ks_detects_a_shift_and_not_noise():
    rng = random.Random(1)
    miss = [rng.gauss(100, 5) for _ in range(200)]
    hit = [rng.gauss(80, 5) for _ in range(200)]
    same = [rng.gauss(100, 5) for _ in range(200)]
    d, p = S.ks_test(hit, miss)
    assert d > 0.8 and p < 1e-8 and N.roc_auc([-x for x in hit], [-x for x in miss]) > 0.95
    d, p = S.ks_test(same, miss)  # the case that must fail to detect anything
    assert p > 0.01 and abs(N.roc_auc(same, miss) - 0.5) < 0.1


def test_the_lesson_uses_the_audits_ks_test_with_the_same_numbers():
    """One KS test: notebook 07's is ``kvlab.audit``'s, and it gives exactly scipy's two-sided
    ``ks_2samp`` (what the lesson's own wrapper returned) on samples small enough for the exact
    p-value and large ones with ties."""
    from scipy.stats import ks_2samp

    from kvlab.audit.procedure import ks_test

    assert S.ks_test is ks_test
    rng = random.Random(7)
    for n, m, ties in ((3, 4, False), (20, 25, False), (200, 150, True), (600, 700, False)):
        a = [round(rng.gauss(100, 5)) if ties else rng.gauss(100, 5) for _ in range(n)]
        b = [round(rng.gauss(98, 5)) if ties else rng.gauss(98, 5) for _ in range(m)]
        res = ks_2samp(a, b, alternative="two-sided")
        assert S.ks_test(a, b) == (float(res.statistic), float(res.pvalue))
    with pytest.raises(ValueError):
        S.ks_test([], [1.0])


def test_exercise_checkers_accept_right_and_reject_wrong():
    assert S.check_salt_split(2, 32, public_tokens=40, block_size=16)
    assert not S.check_salt_split(3, 40, public_tokens=40, block_size=16)
    assert S.check_prefill_tokens(8 * 130, 8 * 130 - 7 * 112, 8, 120, 10, 16)
    assert not S.check_prefill_tokens(8 * 130, 130, 8, 120, 10, 16)

    def naive(pos, neg):
        return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))

    def no_ties(pos, neg):  # the classic slip: ties counted as losses
        return sum(p > n for p in pos for n in neg) / (len(pos) * len(neg))

    assert (
        S.check_auc_fn(naive)
        and not S.check_auc_fn(no_ties)
        and not S.check_auc_fn(lambda p, n: 1 / 0)
    )


# --- the concurrency stress test ------------------------------------------------------------------
@pytest.fixture(scope="module")
def stress_load(lm):
    model, tok = lm
    workload = S.stress_workload(tok, 300, seed=3)
    return workload, S.isolated_outputs(model, tok, workload[0])


@pytest.mark.parametrize("policy", ["public-prefix", "tenant", "shared"])
def test_stress_outputs_equal_isolated(lm, stress_load, policy):
    model, tok = lm
    workload, reference = stress_load
    rep = S.stress_test(model, tok, workload, reference, policy=policy, seed=3)
    assert rep.mismatches == 0, f"requests {rep.mismatched[:5]} differ from HF generate alone"
    assert rep.leaked_blocks == 0 and rep.evictions > 0 and rep.preemptions > 0
    # shared: tenants hit each other's blocks
    assert (rep.cross_tenant_hits == 0) == (policy != "shared")
    assert (rep.public_hits > 0) == (policy == "public-prefix")
    assert rep.ok and rep.line() == (
        f"requests=300 mismatches=0 cross_tenant_hits={rep.cross_tenant_hits} leaked_blocks=0"
    )


def _table_rows(markdown: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with ``header`` (cells split on unescaped
    pipes)."""
    import re

    lines = markdown.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {header}"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]])
    return rows


def test_takeaway_tables_cover_the_article():
    import json
    from pathlib import Path

    nb = json.loads(
        (
            Path(__file__).resolve().parents[2] / "notebooks" / "07_isolation_and_security.ipynb"
        ).read_text()
    )
    md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    checklist, template = _table_rows(md, "symptom"), _table_rows(md, "template item")
    assert len(checklist) == 8 and len(template) == 8 and all(len(r) == 6 for r in checklist)
    fw = {r[0]: r[1] for r in _table_rows(md, "framework")}
    assert list(fw) == ["HF Transformers", "vLLM", "kvlab", "TensorRT-LLM", "TGI"]
    assert all("not run here" in fw[f] for f in ("TensorRT-LLM", "TGI"))
    assert all(
        fw[f].startswith("measured in this series") for f in ("HF Transformers", "vLLM", "kvlab")
    )


def test_the_shared_baseline_runs_without_repeating_the_engines_warning(lm):
    """07 runs "shared" on purpose and says why; the lesson's calls keep the warning out of the
    page, and an engine used directly still warns."""
    import warnings

    from kvlab.engine.tenants import SharedTenantsWarning

    model, tok = lm
    engine = Engine(model, tok, num_blocks=64, block_size=BS, isolation="shared")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedTenantsWarning)
        S.quietly(N.timing_probe, engine, tok("口令是什么？")["input_ids"], "attacker")
    with pytest.warns(SharedTenantsWarning):
        Engine(model, tok, num_blocks=64, block_size=BS).generate(
            [[1, 2, 3]], SamplingParams(max_tokens=1), tenants=["acme"]
        )


# --- section 1: the salt and the salted chain written in the notebook -----------------------------
def test_the_notebooks_salt_is_the_engines():
    from kvlab.engine import tenants as T

    secret = T.new_secret()
    for tenant in ("acme", "globex", "acme ", "", "租户"):
        assert N.tenant_salt(secret, tenant) == T.tenant_salt(secret, tenant)
    assert N.tenant_salt(secret, "acme") != N.tenant_salt(T.new_secret(), "acme")


def test_the_salted_chain_is_kvlabs_and_keeps_tenants_apart_except_whole_public_blocks():
    from kvlab.cache.hashing import prompt_block_hashes, salted_block

    rng = random.Random(0)
    ids = [rng.randrange(1000) for _ in range(86)]
    for public in (0, 40, 56):
        k = salted_block(public, BS)
        a, b = N.salted_hashes(ids, BS, "salt-a", k), N.salted_hashes(ids, BS, "salt-b", k)
        assert a == prompt_block_hashes(ids, BS, cache_salt="salt-a", salt_block=k)
        assert [x == y for x, y in zip(a, b)] == [i < k for i in range(len(a))]


def test_closing_evidence_gives_every_row_a_verdict(lm):
    import pandas as pd

    from kvlab.lessons import nb03_position as X
    from kvlab.lessons.common import ROW_NAMES, VERDICTS, decision_table

    model, tok = lm
    rows, errors = X.position_experiment(model, tok, n=4, shift=1024, new_tokens=6)
    probes = {
        p: S.run_attack(
            Engine(model, tok, num_blocks=256, block_size=BS, isolation=p),
            tok,
            2,
            2,
            S.operator_system_prompt(seed=1),
            seed=1,
        )
        for p in ("shared", "tenant", "public-prefix")
    }
    cost = S.isolation_cost(model, tok, 2, S.operator_system_prompt(), block_size=BS)
    load = S.stress_workload(tok, 8, seed=2)
    ref = S.isolated_outputs(model, tok, load[0])
    reports = {
        p: S.stress_test(model, tok, load, ref, policy=p)
        for p in ("public-prefix", "tenant", "shared")
    }
    cow = pd.DataFrame([S.write_shared_block(c) for c in (True, False)])
    assert cow["parent reads its own tokens"].tolist() == [True, False]
    evidence = S.closing_evidence(
        X.position_table(rows), errors, 1024, S.attack_table(probes), cost, reports, cow
    )
    assert set(evidence) == set(ROW_NAMES) and all(
        e.verdict in VERDICTS and e.cell for e in evidence.values()
    )
    assert (
        evidence["same-start"].verdict == "refined"
        and "equal distances" in evidence["same-start"].measured
    )
    assert evidence["identical-prefix"].verdict == "confirmed"
    table = decision_table(evidence)
    assert {"verdict", "measured in"} <= set(table.columns)
    assert len(S.attack_verdicts(S.attack_table(probes))) == 3 and "recovers" in S.cost_verdict(
        cost, BS
    )
