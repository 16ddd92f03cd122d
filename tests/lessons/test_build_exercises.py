"""The build exercises (notebooks 01, 02, 04, 05's append): the worked solution passes its checker,
a blank stub gets "not yet" with a hint, a deliberately wrong answer gets a hint, and
``use_reference`` picks the right piece."""

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


# ----------------------------------------------------------------------------- 01.B the cached
# decode step

def test_01_decode_step_solution_and_reference_pass():
    assert A.check_decode_step(SOL.build_01_decode_step)
    assert A.cached_vs_recompute(SOL.build_01_decode_step, seq=6).iloc[:, -1].max() <= 1e-5


def test_01_decode_step_blank_gets_a_hint():
    assert_not_yet(A.check_decode_step(blank), "no answer yet. Hint: ", "cache[layer]")
    assert_not_yet(A.check_decode_step(None), "no answer yet")


def test_01_decode_step_wrong_answers_get_hints():
    def no_append(cache, layer, q, k, v):  # stores only this step's K/V
        cache[layer] = (k, v)
        return SOL.build_01_decode_step({}, layer, q, k, v)

    def new_only(cache, layer, q, k, v):  # the cache grows, but attention sees only the new token
        SOL.build_01_decode_step(cache, layer, q, k, v)
        return SOL.build_01_decode_step({}, layer, q, k, v)

    def no_repeat(cache, layer, q, k, v):  # forgets the KV groups: one output head per KV head
        out = SOL.build_01_decode_step(cache, layer, q[:, : k.shape[1]], k, v)
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


# ----------------------------------------------------------------------------- 02.B the
# continue-from-cache loop

def _with_positions(shift):
    """The worked loop, with every position moved by ``shift(start_pos)`` (0: right)."""
    def loop(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(
            model, cache, suffix_ids, start_pos - shift(start_pos), max_new_tokens, stop_ids
        )

    return loop


def test_02_continue_solution_and_reference_pass(bundled):
    model, tok = bundled
    assert R.check_continue_loop(SOL.build_02_continue, model, tok, n=2)


def test_02_continue_blank_and_wrong_answers_get_hints(bundled):
    model, tok = bundled
    assert_not_yet(
        R.check_continue_loop(blank, model, tok, n=1), "no answer yet. Hint: ", "positions"
    )
    # restarting the suffix at position 0: the bundled model may not even change its answer, the
    # check still sees it
    assert_not_yet(
        R.check_continue_loop(_with_positions(lambda p: p), model, tok, n=1), "cache already held"
    )

    def no_positions(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(
            _DropPositions(model), cache, suffix_ids, start_pos, max_new_tokens, stop_ids
        )

    assert_not_yet(R.check_continue_loop(no_positions, model, tok, n=1), "passed no position_ids")

    def whole_prompt(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(
            model, cache, [0] * start_pos + list(suffix_ids), 0, max_new_tokens, stop_ids
        )

    assert_not_yet(R.check_continue_loop(whole_prompt, model, tok, n=1), "feed only suffix_ids")

    def never_stops(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
        return SOL.build_02_continue(model, cache, suffix_ids, start_pos, max_new_tokens, set())

    assert_not_yet(R.check_continue_loop(never_stops, model, tok, n=1), "stop_ids")


class _DropPositions:
    """A model proxy that forgets the position_ids it is given (transformers then counts from the
    cache)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kwargs):
        kwargs.pop("position_ids", None)
        return self.model(**kwargs)

    def parameters(self):
        return self.model.parameters()


# ----------------------------------------------------------------------------- 04.B, 05.B1 the
# paged cache's pieces

def test_04_05_solutions_pass_their_checkers():
    assert L.check_block_hashes(SOL.build_04_block_hashes)
    assert L.check_take_free(SOL.build_04_take, SOL.build_04_free)
    assert L.check_allocate(SOL.build_04_allocate)
    assert L.check_allocate(
        SOL.build_04_allocate, SOL.build_04_block_hashes, SOL.build_04_take, SOL.build_04_free
    )
    assert L.check_append(SOL.build_05_append)
    assert L.kvlab_pieces().take is SOL.build_04_take and L.kvlab_pieces(take=blank).take is blank


def test_04_blank_and_wrong_hashes_get_hints():
    from kvlab.cache.hashing import hash_block

    assert_not_yet(L.check_block_hashes(blank), "no answer yet. Hint: ")

    def unchained(tokens, bs, keys=()):
        return [
            hash_block(None, tokens[i * bs : (i + 1) * bs], keys if i == 0 else ())
            for i in range(len(tokens) // bs)
        ]

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
    assert_not_yet(
        L.check_block_hashes(lambda t, bs, k=(): SOL.build_04_block_hashes(t, bs)),
        "needs the extra keys",
    )
    assert_not_yet(L.check_block_hashes(with_tail), "partial tail")


def test_04_blank_and_wrong_take_free_get_hints():
    assert_not_yet(L.check_take_free(blank, blank), "no answer yet. Hint: ")
    assert_not_yet(L.check_take_free(None, SOL.build_04_free), "no answer yet")

    def all_to_tail(blocks, seq_id):  # plain LRU: an uncached block is not reused first
        for b in reversed(blocks.tables.pop(seq_id)):
            blocks.ref[b] -= 1
            if blocks.ref[b] == 0:
                blocks.free[b] = None

    def head_first(blocks, seq_id):  # releases the chain's head first, so the head is evicted first
        blocks.tables[seq_id].reverse()
        SOL.build_04_free(blocks, seq_id)

    # takes the head but leaves its hash: a later request hits overwritten K/V
    def no_evict(blocks):
        b = next(iter(blocks.free))
        del blocks.free[b]
        blocks.ref[b] = 1
        return b

    def newest_first(blocks):  # takes the tail: the most recently freed cached block is evicted
        b = next(reversed(blocks.free))
        blocks.free.move_to_end(b, last=False)
        return SOL.build_04_take(blocks)

    assert_not_yet(
        L.check_take_free(SOL.build_04_take, all_to_tail),
        "free list differ",
        "HEAD when it holds none",
    )
    assert_not_yet(
        L.check_take_free(SOL.build_04_take, head_first), "free list differ", "tail first"
    )
    assert_not_yet(
        L.check_take_free(no_evict, SOL.build_04_free), "cached blocks differ", "blocks.uncache(b)"
    )
    assert_not_yet(L.check_take_free(newest_first, SOL.build_04_free), "HEAD of blocks.free")
    assert_not_yet(L.check_take_free(lambda blocks: 1 / 0, SOL.build_04_free), "ZeroDivisionError")


def test_04_blank_and_wrong_allocate_get_hints():
    assert_not_yet(L.check_allocate(blank), "no answer yet. Hint: ")

    def allocate(blocks, seq_id, token_ids, hashes, cap=True, revive=True):
        bs, n, table = blocks.block_size, len(token_ids), []
        for h in hashes[: (n - 1) // bs] if cap else hashes:
            b = blocks.lookup(h)
            if b is None or (not revive and blocks.ref[b] == 0):
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

    assert L.check_allocate(allocate)
    assert_not_yet(L.check_allocate(lambda *a: allocate(*a, cap=False)), "last prompt token")
    assert_not_yet(L.check_allocate(lambda *a: allocate(*a, revive=False)), "still a hit")


def test_05_blank_and_wrong_append_get_hints():
    from kvlab.built.nb04 import hash_block

    assert_not_yet(L.check_append(blank), "no answer yet. Hint: ")

    def append(blocks, seq_id, token_ids, chained=True, register=True, every=False):
        bs, table, n = blocks.block_size, blocks.tables[seq_id], len(token_ids)
        if every or (n - 1) % bs == 0:
            table.append(blocks.take())
        if register and n % bs == 0:
            parent = blocks.hash_of[table[-2]] if chained and len(table) > 1 else None
            blocks.register(table[-1], hash_block(parent, token_ids[-bs:]))

    assert L.check_append(append)
    assert_not_yet(
        L.check_append(lambda *a: append(*a, register=False)), "cached blocks differ", "register"
    )
    assert_not_yet(
        L.check_append(lambda *a: append(*a, every=True)),
        "block table",
        "only when the token starts one",
    )
    assert_not_yet(L.check_append(lambda *a: append(*a, chained=False)), "parent")


# ----------------------------------------------------------------------------- continue with
# kvlab's version

def test_use_reference_picks_yours_only_when_the_check_passed(capsys):
    def mine():
        return "mine"

    def ref():
        return "ref"

    assert use_reference(mine, Verdict(True, "correct"), ref) is mine
    assert use_reference(mine, Verdict(False, "not yet"), ref, "build_01_decode_step") is ref
    assert "build_01_decode_step" in capsys.readouterr().out
    assert use_reference(None, Verdict(False, "not yet"), ref) is ref


# 05's capstone (slot mapping, gather, the reader's cache generating tokens):
# tests/lessons/test_nb05_capstone.py
