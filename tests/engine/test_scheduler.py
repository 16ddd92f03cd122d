"""Scheduler (pure Python): continuous batching, token budget, preemption youngest-first,
refusal."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache.block_manager import BlockManager
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Request, RequestStatus


def _seq(i, n, max_tokens=4, first=0):
    return Request(i, f"r{i}", list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def _run_step(sched, token=7):
    """A stand-in for the model: every scheduled sequence gets ``token``; finish at max_tokens."""
    out = sched.schedule()
    for it in out.items:
        # the scheduler's flag: it samples exactly when it computes up to the sequence's end
        assert it.samples == (it.end == it.seq.num_tokens)
        if not it.samples:  # a chunk of a prompt: no token yet
            continue
        it.seq.output_ids.append(token)
        if len(it.seq.output_ids) >= it.seq.sampling.max_tokens:
            sched.finish(it.seq, "length")
    sched.block_manager.check_invariants()
    return out


def test_importing_scheduler_and_sequence_loads_no_torch():
    """Issue 25: run in a fresh interpreter, the import (kvlab/__init__, kvlab.cache,
    sampling_params) loads no torch."""
    import os
    import subprocess
    import sys

    # (a copy of the package under another name rewrites this line)
    import kvlab.engine.scheduler as sched

    root = str(Path(sched.__file__).resolve().parents[2])
    code = (
        "import sys, kvlab.engine.scheduler, kvlab.engine.sequence; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=root
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_scheduler_and_sequence_do_not_import_torch():
    """The scheduling logic is pure Python (only the sampler and the model runner touch torch)."""
    import ast

    import kvlab.engine

    for name in ("scheduler.py", "sequence.py"):
        tree = ast.parse((Path(kvlab.engine.__file__).parent / name).read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m.split(".")[0] == "torch" for m in mods), (name, mods)


def test_prefill_and_decode_share_a_step():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seq(0, 6), _seq(1, 5, first=100)
    sched.add(a)
    out = _run_step(sched)
    assert [(it.seq, it.start, it.end, it.is_prefill) for it in out.items] == [(a, 0, 6, True)]
    sched.add(b)
    out = _run_step(sched)
    assert [(it.seq, it.start, it.end, it.is_prefill) for it in out.items] == [
        (a, 6, 7, False),
        (b, 0, 5, True),
    ]
    # the fed token is in the blocks
    assert sched.block_manager.seqs[0].token_ids == a.token_ids[:-1]


def test_token_budget_and_max_num_seqs():
    """Whole prompts (chunked prefill off); tests/engine/test_chunked_prefill.py has the chunked
    budget."""
    sched = Scheduler(
        BlockManager(64, 4), max_num_seqs=3, max_num_batched_tokens=25, enable_chunked_prefill=False
    )
    for i in range(5):
        sched.add(_seq(i, 10, first=20 * i))
    out = sched.schedule()
    assert [it.seq.seq_id for it in out.items] == [0, 1]  # a third 10-token prefill would exceed 25
    out = sched.schedule()
    assert [(it.seq.seq_id, it.is_prefill) for it in out.items] == [
        (0, False),
        (1, False),
        (2, True),
    ]
    assert len(sched.running) == 3  # max_num_seqs
    long = Scheduler(
        BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    long.add(_seq(9, 30))
    assert [it.end for it in long.schedule().items] == [30]  # longer than the budget: runs alone
    with pytest.raises(ValueError):
        Scheduler(BlockManager(8, 4), max_num_seqs=8, max_num_batched_tokens=4)


def test_prefix_hit_starts_prefill_after_cached_blocks():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_seq(0, 10))
    _run_step(sched)
    sched.add(_seq(1, 11))  # same first 10 tokens
    out = sched.schedule()
    prefill = [it for it in out.items if it.is_prefill][0]
    assert (prefill.start, prefill.end) == (8, 11) and prefill.seq.num_cached_tokens == 8


def test_preempts_youngest_and_recomputes():
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seq(0, 8, max_tokens=6), _seq(1, 8, max_tokens=6, first=50)
    sched.add(a)
    sched.add(b)
    _run_step(sched)  # both prefilled: 4 blocks used, 1 free
    out = _run_step(sched)  # both need a new block for their 9th token: one is free
    assert out.preempted == [b] and b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert [it.seq for it in out.items] == [a] and sched.waiting[0] is b and b.seq_id not in bm.seqs
    assert sched.num_preemptions == 1
    steps, recomputed = 0, []
    while sched.has_unfinished():
        n_b = b.num_tokens
        out = _run_step(sched)
        recomputed += [(it.start, it.end, n_b) for it in out.items if it.seq is b and it.is_prefill]
        steps += 1
        assert steps < 50
    # b came back as a prefill of its prompt + generated tokens; its first full block was still
    # cached
    assert recomputed == [(4, 9, 9)]
    assert a.finish_reason == b.finish_reason == "length"
    assert len(a.output_ids) == len(b.output_ids) == 6
    assert bm.num_free_blocks == 5 and not bm.seqs


def test_no_admission_in_a_step_that_preempted():
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_seq(0, 8, max_tokens=9))
    sched.add(_seq(1, 8, max_tokens=9, first=50))
    _run_step(sched)
    sched.add(_seq(2, 1, first=90))  # would fit after the preemption, but must wait
    out = _run_step(sched)
    assert out.preempted and all(not it.is_prefill for it in out.items)


def test_refuses_a_request_that_can_never_fit():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=16)
    sched.check_fits(10, 7)  # 16 tokens written = 4 blocks: fits alone
    with pytest.raises(ValueError, match="can never run"):
        sched.check_fits(10, 8)


def test_fork_shares_blocks_then_copy_on_write():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = _seq(0, 6, max_tokens=5)
    sched.add(a)
    _run_step(sched)
    child = Request(1, "r0-child", list(a.prompt_ids), a.sampling, output_ids=list(a.output_ids))
    sched.fork(a, child)
    assert bm.block_table(1) == bm.block_table(0)
    out = _run_step(sched)
    assert len(out.cow_pairs) == 1  # the shared partial tail block was copied for the first writer
    src, dst = out.cow_pairs[0]
    assert bm.block_table(0)[-1] == dst and bm.block_table(1)[-1] == src
    with pytest.raises(ValueError):
        sched.fork(_seq(5, 3), _seq(6, 3))  # not running


def test_finish_waiting_and_running():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = _seq(0, 5), _seq(1, 5, first=10)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, "abort")  # still waiting (max_num_seqs=1)
    sched.finish(a, "abort")
    assert not sched.has_unfinished() and not bm.seqs and b.status is RequestStatus.FINISHED


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_random_workloads_drain_cleanly(data):
    """Random prompts, lengths and pool sizes: invariants every step, all finish, nothing leaks."""
    bs = data.draw(st.sampled_from([2, 4]))
    num_blocks = data.draw(st.integers(6, 20))
    bm = BlockManager(num_blocks, bs)
    sched = Scheduler(bm, max_num_seqs=data.draw(st.integers(1, 6)), max_num_batched_tokens=32)
    seqs = []
    for i in range(data.draw(st.integers(1, 10))):
        n = data.draw(st.integers(1, 12))
        max_tokens = data.draw(st.integers(1, 6))
        prefix = data.draw(st.sampled_from([0, 1]))  # two families of shared prefixes
        seq = Request(
            i, i, [prefix] * min(n, 4) + [i] * max(0, n - 4), SamplingParams(max_tokens=max_tokens)
        )
        try:
            sched.check_fits(n, max_tokens)
        except ValueError:
            continue
        sched.add(seq)
        seqs.append(seq)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        _run_step(sched, token=data.draw(st.integers(0, 3)))
    assert not sched.has_unfinished()
    assert all(len(s.output_ids) == s.sampling.max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks and not bm.seqs


def test_scheduler_and_sequence_import_no_torch():
    """``kvlab.engine.scheduler`` and ``sequence`` are pure Python: importing them (and the package)
    loads no torch."""
    import subprocess
    import sys

    code = ("import sys, kvlab.engine.scheduler, kvlab.engine.sequence; "
            "from kvlab.engine import SamplingParams; SamplingParams(max_tokens=2); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_sampling_params_keeps_its_import_paths():
    """``SamplingParams`` is one class under its names: ``kvlab``, ``kvlab.engine``,
    ``kvlab.engine.sampling``."""
    import kvlab
    import kvlab.engine
    from kvlab.engine.sampling_params import SamplingParams as Pure

    assert kvlab.SamplingParams is kvlab.engine.SamplingParams is SamplingParams is Pure
