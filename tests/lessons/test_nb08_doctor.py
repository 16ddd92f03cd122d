"""Notebook 08's engine timing (kvlab.built.nb08.engine_ttft): the engine's own hit rate equals the
doctor's replay of the same prompts, and the timing comes from notebook 01's harness (one entry per
round)."""

import random


def test_engine_hit_rate_equals_the_doctors_replay(bundled):
    from kvlab.built.nb08 import engine_ttft

    model, tok = bundled
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]  # 2 full blocks and 8 tokens in common
    prompts = {
        "as logged": [[rng.randrange(3, 500) for _ in range(50)] for _ in range(3)],
        "with the top fix": [shared + [rng.randrange(3, 500) for _ in range(10)] for _ in range(3)],
    }
    table, timings = engine_ttft(model, tok, prompts, block_size=16, repeats=2)
    assert (table["engine hit rate"] == table["doctor's replay"]).all()
    assert table.loc["as logged", "engine cached tokens"] == 0
    # the 2nd and 3rd request: 2 blocks each
    assert table.loc["with the top fix", "engine cached tokens"] == 2 * 32
    assert all(len(t.seconds) == 2 for t in timings.values())
    assert (
        table.loc["with the top fix", "min (s)"]
        <= table.loc["with the top fix", "all requests (s)"]
    )
