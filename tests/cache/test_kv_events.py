"""KV events (vLLM's schema) from the block manager and the engine; the same stream as real vLLM's."""

import random

import pytest

from kvlab.cache import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored, EventBatch
from kvlab.cache.hashing import prompt_block_hashes


def test_off_by_default():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(9)))
    assert bm.take_events() == []


def test_allocate_stores_the_new_full_blocks_in_one_event():
    bm = BlockManager(8, 4, enable_kv_events=True)
    bm.allocate("a", list(range(10)))  # 2 full blocks, a partial tail
    (ev,) = bm.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == tuple(prompt_block_hashes(list(range(8)), 4))
    assert ev.parent_block_hash is None and ev.token_ids == tuple(range(8)) and ev.block_size == 4
    assert bm.take_events() == []  # taken: the queue is empty
    # a second prompt hits block 0 and stores only its new blocks: the parent is the last hit block
    bm.allocate("b", list(range(4)) + [50, 51, 52, 53, 54])
    (ev,) = bm.take_events()
    assert ev.parent_block_hash == prompt_block_hashes(list(range(4)), 4)[0]
    assert ev.token_ids == (50, 51, 52, 53) and len(ev.block_hashes) == 1


def test_decode_stores_each_block_it_fills():
    bm = BlockManager(8, 4, enable_kv_events=True)
    bm.allocate("a", [1, 2, 3, 4, 5, 6])
    bm.take_events()
    bm.append("a", 7)
    assert bm.take_events() == []  # block not full yet
    bm.append("a", 8)
    (ev,) = bm.take_events()
    assert ev.token_ids == (5, 6, 7, 8) and ev.parent_block_hash == prompt_block_hashes([1, 2, 3, 4], 4)[0]
    assert ev.block_hashes == (prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1],)


def test_eviction_removes_and_reset_clears():
    bm = BlockManager(3, 4, enable_kv_events=True)
    bm.allocate("a", list(range(8)) + [9])  # 3 blocks, 2 cached
    bm.free("a")
    stored = bm.take_events()[0].block_hashes
    bm.allocate("b", [100 + i for i in range(12)])  # needs all 3: evicts both cached blocks, tail first
    events = bm.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == [stored[1], stored[0]]
    assert isinstance(events[-1], BlockStored)  # removals first: the slots are taken before the new blocks cache
    assert not bm.reset_prefix_cache()  # "b" still holds blocks: refused, no event
    assert bm.take_events() == []
    bm.free("b")
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]


def test_failed_step_uncache_emits_removed():
    bm = BlockManager(4, 4, enable_kv_events=True)
    bm.allocate("a", list(range(9)))
    (stored,) = bm.take_events()
    bm.free("a", uncache_from=4)  # block 1's K/V was never written
    assert bm.take_events() == [BlockRemoved((stored.block_hashes[1],))]


def test_replaying_the_events_gives_the_cached_hashes():
    """Stores minus removals per hash (a multiset: twins exist) == what the pool caches, after random ops."""
    rng = random.Random(0)
    bm = BlockManager(12, 4, enable_kv_events=True)
    counts: dict[bytes, int] = {}
    live: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.45:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 14))]
            if bm.can_allocate(prompt):
                bm.allocate(f"s{step}", prompt)
                live.append(f"s{step}")
        elif op < 0.8 and live:
            sid = rng.choice(live)
            if bm.can_append(sid):
                bm.append(sid, rng.randrange(3))
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.1:
            bm.reset_prefix_cache()
        for ev in bm.take_events():
            if isinstance(ev, AllBlocksCleared):
                counts.clear()
            for h in ev.block_hashes if not isinstance(ev, AllBlocksCleared) else ():
                counts[h] = counts.get(h, 0) + (1 if isinstance(ev, BlockStored) else -1)
        assert {h: c for h, c in counts.items() if c} == {h: len(b) for h, b in bm.pool.cached.items()}


def test_engine_batches_events_per_step_with_sequence_numbers(bundled):
    from kvlab.engine import Engine, SamplingParams

    eng = Engine(*bundled, num_blocks=32, block_size=16, enable_kv_events=True)
    eng.generate([list(range(3, 40)), list(range(3, 36)) + [50, 51]], SamplingParams(max_tokens=4, ignore_eos=True))
    batches = eng.take_kv_events()
    assert batches and all(isinstance(b, EventBatch) for b in batches)
    assert [b.seq for b in batches] == list(range(len(batches)))
    first = batches[0].events
    assert isinstance(first[0], BlockStored) and first[0].token_ids[:16] == tuple(range(3, 19))
    assert eng.take_kv_events() == []
    assert eng.reset_prefix_cache()
    (b,) = eng.take_kv_events()
    assert b.events == (AllBlocksCleared(),) and b.seq == batches[-1].seq + 1


# --- the same stream as real vLLM (skipped without its venv) ---------------------------------------------

def _ops(seed: int = 0, block_size: int = 16) -> list[dict]:
    """A workload of prompts sharing prefixes, decodes, frees (tail blocks evicted), and a reset."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(2 * block_size + 5)]
    ops, live, n = [], [], 0
    for turn in range(14):
        if live and (turn % 3 == 2 or len(live) > 2):
            ops.append({"op": "free", "id": live.pop(0)})
        rid = f"r{n}"
        n += 1
        prompt = (system if turn % 4 else system[:block_size]) + [rng.randrange(1, 500) for _ in range(rng.randint(3, 40))]
        ops.append({"op": "alloc", "id": rid, "prompt": prompt})
        for _ in range(rng.randint(1, 20)):
            ops.append({"op": "append", "id": rid, "token": rng.randrange(1, 500)})
        live.append(rid)
        if turn == 9:
            for r in live:
                ops.append({"op": "free", "id": r})
            live = []
            ops.append({"op": "reset"})
    ops += [{"op": "free", "id": r} for r in live]
    return ops


def kvlab_events(ops: list[dict], num_blocks: int, block_size: int) -> list[list[dict]]:
    """The ops on kvlab's BlockManager; events after each op in the worker's JSON shape (hashes as hex)."""
    bm = BlockManager(num_blocks, block_size, enable_kv_events=True)
    out = []
    for op in ops:
        if op["op"] == "alloc":
            bm.allocate(op["id"], op["prompt"])
        elif op["op"] == "append":
            bm.append(op["id"], op["token"])
        elif op["op"] == "free":
            bm.free(op["id"])
        else:
            assert bm.reset_prefix_cache()
        evs = []
        for e in bm.take_events():
            d = {"kind": type(e).__name__}
            if not isinstance(e, AllBlocksCleared):
                d["block_hashes"] = [h.hex() for h in e.block_hashes]
            if isinstance(e, BlockStored):
                d.update(parent_block_hash=None if e.parent_block_hash is None else e.parent_block_hash.hex(),
                         token_ids=list(e.token_ids), block_size=e.block_size)
            evs.append(d)
        out.append(evs)
    return out


def canonical(stream: list[list[dict]]) -> list[list[tuple]]:
    """Hash values replaced by the order in which each was first stored: comparable across hash functions."""
    names: dict[str, int] = {}

    def name(h):
        if h is None:
            return None
        return names.setdefault(h, len(names))

    out = []
    for evs in stream:
        row = []
        for e in evs:
            if e["kind"] == "BlockStored":
                row.append(("stored", name(e["parent_block_hash"]), tuple(name(h) for h in e["block_hashes"]),
                            tuple(e["token_ids"]), e["block_size"]))
            elif e["kind"] == "BlockRemoved":
                row.append(("removed", tuple(name(h) for h in e["block_hashes"])))
            else:
                row.append(("cleared",))
        out.append(row)
    return out


def test_kvlab_and_vllm_event_streams_agree():
    from kvlab.vllm import bridge as vb

    status = vb.vllm_status()
    if not status.available:
        pytest.skip("vLLM is optional (`make vllm-env` creates its venv): " + status.message.splitlines()[0])
    ops, nb, bs = _ops(), 14, 16  # a small pool: later prompts evict earlier blocks
    ours = kvlab_events(ops, nb, bs)
    res = vb.run_worker({"kind": "kv_events", "ops": ops, "num_blocks": nb, "block_size": bs}, timeout=300)
    theirs = res["events"]
    assert len(theirs) == len(ours)
    flat = [e for evs in ours for e in evs]
    kinds = {e["kind"] for e in flat}
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= kinds, kinds  # the workload exercises all three
    assert canonical(theirs) == canonical(ours)
    assert any(e["kind"] == "BlockStored" and e["parent_block_hash"] for e in flat)
    their_hashes = {h for evs in theirs for e in evs for h in e.get("block_hashes", [])}
    assert not their_hashes & {h for e in flat for h in e.get("block_hashes", [])}  # values differ by design
