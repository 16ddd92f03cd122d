"""Tenants and isolation: derived salts, the public-prefix policy, cross-tenant hit counts.

Notebook 07's experiments on the engine (the timing probe, its statistics, the stress test) are
tested in ``tests/lessons/test_nb07_security.py``.
"""

import hashlib
import hmac
import inspect
import random

import pytest

from kvlab.cache.block_manager import BlockManager, TenantScope
from kvlab.cache.hash_tools import first_block_extra_keys
from kvlab.cache.hashing import block_extra_keys
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.tenants import public_prefix_length, tenant_salt

BS = 16






@pytest.fixture(scope="module")
def tiny():
    """A random-initialised tiny Qwen2 without tokenizer (token ids only)."""
    from tiny_models import tiny_qwen2

    return tiny_qwen2()


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# --- the block layer: where the salt goes ---------------------------------------------------------
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
    assert (
        m.allocate(
            "a1", system + rest, TenantScope(cache_salt="A", public_tokens=public, tenant="a")
        )
        == 0
    )
    # whole public blocks only: a block straddling the boundary is private
    shared = public // BS * BS
    assert (
        m.allocate(
            "b1", system + rest, TenantScope(cache_salt="B", public_tokens=public, tenant="b")
        )
        == shared
    )
    assert m.metrics.public_hits == public // BS and m.metrics.cross_tenant_hits == 0
    assert (
        m.allocate(
            "a2", system + rest, TenantScope(cache_salt="A", public_tokens=public, tenant="a")
        )
        == (public + 30 - 1) // BS * BS
    )
    assert m.metrics.public_hits == public // BS  # a's own blocks: not cross-tenant
    by = {row["tenant"]: row for row in m.metrics.tenant_table()}
    assert by["b"]["hit_tokens"] == shared and by["a"]["requests"] == 2
    m.check_invariants()


def test_salt_reaches_blocks_filled_by_decoding():
    m = BlockManager(64, BS)
    system = ids(2, 32)
    prompt = system + ids(3, 10)
    m.allocate("a", prompt, TenantScope(cache_salt="A", public_tokens=32, tenant="a"))
    for t in ids(4, 6):  # fills block 2 during decode: it must be registered with A's salt
        m.append("a", t)
    full = m.seqs["a"].token_ids
    assert (
        m.allocate("b", full + [1], TenantScope(cache_salt="B", public_tokens=32, tenant="b")) == 32
    )
    assert (
        m.allocate("a2", full + [1], TenantScope(cache_salt="A", public_tokens=32, tenant="a"))
        == 48
    )
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
        m.allocate("x", [1, 2, 3], TenantScope(cache_salt="s", public_tokens=4))
    assert not m.seqs


# --- the engine: tenants, derived salts, forgeries ------------------------------------------------
def test_tenant_salts_are_derived_and_isolate(tiny):
    prompt, sp = ids(6, 70), SamplingParams(max_tokens=4)
    engine = Engine(
        tiny, None, num_blocks=64, block_size=BS, isolation="tenant", secret=b"s" * 32, debug=True
    )
    a1, b1, a2 = engine.generate([prompt] * 3, sp, tenants=["a", "b", "a"])  # admitted together
    assert a1.num_cached_tokens == b1.num_cached_tokens == 0 < a2.num_cached_tokens
    assert a1.output_ids == b1.output_ids == a2.output_ids
    assert engine.stats()["cross_tenant_hits"] == 0
    by = {row["tenant"]: row for row in engine.block_manager.metrics.tenant_table()}
    assert by["a"]["hit_tokens"] == a2.num_cached_tokens and by["b"]["hit_tokens"] == 0
    assert engine.salt_for("a") == tenant_salt(b"s" * 32, "a") != tenant_salt(b"t" * 32, "a")


def test_a_request_cannot_choose_or_forge_a_salt(tiny):
    secret = b"server-secret-0123456789abcdef!!"
    engine = Engine(
        tiny, None, num_blocks=64, block_size=BS, isolation="tenant", secret=secret, debug=True
    )
    # no request-level salt field
    assert "salt" not in inspect.signature(engine.add_request).parameters
    with pytest.raises(TypeError):
        engine.add_request([1, 2, 3], salt="anything")
    with pytest.raises(ValueError, match="not both"):
        engine.add_request([1, 2, 3], tenant="a", unsafe_salt="x")
    prompt = ids(7, 70)
    engine.generate([prompt], SamplingParams(max_tokens=2), tenants=["victim"])
    # every salt an attacker can compute without the server secret
    forgeries = [
        "victim",
        "",
        hashlib.sha256(b"victim").hexdigest(),
        tenant_salt(b"x" * 32, "victim"),
        hmac.new(b"victim", b"victim", hashlib.sha256).hexdigest(),
    ]
    outs = engine.generate(
        [prompt] * len(forgeries), SamplingParams(max_tokens=2), unsafe_salts=forgeries
    )
    assert [o.num_cached_tokens for o in outs] == [0] * len(forgeries)
    for tenant in ("victim ", "Victim", None, "attacker"):  # any other tenant id gets another salt
        assert (
            engine.generate([prompt], SamplingParams(max_tokens=2), tenants=[tenant])[
                0
            ].num_cached_tokens
            == 0
        )
    assert (
        engine.generate([prompt], SamplingParams(max_tokens=2), tenants=["victim"])[
            0
        ].num_cached_tokens
        > 0
    )
    assert engine.stats()["cross_tenant_hits"] == 0
    # no secret given: a random one
    other = Engine(tiny, None, num_blocks=8, block_size=BS, isolation="tenant")
    assert other.salt_for("victim") != engine.salt_for("victim")
    with pytest.raises(ValueError, match="policy"):
        Engine(tiny, None, num_blocks=8, isolation="salted")


def test_public_prefix_policy_in_the_engine(tiny):
    system, sp = ids(8, 40), SamplingParams(max_tokens=3)
    engine = Engine(tiny, None, num_blocks=64, block_size=BS, isolation="public-prefix", debug=True)
    assert engine.add_public_prefix(system) == 40
    prompts = [system + ids(9, 20), system + ids(9, 20), system + ids(10, 25), ids(11, 60)]
    outs = engine.generate(prompts, sp, tenants=["a", "b", "c", "a"])
    # 2 whole public blocks; block 2 straddles
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 0]
    again = engine.generate(prompts[:1], sp, tenants=["a"])[0]
    assert again.num_cached_tokens == 48  # a's own private blocks
    st = engine.stats()
    assert st["public_hits"] == 4 and st["cross_tenant_hits"] == 0
    ref = Engine(tiny, None, num_blocks=64, block_size=BS, enable_prefix_caching=False).generate(
        prompts, sp
    )
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]


# --- cache_salt: derived in the engine, the request keeps its tenant (issue 37) -------------------
SECRET = b"server-secret-0123456789abcdef!!"


def _old_serve_salt(engine: Engine, secret: bytes, tenant, cache_salt: str) -> str:
    """The salt ``kvlab serve`` derived before the engine did (``tenancy.request_scope``), byte for
    byte."""
    scope = engine.salt_for(tenant) or ""
    msg = b"kvlab-cache-salt\x00" + scope.encode() + b"\x00" + cache_salt.encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def test_a_salted_request_keeps_its_tenant(tiny):
    from kvlab.engine import UnknownRequestError

    engine = Engine(
        tiny, None, num_blocks=64, block_size=BS, isolation="tenant", secret=SECRET, debug=True
    )
    prompt, sp = ids(11, 40), SamplingParams(max_tokens=3)
    rid = engine.add_request(prompt, sp, tenant="acme", cache_salt="s1")
    assert engine.requests[rid].tenant == "acme"
    with pytest.raises(UnknownRequestError):  # abort is scoped by the tenant, salt or not
        engine.abort(rid)
    assert engine.abort(rid, tenant="acme").finish_reason == "abort"
    first, again = (
        engine.generate([prompt], sp, tenants=["acme"], cache_salts=["s1"])[0] for _ in range(2)
    )
    assert first.num_cached_tokens == 0 < again.num_cached_tokens
    by = {row["tenant"]: row for row in engine.block_manager.metrics.tenant_table()}
    assert by["acme"]["requests"] == 2 and by["acme"]["hit_tokens"] == again.num_cached_tokens
    assert set(by) == {"acme"}  # counted for its tenant, never under a salt's hex


@pytest.mark.filterwarnings("ignore::kvlab.engine.tenants.SharedTenantsWarning")
@pytest.mark.parametrize("isolation", ["shared", "tenant", "public-prefix"])
def test_the_engine_derives_the_salt_serve_derived(tiny, isolation):
    from kvlab.engine.tenants import request_salt

    engine = Engine(tiny, None, num_blocks=64, block_size=BS, isolation=isolation, secret=SECRET)
    for tenant in ("acme", "globex", None, ""):
        for cache_salt in ("s1", "my-team", "é"):
            old = _old_serve_salt(engine, SECRET, tenant, cache_salt)
            assert request_salt(SECRET, isolation, tenant, cache_salt) == old
            rid = engine.add_request(ids(3, 20), tenant=tenant, cache_salt=cache_salt)
            assert (
                engine.requests[rid].scope.cache_salt == old
                and engine.requests[rid].tenant == tenant
            )
            engine.abort(rid, tenant=tenant)
        # without a cache_salt: the tenant's salt, as before
        assert request_salt(SECRET, isolation, tenant) == engine.salt_for(tenant)


@pytest.mark.filterwarnings("ignore::kvlab.engine.tenants.SharedTenantsWarning")
@pytest.mark.parametrize(
    "isolation, shares", [("tenant", False), ("public-prefix", False), ("shared", True)]
)
def test_equal_cache_salts_share_across_tenants_only_under_shared(tiny, isolation, shares):
    engine = Engine(
        tiny, None, num_blocks=64, block_size=BS, isolation=isolation, secret=SECRET, debug=True
    )
    prompt, sp = ids(12, 48), SamplingParams(max_tokens=2)
    engine.generate([prompt], sp, tenants=["acme"], cache_salts=["team"])
    other = engine.generate([prompt], sp, tenants=["globex"], cache_salts=["team"])[0]
    assert (other.num_cached_tokens > 0) == shares
    # a salt never hits the unsalted cache of its own tenant, nor another salt's
    assert engine.generate([prompt], sp, tenants=["acme"])[0].num_cached_tokens == 0
    assert (
        engine.generate([prompt], sp, tenants=["acme"], cache_salts=["other"])[0].num_cached_tokens
        == 0
    )
    assert (
        engine.generate([prompt], sp, tenants=["acme"], cache_salts=["team"])[0].num_cached_tokens
        > 0
    )
    if not shares:
        assert engine.stats()["cross_tenant_hits"] == 0


def test_intake_errors_name_their_field(tiny):
    from kvlab.engine.intake import RequestError, RequestTypeError, make_sampling

    engine = Engine(tiny, None, num_blocks=4, block_size=BS, isolation="tenant", secret=SECRET)
    cases = [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, 999]), "prompt"),
        (dict(prompt=[1.5]), "prompt"),
        (dict(prompt=[1] * 70), "prompt"),  # the prompt alone needs 5 of the pool's 4 blocks
        (
            dict(prompt=[1] * 40, sampling=SamplingParams(max_tokens=40)),
            "max_tokens",
        ),  # it fits, its output not
        (
            dict(prompt=[1] * 400, sampling=SamplingParams(max_tokens=200)),
            "max_tokens",
        ),  # past 512 positions
        (dict(prompt=[1, 2], sampling="greedy"), "sampling"),
        (dict(prompt=[1, 2], tenant=5), "tenant"),
        (dict(prompt=[1, 2], cache_salt=""), "cache_salt"),
        (dict(prompt=[1, 2], cache_salt="\ud800"), "cache_salt"),
        (dict(prompt=[1, 2], tenant="a", unsafe_salt="x"), "unsafe_salt"),
    ]
    for kwargs, field in cases:
        kwargs = {"sampling": None, **kwargs}
        with pytest.raises(RequestError) as e:
            engine.add_request(kwargs.pop("prompt"), kwargs.pop("sampling"), **kwargs)
        assert e.value.field == field, (kwargs, str(e.value))
    with pytest.raises(TypeError) as e:  # a wrong type is still a TypeError
        engine.add_request([1, 2], tenant=5)
    assert isinstance(e.value, RequestTypeError) and e.value.field == "tenant"
    for field, value in (
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("seed", -1),
        ("max_tokens", 0),
    ):
        with pytest.raises(RequestError) as e:
            make_sampling(**{"max_tokens": 4, "temperature": 0.5, field: value})
        assert e.value.field == field
    assert not engine.requests and not engine.scheduler.waiting  # nothing queued
