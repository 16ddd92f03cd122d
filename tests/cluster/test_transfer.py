"""K/V moved between replicas: fetched blocks give the tokens of a recompute; a dead holder or a
salt stops a transfer."""

import random
import time

import pytest

from kvlab.cache.hashing import prompt_block_hashes
from kvlab.cluster import (
    LocalHandle,
    Router,
    RouteRequest,
    SimReplica,
    agree,
    chat,
    run_fleet,
    simulate,
)
from kvlab.cluster.object_store import LocalObjectStore, ObjectLost

# One worker runs every test that uses Ray (tests/cluster/conftest.py starts it once per session).
pytestmark = pytest.mark.xdist_group("ray")

BS = 16
SMALL = dict(
    num_sessions=6,
    num_tenants=2,
    system_tokens=64,
    user_tokens=(8, 24),
    reply_tokens=4,
    turns=(3, 4),
    rate=8.0,
    think=0.2,
)


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def _usable_hashes(prompt, fingerprint, salt=None):
    usable = (len(prompt) - 1) // BS * BS
    return prompt_block_hashes(prompt[:usable], BS, fingerprint, salt)


def _run(replica, request_id, prompt, max_tokens=6, fetch=None) -> dict:
    replica.add(request_id, prompt, max_tokens, None, fetch)
    while True:
        res = replica.step()
        for fin in res.finished:
            if fin["request_id"] == request_id:
                return fin


def test_the_local_object_store_loses_a_dead_owners_objects():
    store = LocalObjectStore()
    a, b = store.put("x", owner="A"), store.put("y", owner="B")
    assert store.kill("A") == 1 and store.get(b) == "y"
    with pytest.raises(ObjectLost):
        store.get(a)


@pytest.fixture(scope="module")
def pair():
    """Two in-process engine replicas on the bundled model sharing one object store."""
    from kvlab.cluster import EngineReplica

    store = LocalObjectStore()
    return [
        EngineReplica(num_blocks=32, block_size=BS, tier_blocks=32, object_store=store)
        for _ in range(2)
    ]


def test_fetched_blocks_give_the_tokens_of_a_recompute(pair, lm):
    from kvlab.engine import Engine, SamplingParams

    a, b = pair
    prompt = _prompt(90)
    ref = Engine(*lm, num_blocks=32, enable_prefix_caching=False).generate(
        [prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_ids
    # the pair is the module's: count b's fetches from here, whichever tests ran before
    before = b.stats()
    at_a = _run(a, "p-a", prompt)
    hashes = _usable_hashes(prompt, a.info()["model_fingerprint"])
    moved = b.export(hashes)  # b holds nothing of it
    assert moved is None
    fetched = _run(b, "p-b", prompt, fetch=[a.export(hashes)])
    assert fetched["restored_tokens"] == len(hashes) * BS == fetched["num_cached_tokens"]
    assert at_a["output_ids"] == fetched["output_ids"] == ref
    after = b.stats()
    assert after["fetched_tokens"] - before["fetched_tokens"] == len(hashes) * BS
    assert after["fetch_failures"] == before["fetch_failures"]


def test_a_killed_holder_falls_back_to_recompute(pair):
    a, b = pair
    prompt = _prompt(70, seed=1)
    at_a = _run(a, "q-a", prompt)
    ref = a.export(_usable_hashes(prompt, a.info()["model_fingerprint"]))
    assert ref is not None
    a.fail()  # the holder dies before the fetch: its objects are lost with it
    out = _run(b, "q-b", prompt, fetch=[ref])
    assert out["restored_tokens"] == 0 and out["num_cached_tokens"] == 0
    assert out["output_ids"] == at_a["output_ids"]
    assert b.fetch_failures == 1


def test_a_mislabeled_block_is_refused(pair, lm):
    from kvlab.cache.host_tier import TierEntry

    a, b = pair
    prompt = _prompt(60, seed=2)
    _run(a, "r-a", prompt)
    entries = a._collect(_usable_hashes(prompt, a.info()["model_fingerprint"]), None)
    assert len(entries) == 3
    e = entries[0]
    forged = TierEntry(
        e.block_hash, e.parent_hash, tuple(reversed(e.token_ids)), e.extra_keys, e.payload, e.nbytes
    )
    # its hash does not match its tokens: nothing after it either
    assert b._stage([forged, *entries[1:]]) == 0
    assert b._stage(entries) == 3


def test_transfer_never_crosses_tenant_salts(lm):
    """A salted block is exported only under its own hashes, and a staged one restores only for its
    tenant."""
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    secret = "fleet-secret-0123456789"
    a, b = (
        Engine(
            model,
            tok,
            num_blocks=32,
            host_tier_bytes=10**7,
            isolation="tenant",
            secret=secret,
            enable_kv_events=True,
        )
        for _ in range(2)
    )
    prompt = _prompt(80, seed=3)
    ref = a.generate([prompt], sp, tenants=["alice"])[0].output_ids
    fp = a.block_manager.model_fingerprint
    alice, bob = (_usable_hashes(prompt, fp, a.salt_for(t)) for t in ("alice", "bob"))
    assert a.host_tier.export(bob) == []  # a holds nothing under bob's hashes
    # the router, fed only a's events, plans a pull for alice's hashes and none for bob's
    router = Router("pull", [0, 1], BS, model_fingerprint=fp)
    for batch in a.take_kv_events():
        router.apply_events(0, batch)
    as_alice, as_bob = (
        RouteRequest(rid, tuple(prompt), cache_salt=a.salt_for(t))
        for rid, t in (("x", "alice"), ("y", "bob"))
    )
    assert router.pull_plan(as_alice, 1) == (0, 0, len(alice))
    assert router.pull_plan(as_bob, 1) is None
    # unsalted: other hashes too
    assert router.pull_plan(RouteRequest("z", tuple(prompt)), 1) is None
    assert b.host_tier.stage(a.host_tier.export(alice)) == len(alice)
    out_bob = b.generate([prompt], sp, tenants=["bob"])[0]
    out_alice = b.generate([prompt], sp, tenants=["alice"])[0]
    assert out_bob.num_restored_tokens == 0 and out_alice.num_restored_tokens == len(alice) * BS
    assert out_bob.output_ids == out_alice.output_ids == ref


def test_pull_fetches_in_the_simulation_and_loses_nothing_when_a_holder_fails():
    wl = chat(num_sessions=16, num_tenants=4, system_tokens=96, rate=6.0)
    res = simulate(wl, 4, "pull", num_blocks=64)
    assert len(res.records) == wl.num_requests and res.summary()["restored_rate"] > 0
    assert all(s["fetch_failures"] == 0 for s in res.stats)
    failed = simulate(wl, 4, "pull", num_blocks=64, fail=(1.0, 0, 0.5))
    assert len(failed.records) == wl.num_requests and not failed.failed


def test_pull_on_engines_agrees_with_the_simulation_and_keeps_the_tokens():
    """In-process engines (no Ray): pull's routing and cached tokens match the model-free replay,
    and every reply is the one the engines give without any transfer."""
    from kvlab.cluster import EngineReplica

    wl = chat(**SMALL)
    store = LocalObjectStore()
    handles = [
        LocalHandle(EngineReplica(num_blocks=48, block_size=BS, tier_blocks=48, object_store=store))
        for _ in range(2)
    ]
    real = run_fleet(wl, handles, "pull", clock="model")
    assert sum(r["restored_tokens"] for r in real.records) > 0
    sim = simulate(wl, 2, "pull", num_blocks=48, replies=real.replies)
    report = agree(real, sim)
    assert report["all_agree"], report
    plain = run_fleet(wl, handles, "round_robin", clock="model")
    assert plain.replies == real.replies


def test_a_sim_replica_without_a_tier_stages_nothing():
    r = SimReplica(8, BS)
    assert r.export([b"h"]) is None and r._stage([]) == 0


# --- Ray: real actors, Ray's object store (few, skippable) ----------------------------------------

@pytest.fixture(scope="module")
def ray_pair(ray_session, ray_replicas_for):
    return ray_session, ray_replicas_for(2, num_blocks=32, block_size=BS, tier_blocks=32)


def test_ray_fetch_through_the_object_store_and_a_killed_holder(ray_pair):
    """Ray's object store carries the blocks; a lost object, or a holder dead before or after its
    export, costs a recompute at most: the tokens never change."""
    ray, (a, b) = ray_pair
    prompt = _prompt(90, seed=5)
    hashes = _usable_hashes(prompt, a.call("info")["model_fingerprint"])
    full = len(hashes) * BS

    def run(h, rid, fetch=None):
        h.call("add", rid, prompt, 6, None, fetch)
        while True:
            for fin in h.call("step").finished:
                if fin["request_id"] == rid:
                    return fin

    at_a = run(a, "a")
    got = run(b, "b", [a.call("export", hashes)])
    assert got["restored_tokens"] == full and got["output_ids"] == at_a["output_ids"]
    def dies_mid_transfer():
        raise RuntimeError("holder died mid-transfer")

    b.call("fail")  # a transfer whose object never arrives: the fetch fails, the request recomputes
    broken = ray.remote(dies_mid_transfer).remote()
    lost = run(b, "lost", [broken])
    assert lost["restored_tokens"] == 0 and lost["output_ids"] == at_a["output_ids"]
    assert b.call("stats")["fetch_failures"] == 1
    b.call("fail")
    ref = a.call("export", hashes)
    # the holder dies after its export: the fetch may still find the object, or not
    ray.kill(a.actor)
    # ray.kill is asynchronous: a call sent right after it may still be served, so poll until the
    # actor is gone
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(a.actor.info.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "ray.kill did not take the actor down within 120 s"
        time.sleep(0.1)
    after = run(b, "after-death", [ref])
    assert after["restored_tokens"] in (0, full) and after["output_ids"] == at_a["output_ids"]
    # dead before an export: the driver fetches nothing
    with pytest.raises(ray.exceptions.RayActorError):
        a.call("export", hashes)
