"""Tenants and isolation: derived salts, the public-prefix policy, cross-tenant hit counts, the timing
statistics, and a fast concurrency stress test (hundreds of requests, outputs equal to HF generate alone).

Nothing here asserts on a timing: the probe's TTFTs are noisy by nature, so the tests check the
cached-token counts that cause them, and the statistics on synthetic samples.
"""

import hashlib
import hmac
import inspect
import random

import pytest
import torch

from kvlab.cache.block_manager import BlockManager, TenantScope
from kvlab.cache.hashing import block_extra_keys, first_block_extra_keys
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.tenants import public_prefix_length, tenant_salt
from kvlab.lessons import nb07_security as S

BS = 16






@pytest.fixture(scope="module")
def tiny():
    """A random-initialised tiny Qwen2 without tokenizer (token ids only)."""
    import transformers as T

    cfg = T.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, eos_token_id=None,
                        bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# --- the block layer: where the salt goes --------------------------------------------------------------
def test_block_extra_keys_generalise_the_first_block_keys():
    for salt in (None, "s"):
        assert block_extra_keys(0, "fp", salt) == first_block_extra_keys("fp", salt)
        assert block_extra_keys(1, "fp", salt) == ()
    assert block_extra_keys(0, "fp", "s", salt_block=2) == (("model", "fp"),)
    assert block_extra_keys(2, "fp", "s", salt_block=2) == (("salt", "s"),)


@pytest.mark.parametrize("public", [40, 48])  # the boundary inside block 2, and on a block edge
def test_public_blocks_are_shared_and_nothing_after_them(public):
    m = BlockManager(64, BS, model_fingerprint="fp")
    system, rest = ids(0, public), ids(1, 30)
    assert m.allocate("a1", system + rest, TenantScope(salt="A", public_tokens=public, tenant="a")) == 0
    shared = public // BS * BS  # whole public blocks only: a block straddling the boundary is private
    assert m.allocate("b1", system + rest, TenantScope(salt="B", public_tokens=public, tenant="b")) == shared
    assert m.metrics.public_hits == public // BS and m.metrics.cross_tenant_hits == 0
    assert m.allocate("a2", system + rest, TenantScope(salt="A", public_tokens=public, tenant="a")) == (public + 30 - 1) // BS * BS
    assert m.metrics.public_hits == public // BS  # a's own blocks: not cross-tenant
    by = {row["tenant"]: row for row in m.metrics.tenant_table()}
    assert by["b"]["hit_tokens"] == shared and by["a"]["requests"] == 2
    m.check_invariants()


def test_salt_reaches_blocks_filled_by_decoding():
    m = BlockManager(64, BS)
    system = ids(2, 32)
    prompt = system + ids(3, 10)
    m.allocate("a", prompt, TenantScope(salt="A", public_tokens=32, tenant="a"))
    for t in ids(4, 6):  # fills block 2 during decode: it must be registered with A's salt
        m.append("a", t)
    full = m.seqs["a"].token_ids
    assert m.allocate("b", full + [1], TenantScope(salt="B", public_tokens=32, tenant="b")) == 32
    assert m.allocate("a2", full + [1], TenantScope(salt="A", public_tokens=32, tenant="a")) == 48
    assert m.metrics.cross_tenant_hits == 0
    m.check_invariants()


def test_unsalted_sharing_is_counted_as_cross_tenant():
    m = BlockManager(64, BS)
    p = ids(5, 50)
    m.allocate("a", p, TenantScope(tenant="a"))
    assert m.allocate("b", p, TenantScope(tenant="b")) == 48
    assert m.metrics.cross_tenant_hits == 3 and m.metrics.public_hits == 0


def test_public_prefix_length_and_bad_boundaries():
    assert public_prefix_length([1, 2, 3, 4], [[1, 2], [1, 2, 3], [9]]) == 3
    assert public_prefix_length([1, 2], [[1, 2, 3]]) == 0
    m = BlockManager(8, BS)
    with pytest.raises(ValueError, match="public_tokens"):
        m.allocate("x", [1, 2, 3], TenantScope(salt="s", public_tokens=4))
    assert not m.seqs


# --- the engine: tenants, derived salts, forgeries ----------------------------------------------------
def test_tenant_salts_are_derived_and_isolate(tiny):
    prompt, sp = ids(6, 70), SamplingParams(max_tokens=4)
    engine = Engine(tiny, None, num_blocks=64, block_size=BS, isolation="tenant", secret=b"s" * 32, debug=True)
    a1, b1, a2 = engine.generate([prompt] * 3, sp, tenants=["a", "b", "a"])  # admitted together
    assert a1.num_cached_tokens == b1.num_cached_tokens == 0 < a2.num_cached_tokens
    assert a1.output_ids == b1.output_ids == a2.output_ids
    assert engine.stats()["cross_tenant_hits"] == 0
    by = {row["tenant"]: row for row in engine.block_manager.metrics.tenant_table()}
    assert by["a"]["hit_tokens"] == a2.num_cached_tokens and by["b"]["hit_tokens"] == 0
    assert engine.salt_for("a") == tenant_salt(b"s" * 32, "a") != tenant_salt(b"t" * 32, "a")


def test_a_request_cannot_choose_or_forge_a_salt(tiny):
    secret = b"server-secret-0123456789abcdef!!"
    engine = Engine(tiny, None, num_blocks=64, block_size=BS, isolation="tenant", secret=secret, debug=True)
    assert "salt" not in inspect.signature(engine.add_request).parameters  # no request-level salt field
    with pytest.raises(TypeError):
        engine.add_request([1, 2, 3], salt="anything")
    with pytest.raises(ValueError, match="not both"):
        engine.add_request([1, 2, 3], tenant="a", unsafe_salt="x")
    prompt = ids(7, 70)
    engine.generate([prompt], SamplingParams(max_tokens=2), tenants=["victim"])
    # every salt an attacker can compute without the server secret
    forgeries = ["victim", "", hashlib.sha256(b"victim").hexdigest(), tenant_salt(b"x" * 32, "victim"),
                 hmac.new(b"victim", b"victim", hashlib.sha256).hexdigest()]
    outs = engine.generate([prompt] * len(forgeries), SamplingParams(max_tokens=2), unsafe_salts=forgeries)
    assert [o.num_cached_tokens for o in outs] == [0] * len(forgeries)
    for tenant in ("victim ", "Victim", None, "attacker"):  # any other tenant id gets another salt
        assert engine.generate([prompt], SamplingParams(max_tokens=2), tenants=[tenant])[0].num_cached_tokens == 0
    assert engine.generate([prompt], SamplingParams(max_tokens=2), tenants=["victim"])[0].num_cached_tokens > 0
    assert engine.stats()["cross_tenant_hits"] == 0
    other = Engine(tiny, None, num_blocks=8, block_size=BS, isolation="tenant")  # no secret given: a random one
    assert other.salt_for("victim") != engine.salt_for("victim")
    with pytest.raises(ValueError, match="policy"):
        Engine(tiny, None, num_blocks=8, isolation="salted")


def test_public_prefix_policy_in_the_engine(tiny):
    system, sp = ids(8, 40), SamplingParams(max_tokens=3)
    engine = Engine(tiny, None, num_blocks=64, block_size=BS, isolation="public-prefix", debug=True)
    assert engine.add_public_prefix(system) == 40
    prompts = [system + ids(9, 20), system + ids(9, 20), system + ids(10, 25), ids(11, 60)]
    outs = engine.generate(prompts, sp, tenants=["a", "b", "c", "a"])
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 0]  # 2 whole public blocks; block 2 straddles
    again = engine.generate(prompts[:1], sp, tenants=["a"])[0]
    assert again.num_cached_tokens == 48  # a's own private blocks
    st = engine.stats()
    assert st["public_hits"] == 4 and st["cross_tenant_hits"] == 0
    ref = Engine(tiny, None, num_blocks=64, block_size=BS, enable_prefix_caching=False).generate(prompts, sp)
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]


def test_isolation_cost_matches_the_formula(lm):
    model, tok = lm
    rows = {r["policy"]: r for r in S.isolation_cost(model, tok, n_tenants=4, per_tenant=1, block_size=BS)}
    assert rows["shared"]["outputs"] == rows["tenant"]["outputs"] == rows["public-prefix"]["outputs"]
    n, computed = rows["tenant"]["prompt tokens"], {p: r["prefill tokens computed"] for p, r in rows.items()}
    assert computed["tenant"] == n and rows["tenant"]["hit tokens"] == 0
    assert computed["shared"] <= computed["public-prefix"] < computed["tenant"]
    system_tokens = len(tok(S.operator_system_prompt(), add_special_tokens=False)["input_ids"])
    assert computed["public-prefix"] == n - 3 * (system_tokens // BS) * BS
    assert rows["public-prefix"]["peak KV blocks"] < rows["tenant"]["peak KV blocks"]
    assert rows["public-prefix"]["cross-tenant hits (blocks)"] == 0 < rows["shared"]["cross-tenant hits (blocks)"]


# --- the probe: hits are what the timing would show ----------------------------------------------------
@pytest.mark.parametrize("policy", ["shared", "tenant", "public-prefix"])
def test_the_probe_hits_only_without_isolation(lm, policy):
    model, tok = lm
    engine = Engine(model, tok, num_blocks=256, block_size=BS, isolation=policy, debug=True)
    probes = S.run_attack(engine, tok, n_trials=2, n_wrong=2, seed=1)
    right = {p.cached_tokens for p in probes if p.is_secret}
    wrong = {p.cached_tokens for p in probes if not p.is_secret}
    if policy == "shared":
        assert min(right) > max(wrong)  # the right guess is served from the victim's blocks
        assert engine.stats()["cross_tenant_hits"] > 0
    else:
        assert right == wrong  # both only hit the attacker's own (or the public) blocks
        assert engine.stats()["cross_tenant_hits"] == 0
    assert (engine.stats()["public_hits"] > 0) == (policy == "public-prefix")


# --- statistics -----------------------------------------------------------------------------------------
def test_roc_auc_is_the_mann_whitney_statistic():
    from scipy.stats import mannwhitneyu

    rng = random.Random(0)
    for _ in range(20):
        pos = [rng.randint(0, 9) for _ in range(rng.randint(1, 15))]
        neg = [rng.randint(0, 9) for _ in range(rng.randint(1, 15))]
        u = mannwhitneyu(pos, neg, alternative="two-sided").statistic
        assert S.roc_auc(pos, neg) == pytest.approx(u / (len(pos) * len(neg)))
    assert S.roc_auc([3, 4], [1, 2]) == 1.0 and S.roc_auc([1, 2], [3, 4]) == 0.0 and S.roc_auc([1], [1]) == 0.5
    fpr, tpr = S.roc_curve([3, 4], [1, 2])
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1 and (0.0, 1.0) in zip(fpr, tpr)
    with pytest.raises(ValueError):
        S.roc_auc([], [1.0])


def test_ks_detects_a_shift_and_not_noise():
    rng = random.Random(1)
    miss = [rng.gauss(100, 5) for _ in range(200)]
    hit = [rng.gauss(80, 5) for _ in range(200)]
    same = [rng.gauss(100, 5) for _ in range(200)]
    d, p = S.ks_test(hit, miss)
    assert d > 0.8 and p < 1e-8 and S.roc_auc([-x for x in hit], [-x for x in miss]) > 0.95
    d, p = S.ks_test(same, miss)  # the case that must fail to detect anything
    assert p > 0.01 and abs(S.roc_auc(same, miss) - 0.5) < 0.1


def test_exercise_checkers_accept_right_and_reject_wrong():
    assert S.check_salt_split(2, 32, public_tokens=40, block_size=16)
    assert not S.check_salt_split(3, 40, public_tokens=40, block_size=16)
    assert S.check_prefill_tokens(8 * 130, 8 * 130 - 7 * 112, 8, 120, 10, 16)
    assert not S.check_prefill_tokens(8 * 130, 130, 8, 120, 10, 16)

    def naive(pos, neg):
        return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))

    def no_ties(pos, neg):  # the classic slip: ties counted as losses
        return sum(p > n for p in pos for n in neg) / (len(pos) * len(neg))

    assert S.check_auc_fn(naive) and not S.check_auc_fn(no_ties) and not S.check_auc_fn(lambda p, n: 1 / 0)


# --- the concurrency stress test -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stress_load(lm):
    model, tok = lm
    workload = S.stress_workload(tok, 300, seed=3)
    return workload, S.isolated_outputs(model, tok, workload[0])


@pytest.mark.parametrize("policy", ["public-prefix", "tenant", "shared"])
def test_stress_outputs_equal_isolated(lm, stress_load, policy):
    model, tok = lm
    workload, reference = stress_load
    rep = S.stress_test(model, tok, 300, policy=policy, seed=3, workload=workload, reference=reference)
    assert rep.mismatches == 0, f"requests {rep.mismatched[:5]} differ from HF generate alone"
    assert rep.leaked_blocks == 0 and rep.evictions > 0 and rep.preemptions > 0
    assert (rep.cross_tenant_hits == 0) == (policy != "shared")  # shared: tenants hit each other's blocks
    assert (rep.public_hits > 0) == (policy == "public-prefix")
    assert rep.ok and rep.line() == (f"requests=300 mismatches=0 cross_tenant_hits={rep.cross_tenant_hits} "
                                     "leaked_blocks=0")
    # each request counted once in the per-tenant table and by the manager; re-admissions counted apart
    table = rep.tenant_table
    assert sum(r["requests"] for r in table) == 300
    assert sum(r["re-admissions"] for r in table) == rep.preemptions == rep.preempted_lookups


def test_tenant_table_counts_requests_not_lookups():
    from types import SimpleNamespace

    sp = SamplingParams(max_tokens=1)
    reqs = [S.StressRequest([1] * 20, "a", sp, 0), S.StressRequest([1] * 40, "a", sp, 0), S.StressRequest([2] * 16, "b", sp, 1)]
    outs = {0: SimpleNamespace(num_cached_tokens=0, num_preemptions=2), 1: SimpleNamespace(num_cached_tokens=16, num_preemptions=0),
            2: SimpleNamespace(num_cached_tokens=0, num_preemptions=0)}
    rows = S.tenant_table(reqs, outs, [{"tenant": "a", "requests": 2}, {"tenant": "b", "requests": 1}])
    assert [(r["tenant"], r["requests"], r["re-admissions"]) for r in rows] == [("a", 2, 2), ("b", 1, 0)]
    assert rows[0]["hit rate (first admission)"] == 16 / 60
    with pytest.raises(ValueError, match="the block manager counted 4 requests"):
        S.tenant_table(reqs, outs, [{"tenant": "a", "requests": 4}, {"tenant": "b", "requests": 1}])


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B-Instruct", "Qwen1.5-7B-Chat"])
def test_param_count_matches_transformers(name):
    import transformers as T

    from kvlab.engine.models import load_public_config

    cfg = load_public_config(name)
    with torch.device("meta"):
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**{k: v for k, v in cfg.items() if not k.startswith("_")}))
    assert S.param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_memory_column_of_qwen15_7b():
    from kvlab.engine.models import load_public_config

    cfg = load_public_config("Qwen1.5-7B-Chat")
    mem = S.memory_column(cfg)
    assert mem["parameters"] == 7_721_324_544 and round(mem["weights GB (1e9 bytes)"], 2) == 15.44
    assert mem["weights exceed the article's total"] and mem["KV bytes per token"] == 2 * 32 * 32 * 128 * 2


def test_takeaway_tables_cover_the_article():
    assert len(S.takeaways("checklist")) == 8 and len(S.takeaways("template")) == 8
    fw = S.takeaways("frameworks")
    assert list(fw["framework"]) == ["HF Transformers", "vLLM", "kvlab", "TensorRT-LLM", "TGI"]
    assert all("not run here" in s for s in fw.loc[fw.framework.isin(["TensorRT-LLM", "TGI"]), "source"])
    assert all(s.startswith("measured in this series") for s in fw.loc[~fw.framework.isin(["TensorRT-LLM", "TGI"]), "source"])
    ev = S.takeaways("checklist", {"ref-count leak": "0 leaked"})
    assert ev.loc[ev["cause (article)"] == "ref-count leak", "measured here (07)"].item() == "0 leaked"
    with pytest.raises(ValueError):
        S.takeaways("nope")
