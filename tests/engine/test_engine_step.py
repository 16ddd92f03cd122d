"""One straight step (issue 37): EngineConfig, the public positions and step-observer hooks, prompt
chunks."""

import dataclasses

import pytest
from passphrase_prompts import question_prompts

from kvlab.engine import Engine, EngineConfig, SamplingParams
from kvlab.engine.engine import StepRecord, default_positions
from kvlab.engine.models import encode
from kvlab.engine.reference import hf_generate
from kvlab.engine.scheduler import ScheduledSeq, SchedulerOutput

A, B = question_prompts()[:2]


def _run(engine):
    """Step until idle; the outputs by request id."""
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


def test_config_keywords_and_overrides(lm):
    model, tok = lm
    engine = Engine(model, tok, num_blocks=24, block_size=8, debug=True)
    assert engine.config == EngineConfig(num_blocks=24, block_size=8, debug=True)
    assert engine.block_manager.num_blocks == 24 and engine.block_manager.block_size == 8
    base = EngineConfig(num_blocks=32, max_num_seqs=4)
    engine = Engine(model, tok, base, block_size=8)
    assert (
        engine.config == dataclasses.replace(base, block_size=8)
        and engine.scheduler.max_num_seqs == 4
    )
    assert Engine(model, tok, cache="radix").config.cache == "radix"
    assert (
        Engine(model, tok, enable_chunked_prefill=False).scheduler.enable_chunked_prefill is False
    )
    with pytest.raises(TypeError, match="'num_block'"):
        Engine(model, tok, num_block=8)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(model, tok, 64)
    with pytest.raises(TypeError, match="'bogus'"):
        base.replace(bogus=1)
    for bad in (
        dict(num_blocks=0),
        dict(block_size=1.5),
        dict(max_num_seqs=8, max_num_batched_tokens=4),
        dict(host_tier_bytes=-1),
        dict(cache="lru"),
        dict(isolation="salted"),
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(TypeError, match="debug"):
        EngineConfig(debug=1)
    assert "secret" not in repr(EngineConfig(secret="s" * 16))


def test_positions_hook_and_step_observer(lm):
    model, tok = lm
    prompts = [encode(tok, A), encode(tok, B)]
    sp = SamplingParams(max_tokens=4)
    seen = []

    def positions(item):
        seen.append((item.start, item.end))
        return default_positions(item)

    records: list[StepRecord] = []
    engine = Engine(
        model, tok, num_blocks=64, block_size=8, positions=positions, observers=[records.append]
    )
    outs = engine.generate(prompts, sp)
    assert [o.output_ids for o in outs] == [
        hf_generate(model, tok, p, max_new_tokens=4) for p in prompts
    ]
    assert len(records) == engine.num_steps and [r.step for r in records] == list(
        range(engine.num_steps)
    )
    first = records[0]
    assert [(s, e, pre) for _, s, e, pre in first.items] == [
        (0, len(prompts[0]), True),
        (0, len(prompts[1]), True),
    ]
    assert first.positions == (range(0, len(prompts[0])), range(0, len(prompts[1])))
    assert [len(t) for t in first.tables] == [-(-len(p) // 8) for p in prompts]
    assert seen[:2] == [(0, len(prompts[0])), (0, len(prompts[1]))]
    # every sampled token is one the request output holds, in order
    for out in outs:
        got = [
            tok_
            for r in records
            for (rid, *_), tok_ in zip(r.items, r.tokens)
            if rid == out.request_id
        ]
        assert got == out.output_ids


def test_a_prompt_chunk_samples_no_token(lm):
    """A hand-built prompt chunk (end < the sequence's length) beside a decode: no token, no LM-head
    row."""
    model, tok = lm
    a, b = encode(tok, A), encode(tok, B)
    sp = SamplingParams(max_tokens=5)
    engine = Engine(model, tok, num_blocks=64, block_size=8, enable_prefix_caching=False)
    records: list[StepRecord] = []
    engine.add_step_observer(records.append)
    real, queued = engine.scheduler.schedule, []

    def schedule():  # B's prefill in two chunks: [0, mid) beside A's decode, then [mid, n) alone
        if queued:
            return queued.pop(0)
        out = real()
        whole = [it for it in out.items if it.is_prefill and it.seq.request_id == "b"]
        if whole:
            (it,) = whole
            mid = (it.start + it.end) // 2
            rest = [x for x in out.items if x is not it]
            queued.append(SchedulerOutput([ScheduledSeq(it.seq, mid, it.end, True, it.samples)]))
            return SchedulerOutput(
                rest + [ScheduledSeq(it.seq, it.start, mid, True, False)], out.cow_pairs
            )
        return out

    engine.scheduler.schedule = schedule
    engine.add_request(a, sp, request_id="a")
    outs = engine.step()
    engine.add_request(b, sp, request_id="b")
    outs = {o.request_id: o for o in outs} | _run(engine)
    assert outs["a"].output_ids == hf_generate(model, tok, a, max_new_tokens=5)
    assert outs["b"].output_ids == hf_generate(model, tok, b, max_new_tokens=5)
    chunk_step = records[1]
    assert [(rid, pre) for rid, _, _, pre in chunk_step.items] == [("a", False), ("b", True)]
    assert (
        chunk_step.tokens[0] is not None and chunk_step.tokens[1] is None
    )  # the chunk got no token
    assert (
        records[2].items[0][1:3] == (len(b) // 2, len(b))
        and records[2].tokens[0] == outs["b"].output_ids[0]
    )


@pytest.mark.parametrize(
    "hook", [lambda it: range(0), lambda it: "x", lambda it: range(-1, it.end - it.start - 1)]
)
def test_a_wrong_positions_hook_fails_each_request_by_name(hook):
    from kvlab.engine.models import load_model

    model, tok = load_model()
    engine = Engine(model, tok, positions=hook, num_blocks=64)
    outs = engine.generate(["hello there", [1, 2, 3, 4, 5]], SamplingParams(max_tokens=3))
    assert all(o.finish_reason == "error" and "positions hook" in o.error for o in outs)
    assert engine.stats()["num_running"] == 0 and engine.kv_bytes_in_use == 0
