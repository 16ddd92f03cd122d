"""Token-id request traces (``kvlab.lessons.traces``), the replay loop, notebook 04's figures and
checkers.

The named experiments (``kvlab.lessons.workloads``: seed groups, sys512) are tested in
test_table36.py.
"""

from collections import Counter

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from kvlab.cache.block_manager import BlockManager  # noqa: E402
from kvlab.lessons import nb04_blocks as L  # noqa: E402
from kvlab.lessons import traces  # noqa: E402


def test_replay_frees_everything_and_counts_every_token():
    trace = traces.realistic_trace(30, seed=1)
    m = BlockManager(300, 16)
    r = traces.replay(m, trace, max_running=4)
    m.check_invariants()
    assert m.num_free_blocks == 300 and not m.seqs
    assert r["requests"] == len(trace) and r["query_tokens"] == sum(len(q.prompt) for q in trace)
    assert (
        r["hit_tokens"] + sum(r[f"miss_{k}"] for k in ("short", "no_prefix", "evicted"))
        == r["query_tokens"]
    )
    assert all(r["cached_tokens"][q.req_id] <= len(q.prompt) - 1 for q in trace)


def test_replay_refuses_a_request_larger_than_the_pool():
    with pytest.raises(ValueError, match="more blocks than the pool"):
        traces.replay(BlockManager(2, 4), traces.shared_prefix_trace(1, prefix_lens=(40,)))


def test_later_turns_hit_the_previous_turn_when_history_is_append_only():
    full = traces.replay(BlockManager(4096, 16), traces.multiturn_trace(6, history="full"))
    window = traces.replay(BlockManager(4096, 16), traces.multiturn_trace(6, history="window"))
    assert full["hit_rate"] > window["hit_rate"]
    assert window["miss_no_prefix"] > full["miss_no_prefix"]


def test_timestamp_at_the_start_kills_every_hit():
    start = traces.replay(BlockManager(4096, 16), traces.timestamp_trace(10, where="start"))
    end = traces.replay(BlockManager(4096, 16), traces.timestamp_trace(10, where="end"))
    assert start["hit_tokens"] == 0 < end["hit_tokens"]


def test_toy_tokenize_splits_cjk_characters_and_words():
    assert len(traces.toy_tokenize("今天天气很好。")) == 7
    assert len(traces.toy_tokenize("The weather is nice today.")) == 6
    assert traces.toy_tokenize("abc") == traces.toy_tokenize("abc")


def test_figures_render():
    m = BlockManager(12, 4)
    m.allocate("a", list(range(10)))
    m.allocate("b", list(range(9)))
    assert L.fig_block_tables(m, "a title").axes


def test_exercise_checkers_accept_right_and_reject_wrong_answers():
    def find_leaks(m):
        refs = Counter(b for s in m.seqs.values() for b in s.block_table)
        return {b.block_id for b in m.pool.blocks if b.ref_count > refs[b.block_id]}

    assert L.check_cached_tokens(lambda n, bs: (n - 1) // bs * bs)
    assert not L.check_cached_tokens(lambda n, bs: n // bs * bs)
    assert L.check_find_leaks(find_leaks)
    assert not L.check_find_leaks(lambda m: set())
    assert L.check_timestamp_prompt(lambda s, t, q: s + t + q)
    assert not L.check_timestamp_prompt(lambda s, t, q: t + s + q)
