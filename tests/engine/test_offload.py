"""The engine's host tier (``kvlab.engine.offload``): restored K/V gives the tokens of a recompute,
never across salts."""

import random

import pytest


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def test_restored_blocks_give_the_tokens_of_a_recompute(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(4, 100)
    ref = Engine(model, tok, num_blocks=64, enable_prefix_caching=False).generate(prompts, sp)
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=10 ** 7, debug=True)
    outs = [eng.generate([p], sp)[0] for p in prompts]  # each evicts the one before
    again = eng.generate(prompts[:2], sp)
    assert [o.output_ids for o in outs + again] == [r.output_ids for r in ref + ref[:2]]
    assert again[0].num_restored_tokens == 96 and again[0].num_cached_tokens == 96
    st = eng.stats()
    assert (
        st["tier_loaded_blocks"] > 0
        and st["bytes_from_host"] == st["tier_loaded_blocks"] * eng.store.bytes_per_block
    )
    assert st["tier_bytes"] <= st["tier_capacity_bytes"]


def test_an_unreadable_tier_entry_falls_back_to_recompute_on_the_engine(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts(3, 100, seed=5)
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=10 ** 7, debug=True)
    first = [eng.generate([p], sp)[0] for p in prompts][0]
    assert len(eng.host_tier.tier) > 0
    for e in eng.host_tier.tier.entries.values():  # every payload damaged: one layer missing
        e.payload = (e.payload[0][:1], e.payload[1])
    again = eng.generate([prompts[0]], sp)[0]
    assert again.num_restored_tokens == 0 and again.output_ids == first.output_ids
    assert eng.stats()["tier_load_failures"] == 1


def test_engine_tier_stays_within_its_bytes(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=1)  # smaller than one block
    cap = 3 * eng.store.bytes_per_block
    eng = Engine(model, tok, num_blocks=16, host_tier_bytes=cap + 7)
    eng.generate(_prompts(6, 70, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))
    tier = eng.host_tier.tier
    tier.check_invariants()
    assert tier.nbytes <= cap + 7 and len(tier) == 3 and tier.num_evictions > 0


def test_a_salted_block_in_the_tier_is_never_served_to_another_tenant(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = _prompts(1, 80, seed=2)[0]
    ref = (
        Engine(model, tok, num_blocks=64, enable_prefix_caching=False)
        .generate([prompt], sp)[0]
        .output_ids
    )
    eng = Engine(
        model, tok, num_blocks=12, host_tier_bytes=10**7, isolation="tenant", secret="s" * 16
    )
    eng.generate([prompt], sp, tenants=["alice"])
    # evicts alice's blocks into the tier
    eng.generate(_prompts(1, 180, seed=3), sp, tenants=["carol"])
    assert eng.stats()["tier_saved_blocks"] >= 4
    bob = eng.generate([prompt], sp, tenants=["bob"])[0]
    alice = eng.generate([prompt], sp, tenants=["alice"])[0]
    assert bob.num_restored_tokens == 0 and bob.num_cached_tokens == 0
    assert alice.num_restored_tokens > 0
    assert bob.output_ids == alice.output_ids == ref
    assert eng.block_manager.metrics.cross_tenant_hits == 0


def test_reset_prefix_cache_clears_the_tier(lm):
    from kvlab.engine import Engine, SamplingParams

    model, tok = lm
    eng = Engine(model, tok, num_blocks=12, host_tier_bytes=10 ** 7)
    eng.generate(_prompts(3, 90, seed=4), SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(eng.host_tier.tier) > 0
    assert eng.reset_prefix_cache() and len(eng.host_tier.tier) == 0


def test_the_radix_cache_refuses_a_host_tier(lm):
    from kvlab.engine import Engine

    model, tok = lm
    with pytest.raises(ValueError, match="cache='blocks'"):
        Engine(model, tok, num_blocks=12, cache="radix", host_tier_bytes=10 ** 6)
