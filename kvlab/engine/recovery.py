"""The failure path of a step: what runs only when a packed forward raised or gave NaN
(docs/engine.md).

A default step never comes here. ``recover`` runs each scheduled item alone, in order, to find the
culprits (NaN spreads to the step's other rows: 0 * NaN is NaN), so one request's failure never
reaches the others; ``settle`` ends the failed requests and sends those that read K/V the step did
not reliably write back to prefill again.
"""

from __future__ import annotations

import time
from typing import Any

from .sampling import sample

__all__ = ["describe", "recover", "settle"]


def describe(e: BaseException) -> str:
    """``"TypeError: message"``: how a failed request's error reads."""
    return f"{type(e).__name__}: {e}"


def recover(
    runner: Any, items: list, tables: list[list[int]], positions: list | None, packed: Any
) -> tuple[list[int | None], dict[int, str], set[int]]:
    """``ModelRunner.compute``'s result when the packed forward failed (``packed`` None) or gave
    NaN.

    ``packed``: the packed forward's ``(logits, top, nan)`` when it ran for a lone item (not run
    again), else None: each item runs alone. Untrusted items: their forward failed or gave NaN, or
    they read such K/V through a same-step prefix hit; the blocks from their first computed position
    on are zeroed.
    """
    bs, tokens, errors = runner.store.block_size, [None] * len(items), {}
    # untrusted items, and the blocks whose K/V this step did not reliably write
    untrusted, bad = set(), set()
    for i, it in enumerate(items):
        if bad and any(b in bad for b in tables[i][: it.start // bs]):
            untrusted.add(i)
            bad.update(tables[i][it.start // bs :])
            continue
        samples = it.samples
        try:
            if packed is not None:
                logits, top, nan = packed
            else:
                alone = None if positions is None else [positions[i]]
                logits, top, nan = runner.forward([it], [tables[i]], alone)
            if samples and nan[0]:
                raise FloatingPointError("the model's logits for this request are NaN")
        # broad on purpose: whatever this request's forward raises becomes its error, the others go
        # on
        except Exception as e:  # noqa: BLE001
            errors[i] = describe(e)
            untrusted.add(i)
            bad.update(tables[i][it.start // bs :])
            continue
        try:
            tokens[i] = sample(it.seq, logits[0], top[0], runner.eos_ids) if samples else None
        # broad on purpose, as above: its K/V is fine, only its sampling failed; it ends with this
        # error
        except Exception as e:  # noqa: BLE001
            errors[i] = describe(e)
    if bad:
        # never read again, not even as a masked or padding slot
        runner.store.clear_blocks(sorted(bad))
    return tokens, errors, untrusted


def settle(engine: Any, items: list, errors: dict[int, str], untrusted: set[int]) -> list:
    """End the items that failed (``"error"``) and requeue those that only read untrusted K/V;
    return the ended."""
    now, finished = time.perf_counter(), []
    # latest first: a block leaves the cache once nobody holds it
    for i in reversed(range(len(items))):
        seq = items[i].seq
        # the K/V of [start, end) was never (reliably) written; a prompt in chunks: nor its earlier
        # chunks', which sampled nothing, so nothing checked them
        first = seq.prefill_start if items[i].is_prefill else items[i].start
        if i in errors:
            seq.error = errors[i]
            engine._finish(seq, "error", now, first if i in untrusted else None)
            finished.append(seq)
        elif i in untrusted:
            # it read blocks a failed request never wrote: prefill it again later
            engine.scheduler.requeue(seq, first)
            if not seq.output_ids:
                # counted at its next admission instead
                seq.num_cached_tokens = None
    return finished[::-1]
