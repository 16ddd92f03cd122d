"""The engine loop: one background thread drives ``Engine.step()``; the asyncio side submits and
aborts.

The HTTP handlers run on the event loop and never call into the engine while it steps. ``submit``
and ``abort`` only append to an inbox (a lock held for a list append); the engine thread drains the
inbox between steps (``add_request``, ``abort``), runs one step, and hands each request's new tokens
to the event loop in one ``loop.call_soon_threadsafe`` per step, which puts them on the request's
``asyncio.Queue``. Streaming reads the tokens of running requests from ``engine.requests`` after the
step (``step()`` itself returns only finished outputs).

The wait queue is bounded: ``submit`` refuses (``QueueFullError``) once ``max_live`` requests are
submitted and unfinished, i.e. the engine's batch (``max_num_seqs``) plus ``max_waiting`` beyond it.

Reference: vLLM's ``AsyncLLM`` (an output handler loop feeding per-request queues) and
``v1/engine/core.py`` (the busy loop that drains an input queue, then steps).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.engine import Engine, UnknownRequestError
from ..engine.intake import RequestError
from ..engine.sampling import SamplingParams

__all__ = ["EngineRunner", "EngineStoppedError", "Job", "QueueFullError", "Update"]

log = logging.getLogger("kvlab.serve")


class QueueFullError(RuntimeError):
    """Raised by ``submit`` when the bounded wait queue is full (the server answers 503)."""


class EngineStoppedError(RuntimeError):
    """Raised by ``submit`` when the engine thread is not running (stopped, or its loop failed)."""


@dataclass(slots=True)
class Update:
    """New tokens of one request after a step, or its end (``finished``), or its refusal
    (``error``)."""

    token_ids: list[int]
    num_cached_tokens: int | None = None  # known once the request is admitted
    finished: bool = False
    finish_reason: str | None = None  # the engine's: "stop", "length", "abort", "error"
    error: str | None = None
    refused: bool = False  # add_request raised: nothing was queued
    field: str | None = None  # the refused request's offending field (RequestError.field)
    # of token_ids, when the request asked (kvlab.engine.logprobs.TokenLogprob)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # with a request's first tokens, when it asked


@dataclass(slots=True)
class Job:
    """One request inside the runner: what to add to the engine and where its updates go."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # passed to add_request and abort: the request's tenant, with or without a cache_salt
    tenant: str | None
    # passed to add_request: the engine derives the salt from it and the tenant
    cache_salt: str | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0  # output tokens already handed to the event loop
    done: bool = False  # set on the event loop when the finishing update is delivered


class EngineRunner:
    """Owns the engine's thread: ``start``/``stop``, ``submit``/``abort`` from the event loop."""

    def __init__(self, engine: Engine, max_waiting: int = 128,
                 on_step: Callable[[Engine, int], None] | None = None) -> None:
        if type(max_waiting) is not int or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.engine = engine
        self.max_live = engine.scheduler.max_num_seqs + max_waiting
        self.on_step = on_step  # (engine, inbox length), in the engine thread after each turn
        # submitted and not yet finished (touched on the event loop only)
        self.live: dict[str, Job] = {}
        self._cond = threading.Condition()
        self._adds: list[Job] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[Engine], object], asyncio.Future]] = []
        # added to the engine (touched in the engine thread only)
        self._running: dict[str, Job] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # set if the loop itself died

    # --- event-loop side -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; updates are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine thread to end after its current step and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the engine thread; raise ``QueueFullError`` when the wait queue is
        full."""
        if not self.alive or self._stop:
            raise EngineStoppedError(f"the engine loop is not running ({self.error or 'stopped'})")
        if len(self.live) >= self.max_live:
            raise QueueFullError(
                f"{len(self.live)} requests in flight, the limit is {self.max_live}"
            )
        if job.request_id in self.live:
            raise ValueError(f"request id {job.request_id!r} is already in flight")
        self.live[job.request_id] = job
        with self._cond:
            self._adds.append(job)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, or a stop string matched): the engine frees its blocks
        before the next step."""
        job = self.live.get(request_id)
        if job is None or job.done:
            return
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def call(self, fn: Callable[[Engine], object]) -> asyncio.Future:
        """Run ``fn(engine)`` in the engine thread between two steps; await the returned future for
        its result."""
        fut = asyncio.get_running_loop().create_future()
        with self._cond:
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def num_inbox(self) -> int:
        """Requests submitted but not yet handed to the engine."""
        with self._cond:
            return len(self._adds)

    def _deliver(self, updates: list[tuple[Job, Update]]) -> None:
        """On the event loop: put each update on its request's queue; forget finished requests."""
        for job, update in updates:
            if update.finished:
                job.done = True
                self.live.pop(job.request_id, None)
            job.queue.put_nowait(update)

    # --- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stop or self._adds or self._aborts or self._calls
                               or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._stop:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                updates = self._admit(adds) + self._abort(aborts)
                self._run_calls(calls)
                if self.engine.has_unfinished():
                    updates += self._step()
                if updates:
                    self._post(updates)
                if self.on_step is not None:
                    self.on_step(self.engine, self.num_inbox())
        except BaseException as e:  # the loop must not die silently: fail every request it holds
            log.exception("the engine loop failed")
            self.error = e
        finally:  # stopped or failed: end every request still held so that no handler waits forever
            with self._cond:
                pending, self._adds = self._adds + list(self._running.values()), []
                calls, self._calls = self._calls, []
                self._stop = True  # submit refuses from now on
            self._running.clear()
            for _, fut in calls:
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(
                        _settle, fut, None, EngineStoppedError("the engine loop ended")
                    )
            reason, msg = (
                ("error", f"engine loop failed: {self.error}")
                if self.error
                else ("abort", "server shutting down")
            )
            if pending:
                self._post(
                    [
                        (job, Update([], finished=True, finish_reason=reason, error=msg))
                        for job in pending
                    ]
                )

    def _run_calls(self, calls: list[tuple[Callable[[Engine], object], asyncio.Future]]) -> None:
        for fn, fut in calls:
            try:
                result, exc = fn(self.engine), None
            except Exception as e:  # handed to the caller, not the loop's problem
                result, exc = None, e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_settle, fut, result, exc)

    def _post(self, updates: list[tuple[Job, Update]]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, updates)

    def _admit(self, adds: list[Job]) -> list[tuple[Job, Update]]:
        out = []
        for job in adds:
            try:
                self.engine.add_request(
                    job.prompt_ids,
                    job.sampling,
                    request_id=job.request_id,
                    tenant=job.tenant,
                    cache_salt=job.cache_salt,
                )
            except (ValueError, TypeError) as e:
                field = e.field if isinstance(e, RequestError) else None
                out.append(
                    (
                        job,
                        Update(
                            [],
                            finished=True,
                            finish_reason="error",
                            error=str(e),
                            refused=True,
                            field=field,
                        ),
                    )
                )
                continue
            self._running[job.request_id] = job
        return out

    def _abort(self, request_ids: list[str]) -> list[tuple[Job, Update]]:
        out = []
        for rid in request_ids:
            job = self._running.pop(rid, None)
            if job is None:  # finished in the meantime (its final update is already on its way)
                continue
            try:
                res = self.engine.abort(rid, tenant=job.tenant)
            except UnknownRequestError:
                continue
            lp, plp = _logprobs(res, job.sent)
            new, job.sent = res.output_ids[job.sent:], len(res.output_ids)
            out.append(
                (
                    job,
                    Update(
                        new, res.num_cached_tokens, True, "abort", logprobs=lp, prompt_logprobs=plp
                    ),
                )
            )
        return out

    def _step(self) -> list[tuple[Job, Update]]:
        finished = {o.request_id: o for o in self.engine.step()}
        now_live = self.engine.requests
        out = []
        for rid in list(self._running):
            job = self._running[rid]
            res = finished.get(rid)
            if res is not None:
                del self._running[rid]
                lp, plp = _logprobs(res, job.sent)
                new, job.sent = res.output_ids[job.sent:], len(res.output_ids)
                out.append(
                    (
                        job,
                        Update(
                            new,
                            res.num_cached_tokens,
                            True,
                            res.finish_reason,
                            res.error,
                            logprobs=lp,
                            prompt_logprobs=plp,
                        ),
                    )
                )
                continue
            seq = now_live.get(rid)
            if seq is not None and len(seq.output_ids) > job.sent:
                lp, plp = _logprobs(seq, job.sent)
                new, job.sent = seq.output_ids[job.sent:], len(seq.output_ids)
                out.append(
                    (
                        job,
                        Update(list(new), seq.num_cached_tokens, logprobs=lp, prompt_logprobs=plp),
                    )
                )
        return out


def _logprobs(res, sent: int) -> tuple[list | None, list | None]:
    """A request's log-probability records past ``sent`` output tokens, and its prompt's with its
    first tokens."""
    lp = None if res.logprobs is None else list(res.logprobs[sent:])
    plp = None if sent or res.prompt_logprobs is None else list(res.prompt_logprobs)
    return lp, plp


def _settle(fut: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


def new_request_id(prefix: str = "cmpl") -> str:
    """A fresh request id like vLLM's (``cmpl-<hex>``)."""
    import uuid

    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> float:
    """The clock every latency in kvlab.serve is measured on (``time.perf_counter``)."""
    return time.perf_counter()
