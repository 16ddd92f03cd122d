"""The paged engine on the radix cache (``Engine(..., cache="radix")``): the block cache's tests
again.

Greedy float32 outputs equal ``hf_generate`` token for token on the 200-prompt passphrase workload,
with caching on and off, at page 1 and page 16, and in a pool small enough to preempt; also on
random tiny models of four architectures, through fork (copy-on-write of a partial page), same-step
hits on a prompt admitted in the same step, and a failing forward. At page 1 a prefix that ends
inside a 16-token block is reused whole, not recomputed; the last prompt token is always computed.
"""

import random

import pytest
import torch
from passphrase_prompts import ASK_EN, ASK_ZH, example_prompts, question_prompts

from kvlab.cache.radix import RadixCache
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.reference import hf_generate

MAX_NEW = 10  # the length of the shared `workload` fixture's references (conftest.ENGINE_MAX_NEW)


def _drained(engine):
    bm = engine.block_manager
    engine.check_invariants()
    return not bm.seqs and bm.num_free_blocks == bm.num_blocks and engine.kv_bytes_in_use == 0


@pytest.mark.parametrize("page_size, caching, num_blocks, max_num_seqs", [
    (1, True, 1024, 48),  # plenty of room: many prefix hits, at token granularity
    (16, True, 1024, 48),  # SGLang's paged mode
    (1, False, 1024, 48),
    (1, True, 40, 32),  # 640 slots for up to 32 sequences: preemption and recompute
])
def test_greedy_identical_to_hf_generate(
    lm, workload, page_size, caching, num_blocks, max_num_seqs
):
    model, tok = lm
    ids, ref = workload
    engine = Engine(
        model,
        tok,
        num_blocks=num_blocks,
        block_size=16,
        enable_prefix_caching=caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
        debug=True,
        cache="radix",
        page_size=page_size,
    )
    assert isinstance(engine.block_manager, RadixCache) and engine.store.block_size == page_size
    # the same slots as the block cache
    assert engine.store.num_blocks * page_size == num_blocks * 16
    outs = engine.generate(ids, SamplingParams(max_tokens=MAX_NEW))
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.output_ids != r]
    assert not mismatches, (
        f"{len(mismatches)} of {len(ids)} differ from HF generate, e.g. #{mismatches[0]}"
    )
    stats = engine.stats()
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in outs)
    assert stats["num_mixed_steps"] > 0
    assert (
        (stats["hit_rate"] > (0.3 if num_blocks > 40 else 0))
        if caching
        else (stats["hit_tokens"] == 0)
    )
    assert (engine.num_preemptions > 0) == (num_blocks == 40)
    # one lookup per request; a preempted one's next lookups apart (vLLM)
    m = engine.block_manager.metrics
    assert m.total.requests == len(ids) and m.preempted.requests == engine.num_preemptions
    assert _drained(engine) and 0 < engine.peak_kv_bytes <= engine.store.nbytes
    if caching:
        # the last prompt token is computed
        assert all(o.num_cached_tokens < len(p) for o, p in zip(outs, ids))
        if page_size > 1:
            assert all(o.num_cached_tokens % page_size == 0 for o in outs)


def test_token_granularity_caches_more_than_blocks_with_the_same_outputs(lm, workload):
    model, tok = lm
    ids, ref = workload
    ids, ref = ids[:60], ref[:60]
    cached = {}
    for cache in ("blocks", "radix"):
        engine = Engine(model, tok, num_blocks=512, block_size=16, cache=cache, debug=True)
        outs = engine.generate(ids, SamplingParams(max_tokens=MAX_NEW))
        assert [o.output_ids for o in outs] == ref
        cached[cache] = sum(o.num_cached_tokens for o in outs)
    assert cached["radix"] > cached["blocks"]


# --- random tiny models ---------------------------------------------------------------------------
def _tiny(arch):
    import transformers as T

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg = {
        "qwen2": lambda: T.Qwen2Config(num_key_value_heads=2, **common),
        "llama": lambda: T.LlamaConfig(num_key_value_heads=1, **common),
        "qwen3": lambda: T.Qwen3Config(num_key_value_heads=2, head_dim=16, **common),
        "mistral": lambda: T.MistralConfig(num_key_value_heads=2, sliding_window=None, **common),
    }[arch]()
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _hf(model, prompt, n=MAX_NEW):
    with torch.no_grad():
        return model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_random_architectures_identical_to_hf(arch):
    model = _tiny(arch)
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [
        shared[: rng.choice([0, 17, 40])] + [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        for _ in range(24)
    ]
    ref = [_hf(model, p) for p in prompts]
    for page_size, caching in ((1, True), (4, True)):
        engine = Engine(
            model,
            None,
            num_blocks=14,
            block_size=8,
            enable_prefix_caching=caching,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            debug=True,
            cache="radix",
            page_size=page_size,
        )
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
        assert [o.output_ids for o in outs] == ref
        assert engine.num_preemptions > 0 and _drained(engine)


def test_a_partial_block_is_reused_not_recomputed():
    """37 shared tokens: page 1 reuses all 37 (16-token blocks: 32); a prompt equal to a cached one
    computes exactly its last token."""
    model = _tiny("qwen2")
    rng = random.Random(2)
    shared = [rng.randrange(256) for _ in range(37)]
    a, b = shared + [1, 2, 3, 4, 5], shared + [9, 9, 9]
    got = {}
    for cache in ("blocks", "radix"):
        engine = Engine(model, None, num_blocks=32, block_size=16, cache=cache, debug=True)
        first = engine.generate([a], SamplingParams(max_tokens=MAX_NEW))[0]
        second, again = engine.generate([b], SamplingParams(max_tokens=MAX_NEW))[0], \
            engine.generate([a], SamplingParams(max_tokens=MAX_NEW))[0]
        assert [first.output_ids, second.output_ids, again.output_ids] == [
            _hf(model, a),
            _hf(model, b),
            _hf(model, a),
        ]
        got[cache] = (second.num_cached_tokens, again.num_cached_tokens)
    assert got["radix"] == (37, len(a) - 1)
    assert got["blocks"] == (32, 32)


def test_fork_shares_pages_and_copies_a_partial_page():
    model = _tiny("llama")
    prompt = list(range(10, 31))  # 21 tokens
    ref = _hf(model, prompt)
    for page_size, copies_expected in ((4, 1), (1, 0)):
        engine = Engine(
            model, None, num_blocks=16, block_size=8, cache="radix", page_size=page_size, debug=True
        )
        rid = engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW))
        engine.step()
        engine.step()  # K/V of 22 tokens: page 4 leaves 2 in a partial page
        child = engine.fork(rid, "child")
        copies = []
        real_copy = engine.store.copy_blocks
        engine.store.copy_blocks = lambda pairs, real=real_copy, seen=copies: (
            seen.extend(pairs),
            real(pairs),
        )
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.output_ids for o in engine.step()})
        assert len(copies) == copies_expected == engine.block_manager.metrics.cow_copies
        assert outs[rid] == ref and outs[child] == ref
        assert _drained(engine)


def test_register_before_compute_a_same_step_hit_reads_what_was_written(lm):
    model, tok = lm
    prompts = example_prompts("heldout:3", (ASK_EN + ASK_ZH)[:3])
    engine = Engine(model, tok, num_blocks=64, block_size=16, cache="radix", debug=True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens > 0 for o in outs[1:])
    assert engine.num_steps <= MAX_NEW  # all three prefilled together in one step
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == hf_generate(model, tok, prompt, MAX_NEW)


def test_a_failing_forward_leaves_no_unwritten_kv_in_the_tree():
    """The failed request inserted the shared prefix at admission; another request hit it in the
    same step. Its pages leave the tree, the other request is computed again, and everyone gets
    their solo tokens."""
    model = _tiny("qwen2")
    rng = random.Random(3)
    shared = [rng.randrange(200) for _ in range(40)]
    bad = shared + [7, 8, 250, 9]
    good = [
        shared + [rng.randrange(200) for _ in range(5)],
        [rng.randrange(200) for _ in range(30)],
    ]
    sp = SamplingParams(max_tokens=8)
    want = [_hf(model, p, 8) for p in good]

    def hook(module, args):
        if (args[0] == 250).any():
            raise RuntimeError("poisoned input")

    handle = model.model.embed_tokens.register_forward_pre_hook(hook)
    try:
        engine = Engine(model, None, num_blocks=40, block_size=16, cache="radix", debug=True)
        r_bad = engine.add_request(bad, sp)
        rids = [engine.add_request(p, sp) for p in good]
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
        assert outs[r_bad].finish_reason == "error" and "poisoned" in outs[r_bad].error
        assert [outs[r].output_ids for r in rids] == want
        again = engine.generate([shared + [1, 2, 3]], sp)[0]
        assert again.output_ids == _hf(model, shared + [1, 2, 3], 8)
        assert _drained(engine)
    finally:
        handle.remove()


def test_salts_are_separate_trees_and_public_prefix_is_refused(lm):
    model, tok = lm
    prompt = question_prompts(1, 1)[0]
    engine = Engine(model, tok, num_blocks=64, block_size=16, cache="radix", debug=True)
    sp = SamplingParams(max_tokens=4)
    first = engine.generate([prompt], sp, unsafe_salts=["tenant-a"])[0]
    other, same = engine.generate([prompt, prompt], sp, unsafe_salts=["tenant-b", "tenant-a"])
    assert first.num_cached_tokens == other.num_cached_tokens == 0 < same.num_cached_tokens
    assert first.output_ids == other.output_ids == same.output_ids
    assert {"tenant-a", "tenant-b"} <= set(engine.block_manager.roots)
    with pytest.raises(ValueError, match="public"):
        Engine(model, tok, num_blocks=64, cache="radix", isolation="public-prefix")
    with pytest.raises(ValueError, match="cache must be"):
        Engine(model, tok, num_blocks=64, cache="trie")


def test_radix_cache_implements_the_cache_interface(lm):
    """The engine's radix cache is a ``CacheManager``: every member exists; it refuses
    ``reset_prefix_cache``."""
    from kvlab.cache import CacheManager, missing_members

    model, tok = lm
    engine = Engine(model, tok, num_blocks=8, block_size=16, cache="radix")
    rc = engine.block_manager
    assert isinstance(rc, RadixCache) and isinstance(rc, CacheManager) and missing_members(rc) == []
    assert rc.num_blocks == 128 and rc.take_events() == []
    with pytest.raises(NotImplementedError, match="cache='blocks'"):
        engine.reset_prefix_cache()
