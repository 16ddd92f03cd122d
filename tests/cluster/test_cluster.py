"""The fleet: model-free simulation, a replica failure, and real engines as Ray actors agreeing with
it."""

import pytest

from kvlab.cluster import LocalHandle, SimReplica, agree, chat, run_fleet, simulate

# One worker runs every test that uses Ray (tests/cluster/conftest.py starts it once per session).
pytestmark = pytest.mark.xdist_group("ray")

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


def test_simulation_is_deterministic_and_complete():
    wl = chat(**SMALL)
    a, b = simulate(wl, 2, "kv_aware", num_blocks=32), simulate(wl, 2, "kv_aware", num_blocks=32)
    assert a.records == b.records and len(a.records) == wl.num_requests
    assert agree(a, b)["all_agree"]
    s = a.summary()
    assert 0 < s["hit_rate"] < 1 and s["ttft_p50"] > 0


def test_routing_decides_the_hit_rate():
    """Same workload, same fleet: keeping sessions together hits more than spreading them
    blindly."""
    wl = chat(num_sessions=16, num_tenants=4, system_tokens=96, rate=6.0)
    rr = simulate(wl, 4, "round_robin", num_blocks=64).summary()["hit_rate"]
    aff = simulate(wl, 4, "session_affinity", num_blocks=64).summary()["hit_rate"]
    assert aff > rr


def test_index_matches_replicas_after_a_run():
    wl = chat(**SMALL)
    handles = [LocalHandle(SimReplica(24, 16)) for _ in range(2)]
    res = run_fleet(wl, handles, "least_loaded")
    for r, h in enumerate(handles):
        assert res.router.index.hashes(r) == h.call("cached_hashes")
    assert res.router.index.gaps == res.router.index.duplicates == 0 and not res.router.index.stale


def test_small_pool_preempts():
    wl = chat(
        num_sessions=12,
        num_tenants=2,
        system_tokens=64,
        user_tokens=(8, 16),
        turns=(3, 3),
        rate=50.0,
        reply_tokens=16,
    )
    assert simulate(wl, 1, "round_robin", num_blocks=16).summary()["preemptions"] > 0
    assert simulate(wl, 1, "round_robin", num_blocks=256).summary()["preemptions"] == 0


def test_replica_failure_loses_its_cache_and_recovers():
    wl = chat(num_sessions=24, num_tenants=2, system_tokens=128, rate=8.0)
    res = simulate(wl, 2, "session_affinity", num_blocks=64, fail=(1.5, 0, 0.5))
    # requests in flight on the failed replica were routed again
    assert len(res.records) == wl.num_requests
    assert res.router.replicas == [0, 1]  # rejoined
    assert any(r["replica"] == 0 for r in res.records if r["arrival"] > 2.5)



class _Crashes(SimReplica):
    """A replica whose ``step`` raises from its ``n``-th call on (a crashed actor)."""

    def __init__(self, n, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.n, self.calls = n, 0

    def step(self):
        self.calls += 1
        if self.calls >= self.n:
            raise RuntimeError("replica died")
        return super().step()


def test_a_replica_that_raises_keeps_the_healthy_replicas_records():
    wl = chat(**SMALL)
    healthy = run_fleet(wl, [LocalHandle(SimReplica(24, 16)) for _ in range(2)], "round_robin")
    res = run_fleet(
        wl, [LocalHandle(SimReplica(24, 16)), LocalHandle(_Crashes(6, 24, 16))], "round_robin"
    )
    assert res.failed and set(res.errors) == {1} and "replica died" in res.errors[1]
    assert all(f["replica"] == 1 and "replica died" in f["error"] for f in res.failed)
    assert res.records and res.router.replicas == [0] and res.stats[1] == {"error": res.errors[1]}
    done = {r["request_id"] for r in res.records}
    lost = {f["request_id"] for f in res.failed}
    assert not done & lost and done | lost <= {r["request_id"] for r in healthy.records}
    # each session: turns served in order, then at most one failed turn, then nothing
    for s in wl.sessions:
        turns = sorted(
            int(k.split("/t")[1]) for k in done | lost if k.startswith(s.session_id + "/")
        )
        assert turns == list(range(len(turns)))
        assert all(f"{s.session_id}/t{t}" in done for t in turns[:-1])
    assert res.summary()["failed"] == len(res.failed) and res.summary()["requests"] == len(
        res.records
    )


# --- real engines as Ray actors (Ray and its actors start once per session: conftest) ------------

@pytest.fixture(scope="module")
def ray_fleet(ray_replicas_for):
    return ray_replicas_for(2, num_blocks=48, block_size=16)


def test_ray_run_and_simulation_agree(ray_fleet):
    """Real engines on Ray vs the model-free replay of the same run: same replica, same cached
    tokens."""
    wl = chat(**SMALL)
    real = run_fleet(wl, ray_fleet, "kv_aware", clock="model")
    assert len(real.records) == wl.num_requests
    assert sum(r["cached_tokens"] for r in real.records) > 0
    # the index, built from events alone, is what each engine caches
    for r, h in enumerate(ray_fleet):
        assert real.router.index.hashes(r) == h.call("cached_hashes")
    sim = simulate(wl, 2, "kv_aware", num_blocks=48, replies=real.replies)
    report = agree(real, sim)
    assert report["all_agree"], report
    # the replies really are the model's: the scripted ones would give another run
    assert any(real.replies[k] != s.scripted_replies[int(k.split("/t")[1])]
               for s in wl.sessions for k in real.replies if k.startswith(s.session_id + "/"))
