"""One trace replay on the real scheduler (``kvlab.engine.trace_replay``): scripted tokens, any
cache, no torch."""

import subprocess
import sys

import pytest

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.radix import RadixCache
from kvlab.engine.trace_replay import ScriptedScheduler, TraceRequest, replay_trace


def _trace(n: int = 12, block_size: int = 4) -> list[TraceRequest]:
    system = list(range(100, 100 + 3 * block_size + 1))
    return [
        TraceRequest(f"r{i}", system + [1000 + i] * (i % 5 + 1), [2000 + i] * (i % 3 + 2))
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "make", [lambda: BlockManager(40, 4), lambda: RadixCache(160, 1)], ids=["blocks", "radix"]
)
def test_replay_runs_every_request_and_frees_the_pool(make):
    cache, trace = make(), _trace()
    res = replay_trace(cache, trace, max_num_seqs=3)
    cache.check_invariants()
    assert not cache.seqs and cache.num_free_blocks == cache.num_blocks
    assert set(res.cached_tokens) == {r.req_id for r in trace} and res.num_preemptions == 0
    assert res.query_tokens == sum(len(r.prompt) for r in trace)
    assert all(0 <= res.cached_tokens[r.req_id] < len(r.prompt) for r in trace)
    assert res.cached_tokens["r0"] == 0 and res.hit_tokens > 0
    assert 0 < res.peak_blocks_used <= cache.num_blocks


def _conversations(n: int, turns: int, seed: int = 1) -> list[TraceRequest]:
    import random

    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(32_000) for _ in range(k)]  # noqa: E731
    system, out = ids(40), []
    for c in range(n):
        history: list[int] = []
        for t in range(turns):
            user, reply = ids(rng.randint(4, 30)), ids(rng.randint(2, 20))
            out.append(
                TraceRequest(
                    f"c{c}t{t}",
                    system + history + user,
                    reply,
                    after=f"c{c}t{t - 1}" if t else None,
                )
            )
            history += user + reply
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_token_pages_hit_at_least_what_hash_blocks_hit(page_size):
    reqs = _conversations(6, 3)
    radix = replay_trace(RadixCache(4096 // page_size, page_size), reqs, max_num_seqs=4)
    blocks = replay_trace(BlockManager(4096 // 16, 16), reqs, max_num_seqs=4)
    assert len(radix.cached_tokens) == len(blocks.cached_tokens) == len(reqs)
    assert radix.hit_tokens >= blocks.hit_tokens if page_size == 1 else radix.hit_tokens > 0


def test_a_radix_cache_under_pressure_evicts_and_stays_consistent():
    cache = RadixCache(300, 1)
    replay_trace(cache, _conversations(12, 3, seed=2), max_num_seqs=3)
    assert cache.stats()["evictions"] > 0 and not cache.seqs
    cache.check_invariants()
    assert cache.num_free_blocks == cache.num_pages


def test_a_later_turn_hits_its_predecessor_but_not_the_reply_token_never_written():
    prompt = [1, 2, 3, 4, 5, 6, 7]
    # the engine writes K/V of the prompt and every reply token but the last: 7 + 1 = 8 tokens, two
    # full blocks
    first = TraceRequest("t0", prompt, [8, 9])
    second = TraceRequest("t1", prompt + [8, 9, 10, 11, 12], [13], after="t0")
    res = replay_trace(BlockManager(16, 4), [second, first])  # listed first, it still waits for t0
    assert res.cached_tokens == {"t0": 0, "t1": 8}
    short = replay_trace(
        BlockManager(16, 4),
        [
            TraceRequest("t0", prompt, [8]),
            TraceRequest("t1", prompt + [8, 9, 10], [13], after="t0"),
        ],
    )
    # reply [8] alone: K/V of the 7 prompt tokens, one full block
    assert short.cached_tokens["t1"] == 4


def test_reserve_avoids_the_preemptions_the_scheduler_makes_without_it():
    trace = [
        TraceRequest(f"r{i}", [10 * i + k for k in range(4)], list(range(7))) for i in range(2)
    ]  # 3 blocks each
    free_for_all = replay_trace(BlockManager(4, 4), trace, reserve=False)
    reserved = replay_trace(BlockManager(4, 4), trace, reserve=True)
    assert free_for_all.num_preemptions > 0 and reserved.num_preemptions == 0
    assert reserved.steps == 2 * 7  # one after the other: seven steps each


def test_the_step_counts_and_wasted_slots_of_a_hand_checked_run():
    res = replay_trace(BlockManager(8, 4), [TraceRequest("a", [1, 2, 3], [4, 5, 6])])
    # step 1 prefills 3 tokens (1 empty slot), steps 2-3 append 4 then 5 (0, then 3 empty slots)
    assert res.steps == 3 and res.wasted_slots_mean == pytest.approx((1 + 0 + 3) / 3)
    assert res.peak_blocks_used == 2


def test_scripted_scheduler_reports_first_tokens_and_finishes():
    run = ScriptedScheduler(BlockManager(8, 4))
    run.add("x", [1, 2, 3, 4, 5], [6, 7])
    first = run.step()
    assert (
        [s.request_id for s in first.first_token] == ["x"]
        and first.prefill_tokens == 5
        and first.decodes == 0
    )
    # the seam a replica reads its step's counts from
    assert run.scheduler.last_output is first.output
    second = run.step()
    assert [s.output_ids for s in second.finished] == [[6, 7]] and second.decodes == 1
    assert not run.has_unfinished() and not run.requests


def test_a_sequence_already_in_the_cache_keeps_its_blocks_and_its_id():
    cache = BlockManager(16, 4)
    # the caller's own sequence, under the id the scheduler would take first
    cache.allocate(0, [7, 7, 7, 7, 7])
    held = cache.block_table(0)
    res = replay_trace(cache, _trace(4))
    assert cache.block_table(0) == held and list(cache.seqs) == [0] and len(res.cached_tokens) == 4


@pytest.mark.parametrize("bad, match", [
    ([TraceRequest("a", list(range(40)), [1])], "more blocks than the pool"),
    ([TraceRequest("a", [1], [2]), TraceRequest("a", [3], [4])], "unique"),
    ([TraceRequest("a", [1], [])], "non-empty"),
])
def test_bad_traces_are_refused_before_anything_runs(bad, match):
    cache = BlockManager(4, 4)
    with pytest.raises(ValueError, match=match):
        replay_trace(cache, bad)
    assert not cache.seqs and cache.num_free_blocks == 4


def test_importing_the_replay_loads_no_torch():
    code = "import sys, kvlab.engine.trace_replay; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
