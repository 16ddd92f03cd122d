"""Notebook 05, section 1: the reader's block manager under the real engine, and the slot-mapping exercise.

``ToyManager`` turns notebook 04's two build pieces (the chained block hash and ``allocate`` on a
``ToyBlocks``) into a ``kvlab.cache.CacheManager``, so ``Engine(model, tok, cache=ToyManager(...))`` runs a
real model on them; ``manager_factory`` picks it when the pieces pass notebook 04's checks, else kvlab's
``BlockManager``. Build exercise 05.B: ``slot_mapping(block_table, block_size, start, end)``, the slot
(``block id x block size + offset``) each new token's K and V are written to, checked against what the
engine handed its attention (``TracingEngine``'s record). Pure Python (no torch import).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.cache.block_manager import BlockManager
from kvlab.cache.hashing import first_block_extra_keys
from kvlab.lessons.build import use_reference
from kvlab.lessons.common import Verdict, call_answer, verdict
from kvlab.lessons.nb04_blocks import ToyBlocks, check_allocate, check_block_hashes

__all__ = ["ToyManager", "check_slot_mapping", "describe_requests", "manager_factory", "reference_slot_mapping",
           "shared_blocks", "three_requests"]


@dataclass
class _Seq:
    token_ids: list[int]
    num_cached_tokens: int = 0


@dataclass
class _Append:
    cow: tuple[int, int] | None = None  # a ToyManager never shares a block that is written to
    new_block: int | None = None


@dataclass
class _Stats:
    queries: int = 0
    hits: int = 0
    per_seq: dict = field(default_factory=dict)


class ToyManager:
    """A ``kvlab.cache.CacheManager`` run by notebook 04's ``allocate`` and ``block_hashes`` on a ``ToyBlocks``.

    Enough for ``Engine.generate`` with one sample per request and no tenant salt: ``fork`` and a public
    prefix raise ``NotImplementedError`` (kvlab's ``BlockManager`` has them). Blocks filled while decoding
    are registered under their chained hash too, as vLLM does.
    """

    def __init__(self, num_blocks: int, block_size: int, allocate: Callable[..., int],
                 block_hashes: Callable[..., list[bytes]]) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = ToyBlocks(num_blocks, block_size)
        self.allocate_fn, self.block_hashes = allocate, block_hashes
        self.seqs: dict[Hashable, _Seq] = {}
        self._keys: dict[Hashable, tuple] = {}
        self._stats = _Stats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not)."""
        return len(self.blocks.free)

    def _extra_keys(self, scope: Any) -> tuple:
        salt = getattr(scope, "salt", None)
        if salt is not None and getattr(scope, "public_tokens", 0):
            raise NotImplementedError("a public prefix before the salt needs kvlab's BlockManager")
        return first_block_extra_keys("", salt)

    def can_allocate(self, token_ids: Sequence[int], scope: Any = None) -> bool:
        """True when the prompt's blocks fit in the free list even with no hit (a plan of one bool)."""
        return cdiv(len(token_ids), self.block_size) <= len(self.blocks.free)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], scope: Any = None, *, plan: Any = None,
                 preempted: bool = False) -> int:
        """Hash the prompt's full blocks, run the reader's ``allocate``; return its cached tokens."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        tokens, keys = list(token_ids), self._extra_keys(scope)
        cached = self.allocate_fn(self.blocks, seq_id, tokens, list(self.block_hashes(tokens, self.block_size, keys)))
        if type(cached) is not int or not 0 <= cached < max(len(tokens), 1) or cached % self.block_size:
            raise ValueError(f"allocate returned {cached!r}: the cached tokens must be whole blocks, below the "
                             f"prompt's {len(tokens)} tokens")
        self.seqs[seq_id], self._keys[seq_id] = _Seq(tokens, cached), keys
        self._stats.queries += len(tokens)
        self._stats.hits += cached
        return cached

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether the next token fits: room in the last block, or a free block."""
        return len(self.seqs[seq_id].token_ids) % self.block_size != 0 or bool(self.blocks.free)

    def append(self, seq_id: Hashable, token_id: int) -> _Append:
        """Write one decoded token; take a block when the last is full; register a block the token fills."""
        seq, bs, table = self.seqs[seq_id], self.block_size, self.blocks.tables[seq_id]
        new = None
        if len(seq.token_ids) % bs == 0:
            new = self.blocks.take()
            table.append(new)
        seq.token_ids.append(token_id)
        if len(seq.token_ids) % bs == 0:  # the last block is full now: later requests may hit it
            hashes = self.block_hashes(seq.token_ids, bs, self._keys[seq_id])
            self.blocks.register(table[-1], hashes[-1])
        return _Append(None, new)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Not offered: parallel samples (``n > 1``) need kvlab's ``BlockManager`` (copy-on-write)."""
        raise NotImplementedError("fork (n > 1) needs kvlab's BlockManager: it has copy-on-write")

    def free(self, seq_id: Hashable, uncache_from: int | None = None) -> None:
        """Drop the sequence's references; blocks from token ``uncache_from`` on leave the cache first."""
        table = self.blocks.tables[seq_id]
        if uncache_from is not None:
            for b in table[uncache_from // self.block_size:]:
                h = self.blocks.hash_of[b]
                if h is not None and self.blocks.ref[b] == 1:
                    self.blocks._twins[h].remove(b)
                    if self.blocks._twins[h]:
                        self.blocks.cached[h] = self.blocks._twins[h][0]
                    else:
                        del self.blocks.cached[h], self.blocks._twins[h]
                    self.blocks.hash_of[b] = None
        self.blocks.free_seq(seq_id)
        del self.seqs[seq_id], self._keys[seq_id]

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of ``seq_id``, in order."""
        return list(self.blocks.tables[seq_id])

    def stats(self) -> dict:
        """Prompt tokens looked up and found, and the pool's occupancy."""
        q, h = self._stats.queries, self._stats.hits
        return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0, "num_free_blocks": self.num_free_blocks,
                "num_cached_blocks": len(self.blocks.cached)}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless ref counts match the tables and the free list holds exactly ref-0 blocks."""
        held = [0] * self.num_blocks
        for table in self.blocks.tables.values():
            for b in table:
                held[b] += 1
        assert held == self.blocks.ref, "a ref count differs from the number of block-table entries"
        assert set(self.blocks.free) == {b for b, r in enumerate(self.blocks.ref) if r == 0}, "free list != ref-0 blocks"
        for seq_id, seq in self.seqs.items():
            assert len(self.blocks.tables[seq_id]) == cdiv(len(seq.token_ids), self.block_size), \
                f"sequence {seq_id!r}: its table does not cover its tokens"

    def take_events(self) -> list:
        """No KV events (vLLM's schema is kvlab's BlockManager's)."""
        return []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False while a sequence holds blocks."""
        if self.seqs:
            return False
        self.blocks = ToyBlocks(self.num_blocks, self.block_size)
        return True


def manager_factory(block_hashes: Callable[..., list[bytes]] | None, allocate: Callable[..., int] | None
                    ) -> Callable[[int, int], Any]:
    """``(num_blocks, block_size) -> manager``: a ``ToyManager`` on the reader's notebook-04 pieces when both pass
    notebook 04's checks, else kvlab's ``BlockManager``; prints the two checks and which one it is."""
    hashes_ok = check_block_hashes(block_hashes)
    alloc_ok = check_allocate(allocate, block_hashes if hashes_ok else None)
    print(f"my_block_hashes: {hashes_ok}\nmy_allocate: {alloc_ok}")
    ok = Verdict(bool(hashes_ok and alloc_ok), "")

    def yours(num_blocks: int, block_size: int) -> ToyManager:
        return ToyManager(num_blocks, block_size, allocate, block_hashes)

    yours.__name__ = "ToyManager (on your notebook-04 pieces)"
    return use_reference(yours, ok, BlockManager, "build_04_block_hashes and build_04_allocate")


# ----------------------------------------------------------------------------- build exercise 05.B: the slot mapping

def reference_slot_mapping(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """kvlab's slot mapping: position p sits in physical block ``block_table[p // block_size]`` at offset ``p % block_size``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _cases(trace: Sequence[dict] | None) -> list[tuple[list[int], int, int, int, list[int], str]]:
    """(table, block size, start, end, the slots the engine wrote, where) from a trace, plus fixed cases."""
    cases = []
    for step in trace or ():
        off = 0
        for r in step["rows"]:
            s, e = r["positions"]
            slots = step["slot_mapping"][off:off + r["query rows"]]
            off += r["query rows"]
            cases.append((list(r["block table"]), step["block_size"], s, e, slots,
                          f"request {r['request']!r} ({r['kind']}, step {step['step']})"))
    rng = random.Random(5)
    for bs, start, end in ((4, 0, 9), (4, 8, 13), (16, 35, 36), (2, 3, 7)):
        table = rng.sample(range(40), cdiv(end, bs))  # physical blocks anywhere, out of order
        cases.append((table, bs, start, end, reference_slot_mapping(table, bs, start, end),
                      f"block table {table}, block size {bs}, positions {start}..{end - 1}"))
    return cases


def check_slot_mapping(fn: Callable[..., list[int]] | None, trace: Sequence[dict] | None = None,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> Verdict:
    """Build exercise 05.B: ``fn(block_table, block_size, start, end)`` -> the slot of each position in
    ``[start, end)``; compared with the slots the engine wrote in ``trace`` (``TracingEngine.trace``, its block
    size ``block_size``) and with fixed cases. Never raises."""
    hint = ("one slot per position p from start to end - 1: the physical block block_table[p // block_size], "
            "times block_size, plus the offset p % block_size")
    for table, bs, start, end, want, where in _cases([dict(s, block_size=block_size) for s in trace or ()]):
        got, failed = call_answer(fn, list(table), bs, start, end, hint=hint, name="my_slot_mapping")
        if failed is not None:
            return failed
        got = list(got) if isinstance(got, list | tuple | range) else got
        if got == want:
            continue
        why = hint
        if not isinstance(got, list):
            why = f"return a list of ints, not {type(got).__name__}"
        elif len(got) == end and start > 0:
            why = "positions below start are already in the cache: return slots for start .. end - 1 only"
        elif len(got) != end - start:
            why = f"{end - start} positions, {len(got)} slots: one slot per position from start to end - 1"
        elif got == list(range(start, end)) or got == [p // bs * bs + p % bs for p in range(start, end)]:
            why = "that is the logical position: look the block up in block_table (logical -> physical)"
        elif got == [table[p // bs] + p % bs for p in range(start, end)]:
            why = "a block holds block_size slots: multiply the physical block id by block_size"
        return verdict(False, hint=f"{where}: {why}")
    n = sum(len(s["rows"]) for s in trace or ())
    return verdict(True, f"the same slots as the engine wrote for {n} traced request steps, and the fixed cases")


def shared_blocks(tables: dict[Any, Sequence[int]]) -> list[int]:
    """Physical blocks that appear in every one of ``tables`` (in the first table's order)."""
    common = set.intersection(*(set(t) for t in tables.values())) if tables else set()
    return [b for b in next(iter(tables.values()), []) if b in common]


def describe_requests(step: dict, slot_mapping: Callable[..., list[int]], block_size: int,
                      names: Sequence[str] | None = None) -> str:
    """One traced prefill step as text: per request its block table, cached blocks and the slots of its new K/V
    (by ``slot_mapping``, beside the engine's), then the physical blocks every request shares."""
    from kvlab.lessons.nb05_table36 import _runs

    lines, off, tables = [], 0, {}
    for i, r in enumerate(step["rows"]):
        s, e = r["positions"]
        engine_slots = step["slot_mapping"][off:off + r["query rows"]]
        off += r["query rows"]
        mine = list(slot_mapping(list(r["block table"]), block_size, s, e))
        name = names[i] if names else f"request {r['request']}"
        tables[name] = r["block table"]
        lines.append(f"{name}: {e} prompt tokens, block table {r['block table']}, "
                     f"{r['cached tokens']} tokens from the cache (blocks {r['hit blocks']})")
        lines.append(f"    computes positions {s}..{e - 1}; slots {_runs(mine)}"
                     + ("  (= the engine's)" if mine == engine_slots else f"  but the engine wrote {_runs(engine_slots)}"))
    common = shared_blocks(tables)
    lines.append(f"physical blocks in all {len(tables)} block tables: {common} "
                 f"({len(common) * block_size} tokens of K/V stored once)")
    return "\n".join(lines)


def three_requests(tokenizer: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> list[list[int]]:
    """Three prompts (token ids) on one passphrase system prompt, three different questions: notebook 05's group 1
    for one passphrase (``real_groups`` for a chat model, ``seed_groups`` for the bundled one)."""
    from kvlab.lessons.nb05_table36 import is_real_chat_model, real_groups
    from kvlab.lessons.workloads import seed_groups

    if is_real_chat_model(tokenizer):
        return real_groups(tokenizer, n=1, questions=3, block_size=block_size, translations=0)[1].prompts
    return seed_groups(tokenizer, n=1, questions=3, block_size=block_size)[1].prompts
