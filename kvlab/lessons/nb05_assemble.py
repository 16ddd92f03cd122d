"""Notebook 05's capstone: checkers, hints and worked solutions of the slot mapping and the paged gather; the
whole (``kvlab.built.nb05.paged_generate`` on the reader's pieces) checked against isolated ``generate``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlab.lessons.common import Verdict, call_answer, verdict

__all__ = ["check_capstone", "check_gather", "check_slot_mapping", "solution_gather", "solution_slot_mapping"]


def solution_slot_mapping(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Position p's K/V lives in physical block ``block_table[p // block_size]``, at offset ``p % block_size``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def solution_gather(pages: Any, block_table: Sequence[int], length: int, block_size: int) -> Any:
    """``pages`` (num_blocks * block_size, kv_heads, D) -> the sequence's first ``length`` entries, in order."""
    return pages[solution_slot_mapping(block_table, block_size, 0, length)]  # (length, kv_heads, D)


# (block table: physical blocks anywhere, out of order; block size; start; end)
CASES = (([7, 2, 31], 4, 0, 9), ([5, 0, 12, 39], 4, 8, 13), ([17, 3, 26], 16, 35, 36), ([9, 30, 1, 22], 2, 3, 7))


def check_slot_mapping(fn: Callable[..., list[int]] | None) -> Verdict:
    """``fn(block_table, block_size, start, end)``: the K/V slot of each position in ``[start, end)``. Never raises."""
    hint = ("one slot per position p from start to end - 1: the physical block block_table[p // block_size], times "
            "block_size, plus the offset p % block_size")
    for table, bs, start, end in CASES:
        got, failed = call_answer(fn, list(table), bs, start, end, hint=hint, name="my_slot_mapping")
        if failed is not None:
            return failed
        got = list(got) if isinstance(got, list | tuple | range) else got
        if got == solution_slot_mapping(table, bs, start, end):
            continue
        why = (f"return a list of ints, not {type(got).__name__}" if not isinstance(got, list) else
               "positions below start are cached: return slots for start .. end - 1 only" if len(got) == end and start
               else f"{end - start} positions, {len(got)} slots: one slot per position" if len(got) != end - start else
               "that is the logical position: look the block up in block_table" if got == list(range(start, end))
               else "a block holds block_size slots: multiply the physical block id by block_size"
               if got == [table[p // bs] + p % bs for p in range(start, end)] else hint)
        return verdict(False, hint=f"block table {table}, block size {bs}, positions {start}..{end - 1}: {why}")
    return verdict(True, "the slots of kvlab's build_batch on 4 block tables")


def check_gather(fn: Callable[..., Any] | None) -> Verdict:
    """``fn(pages, block_table, length, block_size)``: rows of ``pages`` for positions 0 .. length - 1. Never raises."""
    import torch

    hint = ("position p sits in slot block_table[p // block_size] * block_size + p % block_size of pages: index "
            "pages with the slots of positions 0 .. length - 1 (your slot mapping gives them)")
    for table, bs, _, end in CASES:
        pages = torch.randn(40 * bs, 2, 3)  # (slots, kv_heads, head_dim)
        got, failed = call_answer(fn, pages, list(table), end, bs, hint=hint, name="my_gather")
        want = solution_gather(pages, table, end, bs)
        if failed is not None:
            return failed
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want):
            continue
        why = (f"return a tensor, not {type(got).__name__}" if not isinstance(got, torch.Tensor) else
               f"whole blocks give {got.shape[0]} rows: keep the first length = {end}" if got.shape[0] > end else
               "those are the store's first slots, not the sequence's: go through block_table"
               if torch.equal(got, pages[:end]) else hint)
        return verdict(False, hint=f"block table {table}, block size {bs}, length {end}: {why}")
    return verdict(True, "the same K/V rows as kvlab's PagedKVStore reads through 4 block tables")


def check_capstone(results: Sequence[tuple[list[int], int]], reference: Sequence[Sequence[int]]) -> Verdict:
    """``paged_generate``'s ``(tokens, cached prompt tokens)`` per request against isolated ``generate``'s tokens."""
    same, cached = [list(tokens) == list(ref) for (tokens, _), ref in zip(results, reference)], sum(c for _, c in results)
    return verdict(len(results) == len(reference) and all(same) and cached > 0,
                   f"{sum(same)}/{len(same)} requests token for token equal to isolated generate, with {cached} "
                   "prompt tokens read from shared blocks instead of computed",
                   f"{sum(same)}/{len(same)} requests equal to isolated generate, {cached} cached prompt tokens: a "
                   "request that differs read K/V from the wrong slots (slot mapping, gather) or hit the wrong blocks "
                   "(hash chain, allocate); no cached tokens: allocate found no hit")
