"""The build exercises (notebooks 01, 02, 04): the worked solution passes its checker, a blank stub gets
"not yet" with a hint, a deliberately wrong answer gets a hint, and ``use_reference`` picks the right piece."""

from kvlab.built import nb01 as N
from kvlab.lessons import nb01_attention as A
from kvlab.lessons import nb02_prefix as R
from kvlab.lessons import nb04_blocks as L
from kvlab.lessons import solutions as SOL
from kvlab.lessons.build import use_reference
from kvlab.lessons.common import Verdict


def blank(*args):
    raise NotImplementedError("write it")


def assert_not_yet(v, *words):
    assert isinstance(v, Verdict) and not v and str(v).startswith("not yet: "), v
    for w in words:
        assert w in str(v), (w, str(v))


# ----------------------------------------------------------------------------- 01.B the cached decode step

def test_01_decode_step_solution_and_reference_pass():
    assert A.check_decode_step(SOL.build_01_decode_step)
    assert A.check_decode_step(A.reference_decode_step)
    assert N.cached_vs_recompute(4, 2, seq=6, step=SOL.build_01_decode_step) <= 1e-5


def test_01_decode_step_blank_gets_a_hint():
    assert_not_yet(A.check_decode_step(blank), "no answer yet. Hint: ", "cache[layer]")
    assert_not_yet(A.check_decode_step(None), "no answer yet")


def test_01_decode_step_wrong_answers_get_hints():
    def no_append(cache, layer, q, k, v):  # stores only this step's K/V
        cache[layer] = (k, v)
        return A.reference_decode_step({}, layer, q, k, v)

    def new_only(cache, layer, q, k, v):  # the cache grows, but attention sees only the new token
        A.reference_decode_step(cache, layer, q, k, v)
        return A.reference_decode_step({}, layer, q, k, v)

    def no_repeat(cache, layer, q, k, v):  # forgets the KV groups: one output head per KV head
        out = A.reference_decode_step(cache, layer, q[:, : k.shape[1]], k, v)
        return out

    def wrong_axis(cache, layer, q, k, v):  # concatenates along the heads axis
        if layer in cache:
            k, v = A.torch.cat([cache[layer][0], k], 1), A.torch.cat([cache[layer][1], v], 1)
        cache[layer] = (k, v)
        return q

    assert_not_yet(A.check_decode_step(no_append), "after step 2", "dim=-2")
    assert_not_yet(A.check_decode_step(new_only), "from token 1 on")
    assert_not_yet(A.check_decode_step(no_repeat), "repeat_kv")
    assert_not_yet(A.check_decode_step(wrong_axis), "sequence axis")
    assert_not_yet(A.check_decode_step(lambda *a: 1 / 0), "ZeroDivisionError")


# ----------------------------------------------------------------------------- 02.B the continue-from-cache loop

def _with_positions(shift):
    """The worked loop, with every position moved by ``shift(start_pos)`` (0: right)."""
    def loop(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(model, cache, suffix_ids, start_pos - shift(start_pos), max_new_tokens, stop_ids)
    return loop


def test_02_continue_solution_and_reference_pass(bundled):
    model, tok = bundled
    assert R.check_continue_loop(SOL.build_02_continue, model, tok, n=2)
    assert R.check_continue_loop(R.reference_continue, model, tok, n=1)


def test_02_continue_blank_and_wrong_answers_get_hints(bundled):
    model, tok = bundled
    assert_not_yet(R.check_continue_loop(blank, model, tok, n=1), "no answer yet. Hint: ", "positions")
    # restarting the suffix at position 0: the bundled model may not even change its answer, the check still sees it
    assert_not_yet(R.check_continue_loop(_with_positions(lambda p: p), model, tok, n=1), "cache already held")

    def no_positions(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(_DropPositions(model), cache, suffix_ids, start_pos, max_new_tokens, stop_ids)

    assert_not_yet(R.check_continue_loop(no_positions, model, tok, n=1), "passed no position_ids")

    def whole_prompt(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(model, cache, [0] * start_pos + list(suffix_ids), 0, max_new_tokens, stop_ids)

    assert_not_yet(R.check_continue_loop(whole_prompt, model, tok, n=1), "feed only suffix_ids")

    def never_stops(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(model, cache, suffix_ids, start_pos, max_new_tokens, set())

    assert_not_yet(R.check_continue_loop(never_stops, model, tok, n=1), "stop_ids")


class _DropPositions:
    """A model proxy that forgets the position_ids it is given (transformers then counts from the cache)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        kwargs.pop("position_ids", None)
        return self.model(**kwargs)

    def parameters(self):
        return self.model.parameters()


# ----------------------------------------------------------------------------- 04.B the hash chain and allocate

def test_04_solutions_pass_and_match_the_block_manager():
    from kvlab.cache.hash_tools import hash_token_blocks

    assert L.check_block_hashes(SOL.build_04_block_hashes)
    assert L.check_allocate(SOL.build_04_allocate)
    assert L.check_allocate(SOL.build_04_allocate, SOL.build_04_block_hashes)
    assert L.check_allocate(L.reference_allocate)
    for seed in range(3):  # the toy state with the reference allocate is kvlab's BlockManager, step for step
        ops = L.block_trace(num_blocks=16, seed=seed)
        rows, problem = L.replay_against_block_manager(L.reference_allocate, hash_token_blocks, ops, num_blocks=16)
        assert problem is None and len(rows) == len(ops)


def test_04_blank_and_wrong_hashes_get_hints():
    from kvlab.cache.hashing import hash_block

    assert_not_yet(L.check_block_hashes(blank), "no answer yet. Hint: ")

    def unchained(tokens, bs, keys=()):
        return [hash_block(None, tokens[i * bs:(i + 1) * bs], keys if i == 0 else ()) for i in range(len(tokens) // bs)]

    def keys_everywhere(tokens, bs, keys=()):
        out, parent = [], None
        for i in range(len(tokens) // bs):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs], keys)
            out.append(parent)
        return out

    def with_tail(tokens, bs, keys=()):
        return SOL.build_04_block_hashes(tokens + [0] * (-len(tokens) % bs), bs, keys)

    assert_not_yet(L.check_block_hashes(unchained), "not chained")
    assert_not_yet(L.check_block_hashes(keys_everywhere), "block 0 only")
    assert_not_yet(L.check_block_hashes(lambda t, bs, k=(): SOL.build_04_block_hashes(t, bs)), "needs the extra keys")
    assert_not_yet(L.check_block_hashes(with_tail), "partial tail")


def test_04_blank_and_wrong_allocate_get_hints():
    assert_not_yet(L.check_allocate(blank), "no answer yet. Hint: ")

    def hits_the_last_token(blocks, seq_id, token_ids, hashes):  # no n - 1 cap: a repeated prompt hits every block
        bs, n, table = blocks.block_size, len(token_ids), []
        for h in hashes:
            b = blocks.cached.get(h)
            if b is None:
                break
            if blocks.ref[b] == 0:
                del blocks.free[b]
            blocks.ref[b] += 1
            table.append(b)
        cached = len(table) * bs
        for i in range(len(table), -(-n // bs)):
            table.append(blocks.take())
            if i < n // bs:
                blocks.register(table[-1], hashes[i])
        blocks.tables[seq_id] = table
        return cached

    def skips_free_blocks(blocks, seq_id, token_ids, hashes):  # a cached block with ref count 0 counted as a miss
        real = blocks.cached
        blocks.cached = {h: b for h, b in real.items() if blocks.ref[b] > 0}
        try:
            return SOL.build_04_allocate(blocks, seq_id, token_ids, hashes)
        finally:
            blocks.cached = real | {h: b for h, b in blocks.cached.items() if h not in real}

    assert_not_yet(L.check_allocate(hits_the_last_token), "last prompt token")
    assert_not_yet(L.check_allocate(skips_free_blocks), "still a hit")


# ----------------------------------------------------------------------------- continue with kvlab's version

def test_use_reference_picks_yours_only_when_the_check_passed(capsys):
    def mine():
        return "mine"

    def ref():
        return "ref"

    assert use_reference(mine, Verdict(True, "correct"), ref) is mine
    assert use_reference(mine, Verdict(False, "not yet"), ref, "build_01_decode_step") is ref
    assert "build_01_decode_step" in capsys.readouterr().out
    assert use_reference(None, Verdict(False, "not yet"), ref) is ref


# 05's capstone (slot mapping, gather, the reader's cache generating tokens): tests/lessons/test_nb05_capstone.py
