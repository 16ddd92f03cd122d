"""Notebook 05's capstone: checkers, hints and worked solutions of the slot mapping and the paged gather.

The reader's pieces (notebook 04's hash chain and ``allocate``, and here ``my_slot_mapping`` and ``my_gather``)
run in notebook 05's ``#| export`` cells (``kvlab.built.nb05``: ``YourManager``, ``paged_attention``,
``paged_generate``); this module checks each piece on fixed cases and the whole against isolated ``generate``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from kvlab.cache import cdiv
from kvlab.lessons.common import Verdict, call_answer, verdict

__all__ = ["check_capstone", "check_gather", "check_slot_mapping", "solution_gather", "solution_slot_mapping"]


def solution_slot_mapping(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Position p's K/V lives in physical block ``block_table[p // block_size]``, at offset ``p % block_size``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def solution_gather(pages: Any, block_table: Sequence[int], length: int, block_size: int) -> Any:
    """``pages`` (num_blocks * block_size, kv_heads, D) -> the sequence's first ``length`` entries, in order."""
    return pages[solution_slot_mapping(block_table, block_size, 0, length)]  # (length, kv_heads, D)


def _tables(seed: int) -> list[tuple[list[int], int, int, int]]:
    rng = random.Random(seed)  # physical blocks anywhere, out of order: (table, block size, start, end)
    return [(rng.sample(range(40), cdiv(end, bs)), bs, start, end)
            for bs, start, end in ((4, 0, 9), (4, 8, 13), (16, 35, 36), (2, 3, 7))]


def check_slot_mapping(fn: Callable[..., list[int]] | None) -> Verdict:
    """``fn(block_table, block_size, start, end)``: the K/V slot of each position in ``[start, end)``. Never raises."""
    hint = ("one slot per position p from start to end - 1: the physical block block_table[p // block_size], times "
            "block_size, plus the offset p % block_size")
    for table, bs, start, end in _tables(5):
        want = solution_slot_mapping(table, bs, start, end)
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
        elif got == list(range(start, end)):
            why = "that is the logical position: look the block up in block_table (logical -> physical)"
        elif got == [table[p // bs] + p % bs for p in range(start, end)]:
            why = "a block holds block_size slots: multiply the physical block id by block_size"
        return verdict(False, hint=f"block table {table}, block size {bs}, positions {start}..{end - 1}: {why}")
    return verdict(True, "the slots of kvlab's build_batch on 4 block tables")


def check_gather(fn: Callable[..., Any] | None) -> Verdict:
    """``fn(pages, block_table, length, block_size)``: rows of ``pages`` for positions 0 .. length - 1. Never raises."""
    import torch

    hint = ("position p sits in slot block_table[p // block_size] * block_size + p % block_size of pages: index "
            "pages with the slots of positions 0 .. length - 1 (your slot mapping gives them)")
    for table, bs, _, end in _tables(6):
        pages = torch.randn(40 * bs, 2, 3)  # (slots, kv_heads, head_dim)
        want = solution_gather(pages, table, end, bs)
        got, failed = call_answer(fn, pages, list(table), end, bs, hint=hint, name="my_gather")
        if failed is not None:
            return failed
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want):
            continue
        why = hint
        if not isinstance(got, torch.Tensor):
            why = f"return a tensor, not {type(got).__name__}"
        elif got.shape[1:] != want.shape[1:] or got.shape[0] not in (end, cdiv(end, bs) * bs):
            why = f"expected shape {tuple(want.shape)} (length, kv_heads, head_dim), got {tuple(got.shape)}"
        elif got.shape[0] != end:
            why = f"whole blocks give {got.shape[0]} rows: keep the first length = {end}"
        elif torch.equal(got, pages[:end]):
            why = "those are the first slots of the store, not the sequence's: go through block_table"
        return verdict(False, hint=f"block table {table}, block size {bs}, length {end}: {why}")
    return verdict(True, "the same K/V rows as kvlab's PagedKVStore.read on 4 block tables")


def check_capstone(results: Sequence[tuple[list[int], int]], reference: Sequence[Sequence[int]]) -> Verdict:
    """The capstone: ``paged_generate``'s ``(tokens, cached prompt tokens)`` per request against isolated ``generate``."""
    same = [list(tokens) == list(ref) for (tokens, _), ref in zip(results, reference)]
    cached = sum(c for _, c in results)
    ok = len(results) == len(reference) and all(same) and cached > 0
    return verdict(ok, f"{sum(same)}/{len(same)} requests token for token equal to isolated generate, with "
                       f"{cached} prompt tokens read from shared blocks instead of computed",
                   f"{sum(same)}/{len(same)} requests equal to isolated generate, {cached} cached prompt tokens: "
                   "a request that differs read K/V from the wrong slots (slot mapping, gather) or hit the wrong "
                   "blocks (hash chain, allocate); no cached tokens: allocate found no hit")
