"""Continuous batching (pure Python): decodes and prompt chunks first, preempting by recompute, then
FCFS prefills under one token budget per step; ``postprocess`` appends the sampled tokens and
finishes what stops (nano-vllm's ``scheduler.py``; docs/engine.md)."""

from __future__ import annotations

from collections import deque

from ..cache.block_manager import cdiv
from ..cache.interface import CacheManager
from .errors import RequestError
from .invariants import check_scheduler
from .scheduler_output import ScheduledSeq, SchedulerOutput
from .sequence import Request, RequestStatus

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Waiting and running queues; one ``schedule()`` per engine step.

    ``enable_chunked_prefill`` (vLLM V1's default, on): a prompt longer than what is left of the
    step's token budget is computed in chunks over several steps, beside the running decodes,
    instead of in a step of its own; an item whose ``samples`` is False is such a chunk (the
    step samples no token for it).

    The block manager caches a prompt's full blocks when it allocates them, before their K/V is
    written (safe within a step: a step writes before it reads). A chunk ends before its sequence's
    tokens only when it takes the rest of the step's budget, and running sequences are scheduled
    before any admission, so no request is ever admitted (and hits) while a prompt's cached blocks
    are unwritten; a sequence preempted or finished half-way takes its unwritten blocks out of the
    cache (``finish``).
    """

    # the default of every new scheduler (an engine's, a replay's): on, as in vLLM V1
    enable_chunked_prefill: bool = True

    def __init__(
        self,
        block_manager: CacheManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool | None = None,
        *,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        """``eos_ids``: the tokens that end a sequence (unless its ``ignore_eos``) in
        ``postprocess``."""
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                "need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs "
                f"(got {max_num_seqs}, {max_num_batched_tokens})"
            )
        self.block_manager, self.max_num_seqs = block_manager, max_num_seqs
        self.eos_ids = frozenset(eos_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        if enable_chunked_prefill is not None:
            self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.waiting: deque[Request] = deque()
        # admission order: oldest first
        self.running: list[Request] = []
        self.num_preemptions = 0
        # what the latest schedule() picked (a replica reports it)
        self.last_output: SchedulerOutput | None = None

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``RequestError`` (a ``ValueError``) if a request could not run even alone in an
        empty pool.

        Its field is "prompt" when the prompt alone does not fit, else "max_tokens".
        """
        bm = self.block_manager
        # K/V of every token but the last generated
        need = cdiv(num_prompt_tokens + max_tokens - 1, bm.block_size)
        if need > bm.num_blocks:
            # the prompt alone, with one token to generate
            alone = cdiv(num_prompt_tokens, bm.block_size)
            field = "prompt" if alone > bm.num_blocks else "max_tokens"
            raise RequestError(
                field,
                f"request needs {need} blocks ({num_prompt_tokens} prompt + {max_tokens} new "
                f"tokens, block size {bm.block_size}) but the pool has {bm.num_blocks}: it can "
                "never run",
            )

    def add(self, seq: Request) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def is_prefilling(self, seq: Request) -> bool:
        """Whether a running sequence holds blocks for tokens not computed yet (a prompt in
        chunks)."""
        return seq.num_computed_tokens < self.block_manager.num_allocated_tokens(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's decodes, prefill chunks and prefills; preempt the youngest when blocks
        run out."""
        bm, out, running = self.block_manager, SchedulerOutput(), self.running
        budget, i = self.max_num_batched_tokens, 0
        # 1. running: a decode token, or the next chunk of a prompt
        while i < len(running) and budget > 0:
            seq = running[i]
            n, start = seq.num_tokens, seq.num_computed_tokens
            # its blocks are allocated: compute the next chunk
            if self.is_prefilling(seq):
                end = min(n, start + budget)
                out.items.append(ScheduledSeq(seq, start, end, True, end == n))
            else:
                while not bm.can_append(seq.seq_id):
                    # the youngest
                    victim = running[-1]
                    self.preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                else:
                    cow = bm.append(seq.seq_id, (seq.output_ids or seq.prompt_ids)[-1]).cow
                    if cow is not None:
                        out.cow_pairs.append(cow)
                    out.items.append(ScheduledSeq(seq, n - 1, n, False, True))
                    start, end = n - 1, n
                if seq.status is not RequestStatus.RUNNING:
                    continue
            seq.num_computed_tokens = end
            budget -= end - start
            i += 1
        chunked = self.enable_chunked_prefill
        # 2. admit
        while (
            self.waiting and not out.preempted and len(running) < self.max_num_seqs and budget > 0
        ):
            seq = self.waiting[0]
            ids = seq.token_ids
            # too long for what is left; a long prompt runs alone
            if len(ids) > budget and out.items and not chunked:
                break
            plan = bm.can_allocate(ids, seq.scope)
            if not plan:
                break
            preempted = seq.num_preemptions > 0
            cached = bm.allocate(seq.seq_id, ids, seq.scope, plan=plan, preempted=preempted)
            if seq.num_cached_tokens is None:
                # of those, copied back from a second tier (kvlab.cache.CacheSeq)
                restored = bm.num_restored_tokens(seq.seq_id)
                seq.num_cached_tokens, seq.num_restored_tokens = cached, restored
            seq.prefill_start = cached
            self.waiting.popleft()
            seq.status = RequestStatus.RUNNING
            running.append(seq)
            end = min(len(ids), cached + budget) if chunked else len(ids)
            out.items.append(ScheduledSeq(seq, cached, end, True, end == len(ids)))
            seq.num_computed_tokens = end
            budget -= end - cached
        self.last_output = out
        return out

    def preempt(self, seq: Request) -> None:
        """Take a running sequence's blocks back and queue it first, to prefill again; count it."""
        self.requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, seq: Request, uncache_from: int | None = None) -> None:
        """Free a running sequence's blocks (see ``finish``) and put it first in the waiting queue,
        to prefill again."""
        # both callers requeue a sequence this step scheduled: a running one
        self.finish(seq, None, uncache_from)
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Request, reason: str | None, uncache_from: int | None = None) -> None:
        """Take a sequence out of the queues for good, free its blocks (from ``uncache_from`` on:
        out of the cache).

        A running sequence's blocks past its computed tokens (a prompt in chunks) leave the cache
        too: they were cached at allocation and never written, so no request may hit them later.
        """
        if seq.status is RequestStatus.RUNNING:
            computed = seq.num_computed_tokens
            if self.is_prefilling(seq):
                uncache_from = computed if uncache_from is None else min(uncache_from, computed)
            self.block_manager.free(seq.seq_id, uncache_from)
            seq.num_computed_tokens = 0
            self.running.remove(seq)
        elif seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason

    def postprocess(
        self, items: list[ScheduledSeq], tokens: list[int | None], now: float
    ) -> list[Request]:
        """Append each item's sampled token (None: a prompt chunk or a failed item); finish and
        return the sequences that stop (an eos or stop token) or reach ``max_tokens``."""
        finished = []
        for item, token in zip(items, tokens):
            seq, sp = item.seq, item.seq.sampling
            if token is None:
                continue
            seq.output_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            stop = (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids
            if stop or len(seq.output_ids) >= sp.max_tokens:
                self.finish(seq, "stop" if stop else "length")
                seq.finish_time = now
                finished.append(seq)
        return finished

    def fork(self, parent: Request, child: Request) -> None:
        """Run ``child`` as a copy of the running ``parent`` that shares all its blocks
        (``check_fork`` first)."""
        self.check_fork(parent)
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = RequestStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    def check_fork(self, parent: Request) -> None:
        """Raise ``ValueError`` unless ``parent`` runs, has generated a token and is not
        mid-prefill."""
        if (
            parent.status is not RequestStatus.RUNNING
            or not parent.output_ids
            or self.is_prefilling(parent)
        ):
            raise ValueError(
                "only a running sequence that has generated a token (and is not being prefilled "
                "again "
                "after a preemption) can be forked"
            )

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def check_invariants(self) -> None:
        """Raise unless the block manager and the queues agree
        (``kvlab.engine.invariants.check_scheduler``)."""
        check_scheduler(self)
