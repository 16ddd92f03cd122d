"""Requests, tenants and the step loop around one HF causal LM (nano-vllm's ``llm_engine.py``;
docs/engine.md).

``step`` is schedule -> run -> postprocess. Off the step: abort and fork, public prefixes, stats,
KV-event retrieval, cache reset and ``check_invariants`` (run after every step of a ``debug``
engine).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from ..cache.interface import CacheManager
from ..cache.kv_events import EventBatch
from . import admin
from .config import EngineConfig
from .errors import UnknownRequestError
from .hooks import KVEventLog, StepRecord, default_positions, observe
from .intake import Checked, Intake, per_prompt
from .invariants import check_engine
from .kv_store import PagedKVStore
from .models import eos_ids, model_device_dtype
from .offload import HostOffload
from .outputs import RequestOutput
from .radix_adapter import engine_cache
from .recovery import settle
from .runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Request, RequestStatus

__all__ = [
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StepRecord",
    "UnknownRequestError",
    "default_positions",
]


class Engine:
    """Paged K/V store + block manager + scheduler around one Hugging Face causal LM.

    ``add_request`` / ``abort`` / ``fork`` / ``step`` may come from several threads: each holds the
    engine's (re-entrant) lock while it changes the engine; ``generate`` calls ``add_request`` and
    ``step``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        *,
        cache: str | CacheManager | None = None,
        positions: Callable[[ScheduledSeq], range] = default_positions,
        observers: Iterable[Callable[[StepRecord], None]] = (),
        **overrides: Any,
    ) -> None:
        """Build the cache, K/V store, scheduler and runner around ``model``.

        ``config`` (default ``EngineConfig()``) with ``overrides`` (its field names, e.g.
        ``num_blocks=64``) changed. ``cache``: "blocks", "radix", or a caller's own
        ``kvlab.cache.CacheManager`` (it brings its sizes). ``positions(item)`` numbers the tokens a
        scheduled item computes (``default_positions``); ``observers`` see one ``StepRecord`` per
        step (``add_step_observer``).
        """
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig or None, got {type(config).__name__}")
        if isinstance(cache, str):
            overrides["cache"] = cache
        self.config = cfg = (config or EngineConfig()).replace(**overrides)
        self.model, self.tokenizer = model, tokenizer
        self.isolation = cfg.isolation
        self.positions, self.observers = positions, list(observers)
        self.device, self.dtype = model_device_dtype(model)
        self.block_manager = bm = engine_cache(model, tokenizer, cfg, cache)
        self.store = PagedKVStore.for_model(model, bm.num_blocks, bm.block_size)
        self.host_tier = None
        if cfg.host_tier_bytes is not None:
            self.host_tier = HostOffload(
                self.store, bm, cfg.host_tier_bytes, offload=cfg.offload_evicted
            )
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = eos_ids(model, tokenizer)
        self.scheduler = Scheduler(
            bm,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.enable_chunked_prefill,
            eos_ids=frozenset(self.eos_ids),
        )
        # unfinished requests by id
        self.requests: dict[Hashable, Request] = {}
        # mixed: steps that ran prefills and decodes together
        self.num_steps = self.num_mixed_steps = self.peak_kv_bytes = 0
        self._lock = threading.RLock()
        # finished during a generate() that did not own them
        self._pending: list[RequestOutput] = []
        # seq ids whose outputs a running generate() collects itself
        self._held: set[int] = set()
        self.kv_events = KVEventLog(bm) if cfg.enable_kv_events else None
        if self.kv_events is not None:
            # one more step observer: each step's events become one batch
            self.observers.append(self.kv_events)
        # probes the model: may refuse it
        self.runner = ModelRunner(model, self.store)
        # what a request's min_tokens holds back
        self.runner.eos_ids = frozenset(self.eos_ids)
        if cfg.accelerator is not None:
            # the speed paths; raises ValueError naming why one cannot run
            # (kvlab.engine.accelerator)
            self.runner.accelerate(cfg.accelerator.bind(model, self.store))
        vocab_size, fits = model.config.vocab_size, self.scheduler.check_fits
        self.intake = Intake(tokenizer, vocab_size, self.max_model_len, fits, cfg, self.device)

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: Hashable | None = None,
        tenant: str | None = None,
        *,
        cache_salt: str | None = None,
        unsafe_salt: str | None = None,
    ) -> Hashable:
        """Queue one request (text or token ids) of ``tenant``; return its id. Bad input raises,
        queueing nothing.

        ``cache_salt`` (vLLM's request field) splits the tenant's cache further: the engine derives
        the salt from its secret, the tenant's scope and ``cache_salt`` (``tenants.request_salt``);
        the request keeps its tenant. ``unsafe_salt`` sets the salt itself, without a tenant (tests
        and teaching only). A refusal raises ``RequestError`` (a ``ValueError``) naming the field at
        fault.
        """
        # checked before the lock: tokenizing never stalls a step
        checked = self.intake.check(prompt, sampling, tenant, cache_salt, unsafe_salt)
        with self._lock:
            return self._queue(checked, request_id).request_id

    def _queue(self, checked: Checked, request_id: Hashable | None) -> Request:
        seq = self.intake.admit(checked, request_id, self.requests)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or a finished output waits to be returned by
        ``step()``."""
        with self._lock:
            return bool(self._pending or self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, postprocess; return what finished (and pending
        outputs)."""
        with self._lock:
            bm, scheduled = self.block_manager, self.scheduler.schedule()
            items, finished = scheduled.items, []
            # empty only when a lone sequence preempted itself
            if items:
                self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes_in_use)
                if scheduled.cow_pairs:
                    self.store.copy_blocks(scheduled.cow_pairs)
                tables = [bm.block_table(it.seq.seq_id) for it in items]
                # None: the default positions, which need no check
                positions = None
                if self.positions is not default_positions:
                    positions = [self.positions(it) for it in items]
                tokens, errors, untrusted = self.runner.compute(items, tables, positions)
                # a failed item ends with "error"; one that read K/V a failed item never wrote
                # prefills again
                if errors or untrusted:
                    finished = settle(self, items, errors, untrusted)
                finished += self.scheduler.postprocess(items, tokens, time.perf_counter())
                if self.observers:
                    observe(self.observers, self.num_steps, items, tables, positions, tokens)
                self.num_steps += 1
                self.num_mixed_steps += len({it.is_prefill for it in items}) == 2
            for seq in finished:
                self.requests.pop(seq.request_id, None)
            # idle: the model is HF's own again (ModelRunner.detach)
            if not self.scheduler.has_unfinished():
                self.runner.detach()
            if self.config.debug:
                self.check_invariants()
            outputs, self._pending = self._pending, []
            return outputs + [self._output(s) for s in finished if s.seq_id not in self._held]

    def _finish(
        self, seq: Request, reason: str, now: float, uncache_from: int | None = None
    ) -> None:
        self.scheduler.finish(seq, reason, uncache_from)
        seq.finish_time = now
        del self.requests[seq.request_id]

    def _output(self, seq: Request) -> RequestOutput:
        """The output of ``seq`` now (finished or not); its text is the decoded output, special
        tokens dropped."""
        tok, t0, first, done = (
            self.tokenizer,
            seq.arrival_time,
            seq.first_token_time,
            seq.finish_time,
        )
        return RequestOutput(
            seq.request_id,
            list(seq.prompt_ids),
            list(seq.output_ids),
            "" if tok is None else tok.decode(seq.output_ids, skip_special_tokens=True),
            seq.status is RequestStatus.FINISHED,
            seq.finish_reason,
            seq.num_cached_tokens or 0,
            seq.num_preemptions,
            None if first is None else first - t0,
            None if done is None else done - t0,
            seq.error,
            seq.num_restored_tokens or 0,
            None if seq.logprobs is None else list(seq.logprobs),
            None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        tenants: Sequence[str | None] | None = None,
        *,
        cache_salts: Sequence[str | None] | None = None,
        unsafe_salts: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Submit a list of prompts, step until they finish; outputs in prompt order (a refused one:
        ``"error"``).

        ``tenants``, ``cache_salts`` and ``unsafe_salts``: one per prompt, as ``add_request``'s
        keywords.
        """
        batch = per_prompt(prompts, sampling, tenants, cache_salts, unsafe_salts)
        # this call's requests, and the outputs of its refused prompts, by prompt index
        own: dict[int, Request] = {}
        refused: dict[int, RequestOutput] = {}
        try:
            for i, (prompt, sp, tenant, cache_salt, unsafe_salt) in enumerate(batch):
                try:
                    # tokenized without the lock
                    checked = self.intake.check(prompt, sp, tenant, cache_salt, unsafe_salt)
                    # held from the queueing to the claim: no other step() can return its output
                    with self._lock:
                        own[i] = self._queue(checked, None)
                        self._held.add(own[i].seq_id)
                # refused before queueing (bad input): finished, finish_reason "error"
                except (ValueError, TypeError) as e:
                    ok = isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt)
                    ids = list(prompt) if ok else []
                    refused[i] = RequestOutput(None, ids, [], "", True, "error", 0, error=str(e))
            while True:
                with self._lock:
                    if all(seq.status is RequestStatus.FINISHED for seq in own.values()):
                        break
                    # others' outputs (and earlier pending ones): for the next step()
                    self._pending = self.step()
        except BaseException:
            # this call returns nothing: hand what finished to the next step() instead
            with self._lock:
                done = [seq for seq in own.values() if seq.status is RequestStatus.FINISHED]
                self._pending.extend(map(self._output, done))
            raise
        finally:
            with self._lock:
                self._held.difference_update(seq.seq_id for seq in own.values())
        return [self._output(own[i]) if i in own else refused[i] for i in range(len(batch))]

    @property
    def kv_bytes_in_use(self) -> int:
        """K/V bytes of the blocks referenced by live sequences now."""
        bm = self.block_manager
        return (bm.num_blocks - bm.num_free_blocks) * self.store.bytes_per_block

    # --- off the step: requests, tenants, observers, stats ----------------------------------------
    def abort(self, request_id: Hashable, *, tenant: str | None = None) -> RequestOutput:
        """Stop an unfinished request of ``tenant`` (the one it was added with) now and free its
        blocks."""
        with self._lock:
            seq = admin.get_request(self, request_id, tenant)
            self._finish(seq, "abort", time.perf_counter())
            return self._output(seq)

    def fork(
        self,
        request_id: Hashable,
        child_id: Hashable | None = None,
        sampling: SamplingParams | None = None,
        *,
        tenant: str | None = None,
    ) -> Hashable:
        """Continue a running request of ``tenant`` as two sharing every block; a refused fork
        changes nothing.

        The child (``child_id``, or an automatic id) has its own ids, ``sampling`` (default: the
        parent's) and generator; its scope, tokens and timing are the parent's
        (``kvlab.cache.fork``: copy-on-write).
        """
        with self._lock:
            return admin.fork(self, request_id, child_id, sampling, tenant)

    def add_public_prefix(self, prefix: str | Sequence[int]) -> int:
        """Register an operator prefix (e.g. a system prompt) every tenant may share; return its
        tokens."""
        # tokenized before the lock, as in add_request
        ids = self.intake.check_prefix(prefix)
        with self._lock:
            return self.intake.add_public_prefix(ids)

    def salt_for(self, tenant: str | None) -> str | None:
        """The cache salt the engine gives ``tenant`` under its policy (None under "shared")."""
        return self.intake.salt_for(tenant)

    def add_step_observer(self, observer: Callable[[StepRecord], None]) -> None:
        """Call ``observer(record)`` once per step from now on, after the forward (a
        ``StepRecord``)."""
        self.observers.append(observer)

    def take_kv_events(self) -> list[EventBatch]:
        """The KV-event batches since the last call, oldest first (for a router:
        ``kvlab.cluster.router``)."""
        with self._lock:
            return [] if self.kv_events is None else self.kv_events.take()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused, False, while a request holds blocks); emits
        ``AllBlocksCleared``."""
        # the radix cache raises NotImplementedError
        with self._lock:
            return self.block_manager.reset_prefix_cache()

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (and later recomputed) so far."""
        return self.scheduler.num_preemptions

    def stats(self) -> dict[str, Any]:
        """Engine-wide numbers: hit rate, KV bytes in use and peak, preemptions, steps,
        block-manager stats."""
        with self._lock:
            return admin.stats(self)

    def check_invariants(self) -> None:
        """Raise unless the block manager, the queues and the request table agree
        (``invariants.check_engine``)."""
        with self._lock:
            check_engine(self)
