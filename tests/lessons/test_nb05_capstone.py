"""Notebook 05's capstone: the slot mapping, the gather, YourManager and paged_generate (kvlab.built.nb05)."""

import pytest
import torch

from kvlab.built import nb05 as N
from kvlab.cache.hash_tools import hash_token_blocks
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import eos_ids
from kvlab.lessons import nb05_assemble as AS
from kvlab.lessons import nb05_table36 as T
from kvlab.lessons import solutions as SOL
from kvlab.lessons.nb04_blocks import reference_allocate

BLOCK = 16


def not_yet(v, *parts):
    assert not v and all(p in str(v) for p in parts), str(v)


def test_slot_mapping_checker_passes_the_solutions_and_names_each_mistake():
    assert AS.check_slot_mapping(AS.solution_slot_mapping) and AS.check_slot_mapping(SOL.build_05_slot_mapping)
    not_yet(AS.check_slot_mapping(None), "no answer yet", "block_table[p // block_size]")

    def blank(table, bs, start, end):
        raise NotImplementedError

    not_yet(AS.check_slot_mapping(blank), "no answer yet")
    not_yet(AS.check_slot_mapping(lambda t, bs, s, e: list(range(s, e))), "logical position")
    not_yet(AS.check_slot_mapping(lambda t, bs, s, e: [t[p // bs] + p % bs for p in range(s, e)]), "multiply")
    not_yet(AS.check_slot_mapping(lambda t, bs, s, e: AS.solution_slot_mapping(t, bs, 0, e)), "below start are cached")
    not_yet(AS.check_slot_mapping(lambda t, bs, s, e: AS.solution_slot_mapping(t, bs, s, e - 1)), "one slot per position")
    not_yet(AS.check_slot_mapping(lambda *a: 1 / 0), "ZeroDivisionError")


def test_gather_checker_passes_the_solution_and_names_each_mistake():
    assert AS.check_gather(AS.solution_gather)
    not_yet(AS.check_gather(None), "no answer yet")
    not_yet(AS.check_gather(lambda pages, t, n, bs: pages[:n]), "go through block_table")
    whole = lambda pages, t, n, bs: pages.view(-1, bs, *pages.shape[1:])[t].flatten(0, 1)  # noqa: E731
    not_yet(AS.check_gather(whole), "keep the first length")
    not_yet(AS.check_gather(lambda pages, t, n, bs: [1]), "return a tensor")
    assert AS.check_gather(lambda pages, t, n, bs: whole(pages, t, n, bs)[:n])  # another right answer


@pytest.fixture(scope="module")
def three(lm):
    return T.three_requests(lm[1], BLOCK)


def _isolated(model, prompts, new):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False)[0, len(p):].tolist())
    return out


def test_capstone_generates_what_isolated_generate_does_and_reuses_the_prefix(lm, three):
    model, tok = lm
    own = model.config._attn_implementation
    cache = N.YourManager(64, BLOCK, SOL.build_04_allocate, SOL.build_04_block_hashes)
    results = N.paged_generate(model, three, cache, AS.solution_slot_mapping, AS.solution_gather, 6,
                               eos_ids(model, tok))
    assert model.config._attn_implementation == own  # the model gets its own attention back
    reference = _isolated(model, three, 6)
    assert AS.check_capstone(results, reference)
    assert results[0][1] == 0 and all(c > 0 and c % BLOCK == 0 for _, c in results[1:])
    cache.check_invariants()
    assert not cache.seqs and sum(cache.blocks.ref) == 0  # every request freed its blocks


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Qwen2: every K/V it reads moves its argmax (the trained bundled model often answers
    the same from wrong K/V), and prompts sharing a 48-token prefix."""
    import random

    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(48)]
    return model, [prefix + [rng.randrange(256) for _ in range(8)] for _ in range(3)]


def test_a_wrong_slot_mapping_gather_or_hash_chain_changes_the_tokens(tiny):
    model, prompts = tiny
    reference = _isolated(model, prompts, 8)

    def run(slots=AS.solution_slot_mapping, gather=AS.solution_gather, hashes=hash_token_blocks, ps=prompts):
        cache = N.YourManager(64, BLOCK, reference_allocate, hashes)
        cache.blocks.take()  # block 0 in use: no sequence's blocks sit at its logical slots
        return N.paged_generate(model, ps, cache, slots, gather, 8)

    assert AS.check_capstone(run(), reference)
    assert not AS.check_capstone(run(slots=lambda table, bs, start, end: list(range(start, end))), reference)
    assert not AS.check_capstone(run(gather=lambda pages, table, n, bs: pages[:n]), reference)

    def unchained(tokens, bs, extra_keys=()):  # every block keyed on its tokens alone: wrong hits
        return [hash_token_blocks(tokens[i * bs:(i + 1) * bs], bs)[0] for i in range(len(tokens) // bs)]

    moved = [prompts[0], prompts[1][BLOCK:2 * BLOCK] + prompts[1]]  # block 1's text first, then the whole prompt
    results = run(hashes=unchained, ps=moved)
    assert results[1][1] > 0 and not AS.check_capstone(results, _isolated(model, moved, 8))


def test_your_manager_runs_under_the_engine(lm, three):
    model, tok = lm
    sp = SamplingParams(max_tokens=6)
    engine = Engine(model, tok, cache=N.YourManager(64, BLOCK, reference_allocate, hash_token_blocks))
    outs = engine.generate(three, sp)
    iso = Engine(model, tok, enable_prefix_caching=False).generate(three, sp)
    assert [o.output_ids for o in outs] == [o.output_ids for o in iso]
    assert sum(o.num_cached_tokens for o in outs) > 0
    engine.check_invariants()
