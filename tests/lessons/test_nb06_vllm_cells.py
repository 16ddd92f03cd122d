"""Notebook 06's exported cells (``kvlab.built.nb06``) without vLLM: the free-list rule against
kvlab's BlockPool, the comparisons and the block-pool replay. The runs against real vLLM are in
tests/vllm/test_vllm_bridge.py."""

import random
from collections import OrderedDict

import pytest

from kvlab.built import nb06 as N
from kvlab.cache import BlockPool


@pytest.mark.parametrize("free_order", ["vllm", "lru"])
def test_push_freed_is_kvlabs_block_pool_release(free_order):
    rng = random.Random(0)
    for trial in range(20):
        pool = BlockPool(8, 4, free_order=free_order)
        taken = [pool.take() for _ in range(rng.randint(1, 8))]
        parent = None
        for b in taken:
            # a full block, cached under its hash; the others stay partial tails
            if rng.random() < 0.5:
                b.token_ids = [rng.randrange(100) for _ in range(4)]
                h = bytes([b.block_id, trial])
                pool.register(b, h, parent, 0)
                parent = h
        mine = OrderedDict.fromkeys(pool.free)
        rng.shuffle(taken)
        for b in taken:
            N.push_freed(mine, b.block_id, b.block_hash is not None, free_order)
            pool.release(b)
        assert list(mine) == list(pool.free), (free_order, trial)


def test_tail_blocks_go_first_only_in_vllms_order():
    for order, want in (("vllm", [4, 7, 8, 3]), ("lru", [7, 8, 3, 4])):
        free = OrderedDict.fromkeys([7, 8])
        N.push_freed(free, 3, True, order)
        N.push_freed(free, 4, False, order)
        assert list(free) == want


def test_compare_runs_and_divergence_rows():
    k = {"num_cached_tokens": [0, 32], "output_ids": [[1, 2], [3]]}
    v = {"num_cached_tokens": [0, 0], "output_ids": [[1, 2], [4]]}
    rows = N.compare_runs([[0] * 40, [0] * 40], k, v, hf=[[1, 2], [3]])
    assert [r["cached_equal"] for r in rows] == [True, False]
    assert [(r["kvlab_eq_vllm"], r["kvlab_eq_hf"], r["vllm_eq_hf"]) for r in rows] == [
        (True,) * 3,
        (False, True, False),
    ]
    div = N.divergence_rows([[1, 2, 3]], {"a": [[1, 9, 3]], "b": None}, margins=[[5.0, 0.01, 2.0]])
    assert div == [
        {
            "side": "a",
            "request": 0,
            "identical": False,
            "first difference at": 1,
            "fp32 margin there": 0.01,
        }
    ]
    assert (
        N.hit_rate({"prefix_cache": {"queries": 70, "hits": 32}}) == pytest.approx(32 / 70)
        and N.hit_rate({}) == 0.0
    )


def test_both_free_orders_replay_the_same_trace():
    from kvlab.lessons.traces import realistic_trace

    trace = realistic_trace(40, seed=0)
    tight = {"tight": 4 * max(-(-(len(r.prompt) + len(r.output)) // 32) for r in trace)}
    vllm_order = N.bench_block_pools(trace, tight, 32, reps=1, vllm=False)["tight"]["kvlab"]
    lru = N.bench_block_pools(trace, tight, 32, reps=1, vllm=False, free_order="lru")["tight"][
        "kvlab"
    ]
    assert vllm_order["query_tokens"] == lru["query_tokens"] and vllm_order["evictions"] > 0
    assert vllm_order["blocks_per_s"] > 0 and vllm_order["table_blocks"] == lru["table_blocks"]
