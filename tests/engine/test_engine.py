"""The paged engine against transformers' ``generate``: token-identical under batching, caching,
preemption.

The passphrase workload is 200 prompts (40 system prompts x 5 questions, shuffled) submitted at
once; greedy float32 outputs must equal ``kvlab.engine.reference.hf_generate`` token for token with
prefix caching on and off and in a pool so small that sequences are preempted and recomputed. The
same holds on random-initialised tiny models of four architectures. ``debug=True`` runs
``check_invariants()`` after every step; after the last request, no block may be referenced.
"""

import random

import pytest
import torch
from passphrase_prompts import ASK_EN, ASK_ZH, example_prompts, question_prompts

from kvlab.engine import Engine, SamplingParams, UnknownRequestError
from kvlab.engine.models import encode
from kvlab.engine.reference import hf_generate

MAX_NEW = 10  # the length of the shared `workload` fixture's references (conftest.ENGINE_MAX_NEW)


def _drained(engine):
    bm = engine.block_manager
    return not bm.seqs and bm.num_free_blocks == bm.pool.num_blocks and engine.kv_bytes_in_use == 0


@pytest.mark.parametrize("caching, num_blocks, max_num_seqs", [
    (True, 1024, 48),  # plenty of room: many prefix hits
    (False, 1024, 48),
    (True, 40, 32),  # 640 slots for up to 32 sequences: preemption and recompute
    (False, 40, 32),
])
def test_greedy_identical_to_hf_generate(lm, workload, caching, num_blocks, max_num_seqs):
    model, tok = lm
    ids, ref = workload
    engine = Engine(model, tok, num_blocks=num_blocks, block_size=16, enable_prefix_caching=caching,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, debug=True)
    outs = engine.generate(ids, SamplingParams(max_tokens=MAX_NEW))
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.output_ids != r]
    assert not mismatches, (
        f"{len(mismatches)} of {len(ids)} differ from HF generate, e.g. #{mismatches[0]}"
    )
    stats = engine.stats()
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in outs)
    assert stats["num_mixed_steps"] > 0  # prefills and decodes really shared steps
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
    assert all(o.ttft is not None and o.latency >= o.ttft >= 0 for o in outs)
    if caching:
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_shared_prefix_uses_fewer_kv_bytes(lm):
    model, tok = lm
    prompts = example_prompts("heldout:3:filler20", ASK_EN + ASK_ZH)
    peaks, texts = {}, {}
    for caching in (True, False):
        engine = Engine(model, tok, num_blocks=256, block_size=16, enable_prefix_caching=caching)
        outs = engine.generate(prompts, SamplingParams(max_tokens=4))
        peaks[caching], texts[caching] = engine.peak_kv_bytes, [o.output_ids for o in outs]
        assert _drained(engine)
    assert texts[True] == texts[False]
    assert peaks[True] < peaks[False]


def test_salt_reaches_the_block_manager(lm):
    """Same prompt, other salt: no prefix hit; same salt: hit (notebook 07 builds tenants on
    this)."""
    model, tok = lm
    prompt = question_prompts(1, 1)[0]
    engine = Engine(model, tok, kv_cache_bytes=2 ** 20, block_size=16, debug=True)
    sp = SamplingParams(max_tokens=4)
    first = engine.generate([prompt], sp, unsafe_salts=["tenant-a"])[0]
    other, same = engine.generate([prompt, prompt], sp, unsafe_salts=["tenant-b", "tenant-a"])
    assert first.num_cached_tokens == other.num_cached_tokens == 0 < same.num_cached_tokens
    assert first.output_ids == other.output_ids == same.output_ids
    by_tenant = engine.block_manager.metrics.by_tenant
    assert by_tenant["tenant-b"].hits == 0 and by_tenant["tenant-a"].hits == same.num_cached_tokens
    assert engine.store.nbytes <= 2 ** 20


def test_seeded_sampling_matches_hf_and_ignores_batching(lm):
    model, tok = lm
    prompts = question_prompts(4, 2, seed=1)
    sps = [
        SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i)
        for i in range(len(prompts))
    ]
    engine = Engine(model, tok, num_blocks=256, block_size=16, debug=True)
    # with greedy ones
    batched = engine.generate(prompts + prompts[:3], sps + [SamplingParams(max_tokens=8)] * 3)
    for p, sp, out in zip(prompts, sps, batched):
        alone = Engine(model, tok, num_blocks=256, block_size=16).generate([p], sp)[0]
        assert out.output_ids == alone.output_ids
        assert out.output_ids == hf_generate(
            model,
            tok,
            p,
            max_new_tokens=8,
            do_sample=True,
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=sp.seed,
        )


def test_fork_copies_kv_on_write(lm):
    """A forked request shares its partial tail block; the first write copies the block's K/V."""
    model, tok = lm
    # after two steps the blocks hold the prompt + 1 token: pick a prompt that leaves the tail block
    # partial
    prompt = next(p for p in question_prompts(2, 2) if (len(encode(tok, p)) + 1) % 16)
    ref = hf_generate(model, tok, prompt, max_new_tokens=MAX_NEW)
    engine = Engine(model, tok, num_blocks=64, block_size=16, debug=True)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    engine.step()
    engine.step()
    kv_tokens = engine.block_manager.seqs[engine.requests[rid].seq_id].token_ids
    child = engine.fork(rid, "child")
    copies = []
    real_copy = engine.store.copy_blocks
    engine.store.copy_blocks = lambda pairs: (copies.extend(pairs), real_copy(pairs))
    engine.step()
    assert len(copies) == 1 and engine.block_manager.metrics.cow_copies == 1
    src, dst = copies[0]
    filled = len(kv_tokens) % 16
    assert torch.equal(engine.store.k[:, dst, :filled], engine.store.k[:, src, :filled])
    assert torch.equal(engine.store.v[:, dst, :filled], engine.store.v[:, src, :filled])
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.output_ids for o in engine.step()})
    n = len(ref)  # HF stops at end of turn; the forked pair ran on with ignore_eos
    assert outs[rid][:n] == ref and outs[child][:n] == ref
    assert _drained(engine)


def test_bad_requests_fail_alone(lm):
    model, tok = lm
    good = question_prompts(2, 2)
    engine = Engine(model, tok, num_blocks=32, block_size=16, debug=True)  # 512 slots
    too_long_for_model = [5] * model.config.max_position_embeddings
    outs = engine.generate(
        [good[0], "", too_long_for_model, good[1], [5] * 600, [10**9]] + good[2:],
        SamplingParams(max_tokens=MAX_NEW),
    )
    errors = [o.error for o in outs]
    assert [o.finish_reason == "error" for o in outs] == [
        False,
        True,
        True,
        False,
        True,
        True,
        False,
        False,
    ]
    assert (
        "empty" in errors[1]
        and "positions" in errors[2]
        and "never run" in errors[4]
        and "[0," in errors[5]
    )
    for p, o in zip(good, [outs[0], outs[3], outs[6], outs[7]]):
        assert o.output_ids == hf_generate(model, tok, p, max_new_tokens=MAX_NEW)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(TypeError):
        engine.add_request(good[0], {"temperature": 2.0})
    with pytest.raises(UnknownRequestError, match="nope"):
        engine.abort("nope")
    assert _drained(engine)


def test_abort_frees_blocks_and_others_finish(lm):
    model, tok = lm
    prompts = question_prompts(2, 2)
    engine = Engine(model, tok, num_blocks=128, block_size=16, debug=True)
    rids = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW)) for p in prompts]
    engine.step()
    # a bad request mid-run is refused; the others go on
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams(max_tokens=MAX_NEW))
    aborted = engine.abort(rids[1])
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) == 1
    with pytest.raises(UnknownRequestError):
        engine.abort(rids[1])
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    assert set(done) == {rids[0], rids[2], rids[3]}
    assert done[rids[2]].output_ids == hf_generate(model, tok, prompts[2], max_new_tokens=MAX_NEW)
    assert _drained(engine)


# --- random-initialised tiny models of several architectures --------------------------------------

def _tiny(arch):
    import transformers as T

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=256, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None, initializer_range=0.1)
    cfg = {
        "qwen2": lambda: T.Qwen2Config(num_key_value_heads=2, **common),
        "llama": lambda: T.LlamaConfig(num_key_value_heads=1, **common),
        "qwen3": lambda: T.Qwen3Config(num_key_value_heads=2, head_dim=32, **common),
        "mistral": lambda: T.MistralConfig(num_key_value_heads=2, sliding_window=24, **common),
    }[arch]()
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_random_architectures_identical_to_hf(arch):
    model = _tiny(arch)
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [
        shared[: rng.choice([0, 17, 40])] + [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        for _ in range(24)
    ]
    with torch.no_grad():
        ref = [
            model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    for caching in (True, False):
        engine = Engine(
            model,
            None,
            num_blocks=14,
            block_size=8,
            enable_prefix_caching=caching,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            debug=True,
        )
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
        assert [o.output_ids for o in outs] == ref
        assert engine.num_preemptions > 0 and _drained(engine)


def test_bfloat16_store_follows_the_model():
    model = _tiny("llama").to(torch.bfloat16)
    engine = Engine(model, None, num_blocks=16, block_size=8, debug=True)
    assert engine.store.k.dtype == torch.bfloat16
    outs = engine.generate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9]], SamplingParams(max_tokens=5))
    assert [len(o.output_ids) for o in outs] == [5, 5] and _drained(engine)


def test_register_before_compute_a_same_step_hit_reads_what_was_written(lm):
    """Blocks are hittable from admission, before their K/V is computed; a request that hits them in
    the same step must still read the right K/V (the step writes before it reads). Breaking either
    half (registering after compute, or reading before writing) makes this fail."""
    model, tok = lm
    prompts = example_prompts("heldout:3", (ASK_EN + ASK_ZH)[:3])
    engine = Engine(model, tok, num_blocks=64, block_size=4, debug=True)
    steps_before = engine.num_steps
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    first_step = [o.num_cached_tokens for o in outs]
    # hits within step 1
    assert first_step[0] == 0 and all(c > 0 for c in first_step[1:]), first_step
    # all three were prefilled together in one step
    assert engine.num_steps - steps_before <= MAX_NEW
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == hf_generate(model, tok, prompt, MAX_NEW)


def test_engine_batches_events_per_step_with_sequence_numbers(bundled):
    from kvlab.cache import AllBlocksCleared, BlockStored, EventBatch

    eng = Engine(*bundled, num_blocks=32, block_size=16, enable_kv_events=True)
    eng.generate(
        [list(range(3, 40)), list(range(3, 36)) + [50, 51]],
        SamplingParams(max_tokens=4, ignore_eos=True),
    )
    batches = eng.take_kv_events()
    assert batches and all(isinstance(b, EventBatch) for b in batches)
    assert [b.seq for b in batches] == list(range(len(batches)))
    first = batches[0].events
    assert isinstance(first[0], BlockStored) and first[0].token_ids[:16] == tuple(range(3, 19))
    assert eng.take_kv_events() == []
    assert eng.reset_prefix_cache()
    (b,) = eng.take_kv_events()
    assert b.events == (AllBlocksCleared(),) and b.seq == batches[-1].seq + 1


def test_steps_build_no_autograd_graph(lm):
    """The forward runs under no_grad: otherwise every step's graph chains through the K/V store
    (written in place) and keeps all earlier steps' activations alive -- memory grows without bound,
    steps slow down."""
    model, tok = lm
    engine = Engine(model, tok, num_blocks=64, block_size=16)
    engine.generate(question_prompts(2, 2), SamplingParams(max_tokens=4))
    assert not engine.store.k.requires_grad and engine.store.k.grad_fn is None
    assert not engine.store.v.requires_grad and engine.store.v.grad_fn is None


def test_engine_runs_on_a_caller_built_block_manager(lm):
    """``Engine(cache=BlockManager(...))``: the same greedy tokens as the default engine, and prefix
    hits."""
    from kvlab.cache import BlockManager

    model, tok = lm
    prompts = example_prompts("heldout:4:filler20", ASK_EN[:3])
    # one at a time: later ones hit
    default = Engine(model, tok, num_blocks=64, block_size=16, max_num_seqs=1)
    own = BlockManager(64, 16)
    mine = Engine(model, tok, cache=own, max_num_seqs=1, debug=True)
    sp = SamplingParams(max_tokens=6)
    ref, outs = default.generate(prompts, sp), mine.generate(prompts, sp)
    assert mine.block_manager is own and mine.store.num_blocks == 64
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in ref]
    assert _drained(mine)


def test_engine_refuses_a_wrong_cache_object(lm):
    """A cache that is neither a name nor a ``CacheManager`` is refused, naming what it lacks; a
    used one too."""
    from kvlab.cache import BlockManager

    model, tok = lm

    class NotACache:
        block_size, num_blocks = 16, 8

        def allocate(self, *args, **kwargs):
            return 0

    with pytest.raises(
        TypeError, match=r"NotACache lacks append, block_table, can_allocate, can_append"
    ):
        Engine(model, tok, cache=NotACache())
    with pytest.raises(ValueError, match="brings its own size"):
        Engine(model, tok, cache=BlockManager(8, 16), num_blocks=8)
    used = BlockManager(8, 16)
    used.allocate(0, list(range(20)))
    with pytest.raises(ValueError, match="already holds 1 sequences"):
        Engine(model, tok, cache=used)
    with pytest.raises(ValueError, match="cache must be one of"):
        Engine(model, tok, cache="lru")


def test_a_prompt_with_a_lone_surrogate_is_refused_and_queues_nothing(lm):
    """Text no tokenizer can encode (a lone surrogate, as JSON can spell it) is a clear ValueError,
    not a tokenizer TypeError."""
    model, tok = lm
    engine = Engine(model, tok, num_blocks=16, block_size=16)
    with pytest.raises(ValueError, match="lone surrogate at character 3"):
        engine.add_request("abc\ud800def")
    assert not engine.requests and not engine.scheduler.waiting


def test_attention_is_switched_once_per_busy_period_and_no_transformers_object_is_patched():
    """Issue 25: the model is switched through transformers' public set_attn_implementation once
    when the engine gets work and back once when it is idle (no per-step write of its private config
    attribute), and the LM head is computed by the runner (``head.forward`` is never replaced). The
    old engine switched the model by hand in every step and patched the head inside it."""
    model = _tiny("llama")
    own, head = model.config._attn_implementation, model.get_output_embeddings()
    engine = Engine(model, None, num_blocks=16, block_size=8)
    assert model.config._attn_implementation == own  # probed at construction, then given back
    assert engine.runner.head_seam and engine.runner.fast_head
    switches, seen = [], []
    real = model.set_attn_implementation
    # a spy on this instance
    model.set_attn_implementation = lambda name: (switches.append(name), real(name))[1]
    handle = model.model.norm.register_forward_hook(  # runs inside every step's forward
        lambda *a: seen.append((model.config._attn_implementation, "forward" in vars(head))))
    try:
        for _ in range(2):
            engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3))
    finally:
        handle.remove()
        del model.set_attn_implementation
    assert len(seen) >= 6 and set(seen) == {(f"kvlab_paged_{own}", False)}
    assert switches == [f"kvlab_paged_{own}", own] * 2 and model.config._attn_implementation == own


def test_a_head_seam_that_misses_the_models_logits_is_not_used():
    """The runner computes the head itself only where the probe shows it gives the model's exact
    logits: a model with a post-processing kvlab does not know (here: logits negated) runs its own
    forward, token-identical."""
    from transformers import LlamaForCausalLM

    class Negated(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
            out.logits = -out.logits
            return out

    plain = _tiny("llama")
    model = Negated(plain.config).eval()
    model.load_state_dict(plain.state_dict())
    model.generation_config.eos_token_id = None
    prompts = [[1, 2, 3, 4], [9, 8]]
    with torch.no_grad():
        ref = [
            model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=4,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    engine = Engine(model, None, num_blocks=16, block_size=4, debug=True)
    assert not engine.runner.head_seam
    assert [o.output_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))] == ref
    # the same weights, no post-processing
    assert Engine(plain, None, num_blocks=16, block_size=4).runner.head_seam


class _SeamHead(torch.nn.Linear):
    """A head that raises ``error`` on 2-D hidden states (only the runner's seam passes 2-D; the
    model passes 3-D)."""

    error: BaseException | None = None

    def forward(self, x):
        if x.dim() == 2 and self.error is not None:
            raise self.error
        return super().forward(x)


def _with_seam_head(error):
    model = _tiny("llama")
    old = model.lm_head
    head = _SeamHead(old.in_features, old.out_features, bias=False)
    head.weight, head.error = old.weight, error
    model.lm_head = head
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize(
    "error", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), TypeError("no")]
)
def test_a_seam_whose_head_does_not_take_the_decoder_output_is_off_and_the_model_still_runs(error):
    """What the seam probe means to catch (torch's shape errors are RuntimeErrors, as for mllama; a
    decoder output the head cannot take): no seam, the model's whole forward each step, the same
    tokens as HF."""
    model = _with_seam_head(error)
    engine = Engine(model, None, num_blocks=16, block_size=4)
    assert not engine.runner.head_seam
    prompt = [1, 2, 3, 4]
    with torch.no_grad():
        ref = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, 4, dtype=torch.long),
            max_new_tokens=4,
            do_sample=False,
        )[0, 4:].tolist()
    assert engine.generate([prompt], SamplingParams(max_tokens=4))[0].output_ids == ref


@pytest.mark.parametrize("error", [AssertionError("a bug in the seam"), NameError("x"),
                                   torch.OutOfMemoryError("out of memory")])
def test_a_bug_or_a_full_device_in_the_seam_probe_propagates_instead_of_turning_the_seam_off(error):
    """Not every exception means "no seam": a bug (AssertionError, NameError) or no memory reaches
    the caller, and the model gets its own attention back (before, ``except Exception: return
    False`` quietly cost every step speed)."""
    model = _with_seam_head(error)
    own = model.config._attn_implementation
    with pytest.raises(type(error)):
        Engine(model, None, num_blocks=16, block_size=4)
    assert model.config._attn_implementation == own
