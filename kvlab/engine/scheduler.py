"""Continuous batching (pure Python): decodes first, preempting by recompute, then FCFS prefills (docs/engine.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache.block_manager import cdiv
from ..cache.block_pool import check
from ..cache.interface import CacheManager
from .sequence import Request, RequestStatus

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence in a step: its tokens at positions ``[start, end)`` are computed."""

    seq: Request
    start: int
    end: int
    is_prefill: bool


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs, and the block copies (copy-on-write) to do before it."""

    items: list[ScheduledSeq] = field(default_factory=list)
    cow_pairs: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(it.end - it.start for it in self.items)


class Scheduler:
    """Waiting and running queues; one ``schedule()`` per engine step."""

    def __init__(self, block_manager: CacheManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs "
                             f"(got {max_num_seqs}, {max_num_batched_tokens})")
        self.block_manager, self.max_num_seqs = block_manager, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.last_output: SchedulerOutput | None = None  # what the latest schedule() picked (a replica reports it)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ValueError`` if a request could not run even alone in an empty pool."""
        bm = self.block_manager
        need = cdiv(num_prompt_tokens + max_tokens - 1, bm.block_size)  # K/V of every token but the last generated
        if need > bm.num_blocks:
            raise ValueError(
                f"request needs {need} blocks ({num_prompt_tokens} prompt + {max_tokens} new tokens, block size "
                f"{bm.block_size}) but the pool has {bm.num_blocks}: it can never run")

    def add(self, seq: Request) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's decodes and prefills; preempt the youngest when blocks run out."""
        bm, out = self.block_manager, SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:  # 1. one decode token for each running sequence
            seq = self.running[i]
            while not bm.can_append(seq.seq_id):
                victim = self.running[-1]  # the youngest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                result = bm.append(seq.seq_id, seq.last_token)
                if result.cow is not None:
                    out.cow_pairs.append(result.cow)
                out.items.append(ScheduledSeq(seq, seq.num_tokens - 1, seq.num_tokens, False))
                budget -= 1
                i += 1
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:  # 2. admit
            seq = self.waiting[0]
            n = seq.num_tokens
            if n > budget and out.items:  # too long for what is left; a long prompt runs alone
                break
            plan = bm.can_allocate(seq.token_ids, seq.scope)
            if not plan:
                break
            cached = bm.allocate(seq.seq_id, seq.token_ids, seq.scope, plan=plan, preempted=seq.num_preemptions > 0)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            out.items.append(ScheduledSeq(seq, cached, n, True))
            budget -= n - cached
        self.last_output = out
        return out

    def _preempt(self, seq: Request) -> None:
        self.requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def fork(self, parent: Request, child: Request) -> None:
        """Run ``child`` as a copy of the running ``parent`` that shares all its blocks."""
        self.check_fork(parent)
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    @staticmethod
    def check_fork(parent: Request) -> None:
        """Raise ``ValueError`` unless ``parent`` runs and has generated a token (what ``fork`` needs)."""
        if parent.status is not RequestStatus.RUNNING or not parent.output_ids:
            raise ValueError("only a running sequence that has generated a token can be forked")

    def requeue(self, seq: Request, uncache_from: int | None = None) -> None:
        """Free a running sequence's blocks (see ``finish``) and put it first in the waiting queue, to prefill again."""
        if seq.status is not RequestStatus.RUNNING:
            raise ValueError("only a running sequence can be requeued")
        self.block_manager.free(seq.seq_id, uncache_from)
        self.running.remove(seq)
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Request, reason: str, uncache_from: int | None = None) -> None:
        """Take a sequence out of the queues for good, free its blocks (from ``uncache_from`` on: out of the cache)."""
        if seq.status is RequestStatus.RUNNING:
            self.block_manager.free(seq.seq_id, uncache_from)
            self.running.remove(seq)
        elif seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason

    def check_invariants(self) -> None:
        """Raise unless the block manager and the queues agree: every running request holds its tokens' blocks."""
        bm = self.block_manager
        bm.check_invariants()
        running = {s.seq_id for s in self.running}
        check(running == set(bm.seqs), f"running {sorted(running)} but the block manager holds {sorted(bm.seqs)}")
        for seq in self.running:
            check(seq.status is RequestStatus.RUNNING and bm.seqs[seq.seq_id].token_ids == seq.token_ids[:-1],
                  f"sequence {seq.seq_id}: its blocks hold other tokens than all but its last")
        for seq in self.waiting:
            check(seq.status is RequestStatus.WAITING and seq.seq_id not in bm.seqs,
                  f"waiting sequence {seq.seq_id} still holds blocks")
