"""Chunked prefill in the scheduler (pure Python): a token budget per step mixing decodes and prompt
chunks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache.block_manager import BlockManager, TenantScope
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Request, RequestStatus


def _seq(i, tokens, max_tokens=3, scope=None):
    kw = {} if scope is None else {"scope": scope}
    return Request(i, f"r{i}", list(tokens), SamplingParams(max_tokens=max_tokens), **kw)


class Shadow:
    """What the paged store would hold: each slot's K/V stands for the tokens up to and including
    its position.

    Every step writes its items' positions first, then every item reads all positions before its end
    (a step writes before it reads, as the paged attention does); a read of a slot holding anything
    else (never written, or written for another prefix) is K/V the model would read wrongly.
    """

    def __init__(self, bm):
        self.bm, self.slots = bm, {}

    def step(self, out):
        bs = self.bm.block_size
        tables = {it.seq.seq_id: self.bm.block_table(it.seq.seq_id) for it in out.items}
        for it in out.items:
            toks = it.seq.token_ids
            for p in range(it.start, it.end):
                self.slots[(tables[it.seq.seq_id][p // bs], p % bs)] = hash(tuple(toks[: p + 1]))
        for it in out.items:
            toks = it.seq.token_ids
            for p in range(it.end):
                got = self.slots.get((tables[it.seq.seq_id][p // bs], p % bs))
                assert got == hash(tuple(toks[: p + 1])), (it.seq.seq_id, p, it.start, it.end)


def _step(sched, shadow=None, token=7):
    """Schedule; every item that ends its sequence's tokens samples ``token`` (a chunk samples
    nothing)."""
    out = sched.schedule()
    assert sum(it.end - it.start for it in out.items) <= sched.max_num_batched_tokens
    if shadow is not None:
        shadow.step(out)
    for it in out.items:
        if not it.samples:  # a chunk: no token
            assert it.is_prefill
            continue
        it.seq.output_ids.append(token)
        if len(it.seq.output_ids) >= it.seq.sampling.max_tokens:
            sched.finish(it.seq, "length")
    sched.check_invariants()
    return out


def test_a_long_prompt_runs_in_chunks_beside_decodes():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=True)
    a = _seq(0, range(5), max_tokens=10)
    sched.add(a)
    _step(sched)
    long = _seq(1, range(100, 130), max_tokens=2)
    sched.add(long)
    spans = []
    while not long.output_ids:
        out = _step(sched)
        assert [it.seq for it in out.items][:1] == [a]  # the running stream decodes every step
        spans += [(it.start, it.end) for it in out.items if it.seq is long]
    assert spans == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 30)]  # 7 = budget 8 - a's decode
    out = _step(sched)
    assert [(it.seq, it.end - it.start, it.is_prefill) for it in out.items] == [
        (a, 1, False),
        (long, 1, False),
    ]
    assert [(it.start, it.end) for it in out.items if it.seq is long] == [(30, 31)]


def test_chunk_boundaries_and_no_token_until_the_last_chunk():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, enable_chunked_prefill=True)
    s = _seq(0, range(17), max_tokens=2)
    sched.add(s)
    spans = []
    for _ in range(3):
        assert s.output_ids == []  # no token before its last chunk
        out = _step(sched)
        spans += [(it.start, it.end, it.is_prefill) for it in out.items]
    assert s.output_ids == [7]
    out = _step(sched)
    assert spans == [(0, 6, True), (6, 12, True), (12, 17, True)]
    assert [(it.start, it.end, it.is_prefill) for it in out.items] == [(17, 18, False)]
    assert s.output_ids == [7, 7] and s.status is RequestStatus.FINISHED


def test_off_runs_a_long_prompt_alone():
    sched = Scheduler(
        BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=6, enable_chunked_prefill=False
    )
    sched.add(_seq(0, range(17)))
    assert [(it.start, it.end) for it in sched.schedule().items] == [(0, 17)]


def test_a_request_sharing_a_chunked_prefix_hits_it_once_computed():
    """A prompt's full blocks are cached at allocation, before a later chunk writes them: nobody may
    read them early."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=True)
    shadow = Shadow(bm)  # fails on any read of K/V not written for the reader's own prefix
    a, b = _seq(0, range(24), max_tokens=2), _seq(1, list(range(20)) + [99, 98], max_tokens=2)
    sched.add(a)
    sched.add(b)
    # a's chunks take the whole budget: b is admitted only after the last one
    for start in (0, 8, 16):
        out = _step(sched, shadow)
        assert [(it.seq, it.start, it.end) for it in out.items] == [(a, start, start + 8)]
    out = _step(sched, shadow)
    assert [(it.seq, it.start, it.end) for it in out.items] == [(a, 24, 25), (b, 20, 22)]
    assert b.num_cached_tokens == 20  # every shared full block hit


def test_preempting_a_half_prefilled_request_uncaches_what_it_never_computed():
    bm = BlockManager(7, 4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=3, enable_chunked_prefill=True)
    shadow = Shadow(bm)
    a = _seq(0, range(4), max_tokens=12)  # grows by a block every 4 tokens
    sched.add(a)
    _step(sched, shadow)
    # 5 blocks, prefilled 2 tokens a step beside a's decode
    b = _seq(1, range(50, 70), max_tokens=2)
    sched.add(b)
    preempted = None
    for _ in range(12):
        computed = b.num_computed_tokens if b.status is RequestStatus.RUNNING else None
        out = _step(sched, shadow)
        if b in out.preempted:
            preempted = computed
            break
    assert preempted is not None and 0 < preempted < 20  # preempted half-way through its prompt
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.output_ids == []
    assert b.seq_id not in bm.seqs
    # none of its uncomputed full blocks can be hit: a request with the same prompt gets at most
    # what was computed
    probe = bm.can_allocate(b.token_ids)
    assert len(probe.hits) * bm.block_size <= preempted
    while sched.has_unfinished():
        _step(sched, shadow)
    assert a.output_ids == [7] * 12 and b.output_ids == [7, 7]
    assert bm.num_free_blocks == 7 and not bm.seqs


def test_aborting_a_half_prefilled_request_uncaches_what_it_never_computed():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, enable_chunked_prefill=True)
    a = _seq(0, range(20))
    sched.add(a)
    _step(sched)
    assert a.num_computed_tokens == 6
    sched.finish(a, "abort")
    assert len(bm.can_allocate(list(range(20))).hits) * 4 <= 6


def test_fork_refuses_a_request_being_prefilled_again():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4, enable_chunked_prefill=True)
    a = _seq(0, range(10))
    a.output_ids = [5]  # as after a preemption: prefilled again with its generated token
    sched.add(a)
    _step(sched)
    assert sched.is_prefilling(a)
    try:
        sched.fork(a, _seq(1, range(10)))
    except ValueError:
        pass
    else:
        raise AssertionError("fork of a half-prefilled request was accepted")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_workloads_with_chunks(data):
    """Random prompts over shared prefixes, small budgets and pools: every step within the budget,
    invariants hold, no item reads K/V that was not written for its own prefix, all finish, nothing
    leaks."""
    bs = data.draw(st.sampled_from([2, 4]))
    num_blocks = data.draw(st.integers(8, 24))
    bm = BlockManager(num_blocks, bs)
    budget = data.draw(st.integers(4, 16))
    sched = Scheduler(bm, max_num_seqs=data.draw(st.integers(1, 4)), max_num_batched_tokens=budget,
                      enable_chunked_prefill=True)
    shadow = Shadow(bm)
    seqs = []
    for i in range(data.draw(st.integers(1, 8))):
        n = data.draw(st.integers(1, 20))
        max_tokens = data.draw(st.integers(1, 5))
        family = data.draw(st.sampled_from([0, 1]))
        salt = data.draw(st.sampled_from([None, None, "s"]))
        tokens = [family] * min(n, 9) + [100 + i] * max(0, n - 9)
        try:
            sched.check_fits(n, max_tokens)
        except ValueError:
            continue
        seq = Request(
            i, i, tokens, SamplingParams(max_tokens=max_tokens), TenantScope(salt, 0, salt)
        )
        sched.add(seq)
        seqs.append(seq)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        _step(sched, shadow, token=data.draw(st.integers(0, 3)))
    assert not sched.has_unfinished()
    assert all(len(s.output_ids) == s.sampling.max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks and not bm.seqs


# --- the engine: chunked prefill keeps float32 token identity with HF generate --------------------

def _chunk_counter(engine):
    """Count the items that were prompt chunks (no token) and check each got none."""
    seen = {"chunks": 0}

    def observe(record):
        for (_, _, _, is_prefill), token in zip(record.items, record.tokens):
            # a failed item would end the test with an error
            seen["chunks"] += token is None and is_prefill

    engine.add_step_observer(observe)
    return seen


def test_engine_chunks_are_token_identical_to_hf_generate(lm, workload):
    """The bundled model, 40 passphrase prompts, a budget of 48 tokens a step: most prompts run in
    chunks."""
    from conftest import ENGINE_MAX_NEW

    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    ids, ref = workload
    ids, ref = ids[:40], ref[:40]
    engine = Engine(
        model,
        tok,
        num_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        debug=True,
    )
    assert engine.scheduler.enable_chunked_prefill  # the default
    seen = _chunk_counter(engine)
    outs = engine.generate(ids, SamplingParams(max_tokens=ENGINE_MAX_NEW))
    assert [o.output_ids for o in outs] == ref
    assert seen["chunks"] > 0
    assert (
        not engine.block_manager.seqs
        and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    )


def test_engine_chunks_under_preemption_are_token_identical(lm, workload):
    """A small pool: half-prefilled requests are preempted, prefilled again in chunks, and still
    match HF."""
    from conftest import ENGINE_MAX_NEW

    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    ids, ref = workload
    ids, ref = ids[:24], ref[:24]
    engine = Engine(
        model,
        tok,
        num_blocks=24,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=40,
        debug=True,
    )
    outs = engine.generate(ids, SamplingParams(max_tokens=ENGINE_MAX_NEW))
    assert engine.num_preemptions > 0
    assert [o.output_ids for o in outs] == ref


def _must_run():
    from test_architectures import MUST_RUN

    return MUST_RUN


@pytest.mark.parametrize("model_type", _must_run())
@torch.no_grad()
def test_architectures_in_chunks_are_token_identical_to_hf(model_type):
    """Every architecture that must run, with a budget of 5 tokens a step: chunks cut blocks of 4
    anywhere."""
    from test_architectures import NEW, _prompts, tiny_model

    from kvlab.engine import Engine, SamplingParams

    model = tiny_model(model_type)
    engine = Engine(
        model,
        None,
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=5,
        debug=True,
    )
    seen = _chunk_counter(engine)
    prompts = _prompts()
    want = [
        model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            generation_config=model.generation_config,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    sp = SamplingParams(max_tokens=NEW)
    outs = engine.generate(prompts[:1], sp) + engine.generate(prompts[1:], sp)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.output_ids for o in outs] == want, (
        f"{model_type}: chunked prefill is not token-identical to HF"
    )
    assert seen["chunks"] > 0


def test_a_chunk_never_samples_seeded_sampling_matches_hf(lm):
    """A chunk draws nothing from the request's generator: seeded sampling in chunks reproduces
    HF's."""
    from passphrase_prompts import question_prompts

    from kvlab.engine import Engine, SamplingParams
    from kvlab.engine.reference import hf_generate

    model, tok = lm
    prompts = question_prompts(2, 1, seed=3)
    sps = [
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, top_k=40, seed=7 + i)
        for i in range(len(prompts))
    ]
    engine = Engine(
        model, tok, num_blocks=128, block_size=16, max_num_seqs=2, max_num_batched_tokens=16
    )
    seen = _chunk_counter(engine)
    outs = engine.generate(prompts, sps)
    assert seen["chunks"] > 0
    for p, sp, out in zip(prompts, sps, outs):
        assert out.output_ids == hf_generate(
            model,
            tok,
            p,
            max_new_tokens=6,
            do_sample=True,
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=sp.seed,
        )
