"""Replay a trace of requests through a cache on the real ``Scheduler``, tokens scripted instead of
sampled (no torch).

A model-free engine: ``ScriptedScheduler`` is ``Engine.step``'s bookkeeping without the forward.
Each step the real ``Scheduler`` picks decodes and prefills on any ``kvlab.cache.CacheManager``
(``BlockManager``, ``RadixCache``), then every scheduled sequence "generates" the next token of its
scripted reply; a sequence that has generated its whole reply finishes and frees its blocks. As in
the engine, K/V is written for the prompt and every generated token but the last; a prompt that
needs more blocks than are free waits, a decode that finds none preempts the youngest sequence
(recompute).

``replay_trace`` drives a whole trace: requests (``req_id``, ``prompt``, ``output``, optional
``cache_salt`` and ``after``: the request whose end it waits for, e.g. the previous turn of a
conversation) arrive in trace order. With ``reserve=True`` a request reaches the scheduler's queue
only when the free blocks, less those promised to the requests already running, cover its prompt and
whole reply, so nothing is ever preempted (a trace replay's usual setting); with ``reserve=False``
every ready request queues at once and the scheduler decides. The result holds per request the
prompt tokens the cache served at its first admission, and the step count, pool peak and mean wasted
slots of the run.

Used by the teaching traces' replay and the cluster simulator's ``SimReplica``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..cache.block_manager import cdiv
from ..cache.interface import CacheManager, TenantScope
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request

__all__ = ["ReplayResult", "ScriptedScheduler", "ScriptedStep", "TraceRequest", "replay_trace"]

# a token budget no trace reaches: only blocks and max_num_seqs limit a step
UNLIMITED_TOKENS = 1 << 30


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: its prompt, the reply it will generate, a tenant salt, the request it
    follows."""

    req_id: Hashable
    prompt: list[int]
    output: list[int]
    cache_salt: str | None = None
    after: Hashable | None = None


@dataclass(slots=True)
class ScriptedStep:
    """What one step ran (the scheduler's output), who got a first token, who finished (blocks
    freed)."""

    output: SchedulerOutput
    # blocks not free once the step was scheduled (before its finished sequences free theirs)
    blocks_used: int = 0
    first_token: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed in this step (cache hits excluded)."""
        return sum(it.end - it.start for it in self.output.items if it.is_prefill)

    @property
    def decodes(self) -> int:
        """Sequences that decoded one token in this step."""
        return sum(not it.is_prefill for it in self.output.items)


class ScriptedScheduler:
    """The real ``Scheduler`` on a cache, each sequence's tokens taken from its scripted reply."""

    def __init__(
        self, cache: CacheManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048
    ) -> None:
        self.cache = cache
        self.scheduler = Scheduler(cache, max_num_seqs, max_num_batched_tokens)
        # in flight, by request id
        self.requests: dict[Hashable, Request] = {}
        self._replies: dict[int, list[int]] = {}
        self._next_id = 0

    def add(
        self,
        request_id: Hashable,
        prompt: Iterable[int],
        reply: Iterable[int],
        *,
        cache_salt: str | None = None,
        tenant: object = None,
        public_tokens: int = 0,
    ) -> Request:
        """Queue a request that will generate exactly ``reply`` (at least one token); its
        ``Request``."""
        prompt, reply = list(prompt), list(reply)
        if not prompt or not reply:
            raise ValueError(f"request {request_id!r} needs a non-empty prompt and reply")
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        self.scheduler.check_fits(len(prompt), len(reply))
        # a sequence the caller put in the cache itself keeps its id
        while self._next_id in self.cache.seqs:
            self._next_id += 1
        scope = TenantScope(cache_salt, public_tokens, tenant)
        seq = Request(
            self._next_id,
            request_id,
            prompt,
            SamplingParams(max_tokens=len(reply), ignore_eos=True),
            scope,
        )
        self._next_id += 1
        self.requests[request_id] = seq
        self._replies[seq.seq_id] = reply
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> ScriptedStep:
        """One engine step: schedule, one scripted token per scheduled sequence, finish the complete
        ones."""
        out = self.scheduler.schedule()
        res = ScriptedStep(out, self.cache.num_blocks - self.cache.num_free_blocks)
        for item in out.items:
            seq = item.seq
            # a chunk of a prompt: no token yet
            if not item.samples:
                continue
            seq.output_ids.append(self._replies[seq.seq_id][len(seq.output_ids)])
            if len(seq.output_ids) == 1:
                res.first_token.append(seq)
            if len(seq.output_ids) >= seq.sampling.max_tokens:
                self.scheduler.finish(seq, "length")
                del self.requests[seq.request_id], self._replies[seq.seq_id]
                res.finished.append(seq)
        return res


@dataclass
class ReplayResult:
    """Per request (by ``req_id``): prompt tokens and those the cache served at first admission; run
    totals."""

    prompt_tokens: dict[Hashable, int]
    cached_tokens: dict[Hashable, int]
    steps: int
    # most ``ScriptedStep.blocks_used`` of any step
    peak_blocks_used: int
    # per step: empty slots in the last block of each scheduled sequence, summed
    wasted_slots_mean: float
    num_preemptions: int

    @property
    def query_tokens(self) -> int:
        """Prompt tokens of every request."""
        return sum(self.prompt_tokens.values())

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from the cache, over every request's first admission."""
        return sum(self.cached_tokens.values())

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0 for an empty trace)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _need(r: Any, block_size: int) -> int:
    """Blocks a request holds at its end: K/V of its prompt and of every reply token but the
    last."""
    return cdiv(len(r.prompt) + len(r.output) - 1, block_size)


def replay_trace(
    cache: CacheManager,
    requests: Iterable[Any],
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = UNLIMITED_TOKENS,
    reserve: bool = True,
) -> ReplayResult:
    """Run every request of a trace to completion through ``cache`` on the real scheduler (see the
    module docstring).

    ``requests``: objects with ``req_id``, ``prompt``, ``output`` and optionally ``cache_salt`` and
    ``after`` (``TraceRequest`` or a subclass). ``ValueError`` if a request could never fit the
    pool.
    """
    reqs = list(requests)
    bs, n_blocks = cache.block_size, cache.num_blocks
    ids = [r.req_id for r in reqs]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    too_big = [r.req_id for r in reqs if _need(r, bs) > n_blocks]
    if too_big:
        raise ValueError(f"requests {too_big[:3]} need more blocks than the pool has ({n_blocks})")
    known = set(ids)
    ready: deque[Any] = deque(r for r in reqs if getattr(r, "after", None) not in known)
    blocked: dict[Hashable, list[Any]] = {}
    for r in reqs:
        if getattr(r, "after", None) in known:
            blocked.setdefault(r.after, []).append(r)
    run = ScriptedScheduler(cache, max_num_seqs, max_num_batched_tokens)
    # seq id -> blocks it holds at its end (for the reservation)
    need: dict[int, int] = {}
    cached: dict[Hashable, int] = {}
    steps = peak = wasted = 0
    while ready or run.has_unfinished():
        while ready and (not reserve or _fits(run, need, _need(ready[0], bs), max_num_seqs)):
            r = ready.popleft()
            seq = run.add(r.req_id, r.prompt, r.output, cache_salt=getattr(r, "cache_salt", None))
            need[seq.seq_id] = _need(r, bs)
        if not run.has_unfinished():
            # cannot happen: each fits the pool alone
            raise RuntimeError("no request can be admitted")
        step = run.step()
        steps += 1
        peak = max(peak, step.blocks_used)
        wasted += sum(-it.end % bs for it in step.output.items)
        for seq in step.output.items:
            if seq.is_prefill and seq.seq.request_id not in cached:
                cached[seq.seq.request_id] = seq.seq.num_cached_tokens or 0
        for seq in step.finished:
            del need[seq.seq_id]
            ready.extend(blocked.pop(seq.request_id, ()))
    return ReplayResult(
        {r.req_id: len(r.prompt) for r in reqs},
        cached,
        steps,
        peak,
        wasted / max(steps, 1),
        run.scheduler.num_preemptions,
    )


def _fits(run: ScriptedScheduler, need: dict[int, int], blocks: int, max_num_seqs: int) -> bool:
    """Whether one more request of ``blocks`` blocks can queue without risking a preemption."""
    sched = run.scheduler
    if len(sched.running) + len(sched.waiting) >= max_num_seqs:
        return False
    promised = sum(need[s.seq_id] - len(run.cache.block_table(s.seq_id)) for s in sched.running)
    promised += sum(need[s.seq_id] for s in sched.waiting)
    return run.cache.num_free_blocks - promised >= blocks
