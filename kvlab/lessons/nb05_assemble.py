"""Notebook 05's capstone: the reader's pieces of a paged cache behind the members
``Engine(cache=...)`` calls (``YourManager``), their checkers, whose piece ran, and
``check_capstone`` (``kvlab.built.nb05.paged_generate`` against isolated ``generate``). The worked
solutions: ``kvlab.lessons.solutions``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from types import SimpleNamespace
from typing import Any

from kvlab.built.nb04 import ToyBlocks
from kvlab.cache import cdiv
from kvlab.lessons import nb04_blocks as L04
from kvlab.lessons import solutions as SOL
from kvlab.lessons.common import Verdict, call_answer, verdict

reference_slot_mapping = SOL.build_05_slot_mapping


def pieces_from_04(**yours: Callable | None) -> SimpleNamespace:
    """Notebook 04's pieces (``hashes``, ``take``, ``free``, ``allocate``): yours where its checker
    passes, else kvlab's."""
    ref, got, pair = (L04.kvlab_pieces(), {},
                      L04.check_take_free(yours.get("take"), yours.get("free")))
    checks = {"hashes": L04.check_block_hashes(yours.get("hashes")), "take": pair, "free": pair,
              "allocate": L04.check_allocate(yours.get("allocate"),
                                             *(yours.get(k) or getattr(ref, k)
                                               for k in ("hashes", "take", "free")))}
    for name, check in checks.items():
        ok = yours.get(name) is not None and bool(check)
        got[name] = yours[name] if ok else getattr(ref, name)
        print(f"{name:>8}: {'YOURS' if ok else 'kvlab' + chr(39) + 's'}"
              + ("" if ok or yours.get(name) is None else f" (yours: {check})"))
    return SimpleNamespace(**got, append=ref.append)


def say_whose(pieces: SimpleNamespace) -> None:
    """One line per piece of the cache that just ran: the reader's (defined in the notebook) or
    kvlab's."""
    for name, fn in vars(pieces).items():
        yours = getattr(fn, "__module__", "") == "__main__"
        print(f"{name:>13}: {'yours' if yours else 'kvlab' + chr(39) + 's'} "
              f"({getattr(fn, '__name__', fn)})")


class YourManager:
    """A cache for ``Engine(cache=...)`` run by ``pieces`` (hashes, take, free, allocate, append) on
    a ``ToyBlocks``: the members of ``kvlab.cache.CacheManager`` (no tenant salt, no fork: kvlab's
    ``BlockManager`` has them)."""

    def __init__(self, num_blocks: int, block_size: int, pieces: SimpleNamespace) -> None:
        self.num_blocks, self.block_size, self.pieces = num_blocks, block_size, pieces
        self.blocks = ToyBlocks(num_blocks, block_size, pieces.take, pieces.free)
        # token_ids: the tokens whose K/V its blocks hold
        self.seqs: dict[Hashable, SimpleNamespace] = {}
        self.queries = self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.blocks.free)

    def can_allocate(self, token_ids: Sequence[int], scope: Any = None) -> bool:
        return cdiv(len(token_ids), self.block_size) <= len(self.blocks.free)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], scope: Any = None,
                 **_: Any) -> int:
        if getattr(scope, "cache_salt", None) is not None:
            raise NotImplementedError("a tenant salt needs kvlab's BlockManager")
        tokens = list(token_ids)
        hashes = list(self.pieces.hashes(tokens, self.block_size, ()))
        cached = self.pieces.allocate(self.blocks, seq_id, tokens, hashes)
        assert cached % self.block_size == 0 and 0 <= cached < len(tokens), (
            f"allocate returned {cached}")
        # no second memory tier
        self.seqs[seq_id] = SimpleNamespace(token_ids=tokens, num_restored_tokens=0)
        self.queries, self.hits = self.queries + len(tokens), self.hits + cached
        return cached

    def can_append(self, seq_id: Hashable) -> bool:
        return len(self.seqs[seq_id].token_ids) % self.block_size != 0 or bool(self.blocks.free)

    def append(self, seq_id: Hashable, token_id: int) -> SimpleNamespace:
        self.seqs[seq_id].token_ids.append(token_id)
        self.pieces.append(self.blocks, seq_id, list(self.seqs[seq_id].token_ids))
        return SimpleNamespace(cow=None)   # a shared block is never written: no copy-on-write

    def free(self, seq_id: Hashable, uncache_from: int | None = None) -> None:
        """Release the sequence; blocks from token ``uncache_from`` on (K/V never written) leave the
        cache first."""
        table = self.blocks.tables[seq_id]
        for b in table[len(table) if uncache_from is None else uncache_from // self.block_size:]:
            if self.blocks.hash_of[b] is not None and self.blocks.ref[b] == 1:
                self.blocks.uncache(b)
        self.blocks.free_seq(seq_id)
        del self.seqs[seq_id]

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self.blocks.tables[seq_id])

    def num_allocated_tokens(self, seq_id: Hashable) -> int:
        return len(self.seqs[seq_id].token_ids)

    def num_restored_tokens(self, seq_id: Hashable) -> int:
        return 0   # no second memory tier here

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        raise NotImplementedError("n > 1 needs kvlab's BlockManager (copy-on-write)")

    def stats(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "num_free_blocks": self.num_free_blocks}

    def check_invariants(self) -> None:
        held = Counter(b for table in self.blocks.tables.values() for b in table)
        assert [held[b] for b in range(self.num_blocks)] == self.blocks.ref, (
            "a ref count differs from the block tables")

    def take_events(self) -> list:
        return []

    def reset_prefix_cache(self) -> bool:
        return False


# (block table: physical blocks anywhere, out of order; block size; start; end)
CASES = (([7, 2, 31], 4, 0, 9), ([5, 0, 12, 39], 4, 8, 13), ([17, 3, 26], 16, 35, 36),
         ([9, 30, 1, 22], 2, 3, 7))


def check_slot_mapping(fn: Callable[..., list[int]] | None) -> Verdict:
    """Build 05.B2: ``fn(block_table, block_size, start, end)``, the K/V slot of each position in
    ``[start, end)``."""
    hint = ("one slot per position p from start to end - 1: the physical block block_table[p // "
            "block_size], times block_size, plus the offset p % block_size")
    for table, bs, start, end in CASES:
        got, failed = call_answer(fn, list(table), bs, start, end, hint=hint,
                                  name="my_slot_mapping")
        if failed is not None:
            return failed
        got = list(got) if isinstance(got, list | tuple | range) else got
        if got == reference_slot_mapping(table, bs, start, end):
            continue
        why = (f"return a list of ints, not {type(got).__name__}" if not isinstance(got, list) else
               "positions below start are cached: return slots for start .. end - 1 only"
               if len(got) == end and start
               else f"{end - start} positions, {len(got)} slots: one slot per position"
               if len(got) != end - start else
               "that is the logical position: look the block up in block_table"
               if got == list(range(start, end))
               else "a block holds block_size slots: multiply the physical block id by block_size"
               if got == [table[p // bs] + p % bs for p in range(start, end)] else hint)
        return verdict(False,
                       hint=f"block table {table}, block size {bs}, positions {start}..{end - 1}: "
                            f"{why}")
    return verdict(True, "the slots of kvlab's build_batch on 4 block tables")


def isolated_generate(model: Any, prompts: Sequence[Sequence[int]],
                      max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate``, one prompt at a time, nothing shared: the capstone's
    reference."""
    import torch

    device, out = next(model.parameters()).device, []
    for p in prompts:
        ids = torch.tensor([list(p)], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, len(p):].tolist())
    return out


def check_capstone(results: Sequence[tuple[list[int], int]],
                   reference: Sequence[Sequence[int]]) -> Verdict:
    """``paged_generate``'s ``(tokens, cached prompt tokens)`` per request against isolated
    ``generate``'s tokens."""
    same, cached = ([list(tokens) == list(ref) for (tokens, _), ref in zip(results, reference)],
                    sum(c for _, c in results))
    return verdict(len(results) == len(reference) and all(same) and cached > 0,
                   f"{sum(same)}/{len(same)} requests token for token equal to isolated generate, "
                   f"with {cached} prompt tokens read from shared blocks instead of computed",
                   f"{sum(same)}/{len(same)} requests equal to isolated generate, {cached} cached "
                   "prompt tokens: a request that differs read K/V from the wrong slots (slot "
                   "mapping) or hit the wrong blocks (hash chain, allocate, append); no cached "
                   "tokens: allocate found no hit")
