"""Requests, tenants and the step loop around one HF causal LM (nano-vllm's ``llm_engine.py``; docs/engine.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cache.interface import CacheManager
from .config import EngineConfig
from .extras import EngineExtras, UnknownRequestError
from .fused_llama import FusedLlama
from .hooks import KVEventLog, StepRecord, default_positions, observe
from .intake import Checked, Intake, per_prompt
from .kv_store import PagedKVStore
from .models import eos_ids, model_device_dtype
from .offload import HostOffload
from .packed_linear import PackedLinears
from .paged_kernel import PagedKernel
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


@dataclass(slots=True)
class RequestOutput:
    """A request's result: tokens, text, why it stopped, cache use and timing (seconds)."""

    request_id: Hashable
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished: bool
    # "stop", "length", "abort", "error"
    finish_reason: str | None
    # prompt tokens served from the prefix cache (first admission)
    num_cached_tokens: int
    num_preemptions: int = 0
    # arrival -> first token
    ttft: float | None = None
    # arrival -> finished
    latency: float | None = None
    error: str | None = None
    # of num_cached_tokens: copied back from the host tier (evicted or fetched)
    num_restored_tokens: int = 0


class Engine(EngineExtras):
    """Paged K/V store + block manager + scheduler around one Hugging Face causal LM.

    ``add_request`` / ``abort`` / ``fork`` / ``step`` may come from several threads: each holds the engine's
    (re-entrant) lock while it changes the engine; ``generate`` calls ``add_request`` and ``step``.
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

        ``config`` (default ``EngineConfig()``) with ``overrides`` (its field names, e.g. ``num_blocks=64``)
        changed. ``cache``: "blocks", "radix", or a caller's own ``kvlab.cache.CacheManager`` (it brings its
        sizes). ``positions(item)`` numbers the tokens a scheduled item computes (``default_positions``);
        ``observers`` see one ``StepRecord`` per step (``add_step_observer``).
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
        self.scheduler = Scheduler(
            bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill
        )
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = eos_ids(model, tokenizer)
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
        # probes the model: may refuse it
        self.runner = ModelRunner(model, self.store)
        if cfg.packed_linear:
            # raises ValueError naming why where it cannot run (not CPU float32, no oneDNN)
            self.runner.packed = PackedLinears(model)
        if cfg.paged_kernel:
            # raises ValueError naming why where it cannot run (not CPU, not float32, no build)
            self.runner.kernel = PagedKernel(self.store)
        if cfg.fused_layers:
            # raises ValueError naming why where it cannot run (not Llama, hooks, not CPU float32, no build)
            self.runner.decoder = FusedLlama(model)
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
        """Queue one request (text or token ids) of ``tenant``; return its id. Bad input raises, queueing nothing.

        ``cache_salt`` (vLLM's request field) splits the tenant's cache further: the engine derives the salt
        from its secret, the tenant's scope and ``cache_salt`` (``tenants.request_salt``); the request keeps
        its tenant. ``unsafe_salt`` sets the salt itself, without a tenant (tests and teaching only).
        A refusal raises ``RequestError`` (a ``ValueError``) naming the field at fault.
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
        """Whether any request is waiting or running, or a finished output waits to be returned by ``step()``."""
        with self._lock:
            return bool(self._pending or self.scheduler.waiting or self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, sample a token per sequence; return what finished (and pending outputs)."""
        with self._lock:
            sched = self.scheduler.schedule()
            items, bm, finished = sched.items, self.block_manager, []
            # empty only when a lone sequence preempted itself
            if items:
                self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes_in_use)
                if sched.cow_pairs:
                    self.store.copy_blocks(sched.cow_pairs)
                tables = [bm.block_table(it.seq.seq_id) for it in items]
                # None: the default positions, which need no check
                positions = None
                if self.positions is not default_positions:
                    positions = [self.positions(it) for it in items]
                tokens, errors, untrusted = self.runner.compute(items, tables, positions)
                if self.observers:
                    observe(self.observers, self.num_steps, items, tables, positions, tokens)
                if errors or untrusted:
                    finished = settle(self, items, errors, untrusted)
                now = time.perf_counter()
                for item, token in zip(items, tokens):
                    seq, sp = item.seq, item.seq.sampling
                    if token is None:
                        continue
                    seq.output_ids.append(token)
                    if seq.first_token_time is None:
                        seq.first_token_time = now
                    # why it stops: an eos or stop token, or its length
                    stop = (
                        token in self.eos_ids and not sp.ignore_eos
                    ) or token in sp.stop_token_ids
                    if stop or len(seq.output_ids) >= sp.max_tokens:
                        self._finish(seq, "stop" if stop else "length", now)
                        finished.append(seq)
                self.num_steps += 1
                self.num_mixed_steps += len({it.is_prefill for it in items}) == 2
            # idle: the model is HF's own again (ModelRunner.detach)
            if not (self.scheduler.waiting or self.scheduler.running):
                self.runner.detach()
            if self.config.debug:
                self.check_invariants()
            if self.kv_events is not None:
                self.kv_events.close_batch()
            outputs, self._pending = self._pending, []
            return outputs + [self._output(s) for s in finished if s.seq_id not in self._held]

    def _finish(
        self, seq: Request, reason: str, now: float, uncache_from: int | None = None
    ) -> None:
        self.scheduler.finish(seq, reason, uncache_from)
        seq.finish_time = now
        del self.requests[seq.request_id]

    def _output(self, seq: Request) -> RequestOutput:
        """The output of ``seq`` now (finished or not); its text is the decoded output, special tokens dropped."""
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
        """Submit a list of prompts, step until they finish; outputs in prompt order (a refused one: ``"error"``).

        ``tenants``, ``cache_salts`` and ``unsafe_salts``: one per prompt, as ``add_request``'s keywords.
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
