"""A small paged inference engine on real Hugging Face weights: continuous batching + prefix caching.

    engine = Engine(model, tokenizer, num_blocks=256, block_size=16, enable_prefix_caching=True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))   # or add_request(...) + step()

One ``step()``: the scheduler picks decodes and prefills (preempting when blocks run out), copy-on-write
pairs are copied in the K/V store, the new tokens of all scheduled sequences run through the model in
**one** packed forward (paged attention reads each sequence's cached K/V through its block table), and
one token is sampled per sequence from its last position's logits. Greedy is argmax; sampling uses a
per-request generator seeded from the request's seed, so outputs do not depend on batching.

Tenants: ``add_request(..., tenant="acme")``. Under ``isolation="tenant"`` or ``"public-prefix"`` the
engine derives the tenant's cache salt from the tenant id and its server ``secret`` (HMAC-SHA256,
``kvlab.engine.tenants``); a request cannot choose or forge a salt. ``"public-prefix"`` shares the whole blocks
of prefixes the operator registered with ``add_public_prefix`` across tenants and salts the rest.
The raw ``unsafe_salt=`` keyword bypasses the derivation (tests and teaching only: whoever can set
it can join another tenant's cache).

A request with bad input (empty prompt, too long for the model or the pool, a sampling parameter out
of range, an unknown id to abort) raises a clear error for that request only; nothing is queued and the
other requests keep running. ``generate`` turns such an error into a finished output with
``finish_reason="error"``.

Reference: nano-vllm ``nanovllm/engine/llm_engine.py`` and ``model_runner.py``; vLLM ``LLMEngine``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.block_manager import BlockManager
from ..cache.block_pool import check
from .kv_store import PagedKVStore
from .models import encode, eos_ids, model_device_dtype, model_fingerprint
from .paged_attention import build_batch, paged_attention
from .sampling import SamplingParams, sample_next
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence as Seq
from .sequence import SequenceStatus
from .tenants import check_policy, new_secret, public_prefix_length, tenant_salt

__all__ = ["Engine", "RequestOutput", "SamplingParams", "UnknownRequestError"]


def _config_eos(model: Any) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])


class UnknownRequestError(LookupError):
    """Raised for a request id the engine does not hold."""


@dataclass(slots=True)
class RequestOutput:
    """A request's result: tokens, text, why it stopped, cache use and timing (seconds)."""

    request_id: Hashable
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error"
    num_cached_tokens: int  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    ttft: float | None = None  # arrival -> first token
    latency: float | None = None  # arrival -> finished
    error: str | None = None


class Engine:
    """Paged K/V store + block manager + scheduler around one Hugging Face causal LM."""

    def __init__(self, model: Any, tokenizer: Any, *, num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, debug: bool = False, seed: int = 0,
                 isolation: str = "shared", secret: bytes | None = None) -> None:
        if num_blocks is None:
            num_blocks = 512 if kv_cache_bytes is None else PagedKVStore.blocks_for_bytes(model, kv_cache_bytes, block_size)
        self.model, self.tokenizer, self.debug = model, tokenizer, debug
        self.device, self.dtype = model_device_dtype(model)
        self.block_manager = BlockManager(num_blocks, block_size, model_fingerprint=model_fingerprint(model, tokenizer),
                                          enable_caching=enable_prefix_caching)
        self.store = PagedKVStore.for_model(model, num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = eos_ids(model, tokenizer) if tokenizer is not None else _config_eos(model)
        self.requests: dict[Hashable, Seq] = {}  # unfinished requests by id
        self._ids = itertools.count()
        self._rng = random.Random(seed)  # seeds of requests that give none
        self.num_steps = 0
        self.num_mixed_steps = 0  # steps that ran prefills and decodes together
        self.peak_kv_bytes = 0
        self.isolation = check_policy(isolation)  # "shared", "tenant" or "public-prefix"
        self._secret = new_secret() if secret is None else bytes(secret)  # server-side only
        self.public_prefixes: list[tuple[int, ...]] = []  # token ids; used under "public-prefix"

    # --- requests ---------------------------------------------------------------------------------------
    def add_public_prefix(self, prefix: str | Sequence[int]) -> int:
        """Register an operator prefix (e.g. a system prompt) every tenant may share; return its tokens."""
        ids = tuple(encode(self.tokenizer, prefix))
        if not ids:
            raise ValueError("a public prefix needs at least one token")
        if ids not in self.public_prefixes:
            self.public_prefixes.append(ids)
        return len(ids)

    def salt_for(self, tenant: str | None) -> str | None:
        """The cache salt the engine gives ``tenant`` under its policy (None under "shared")."""
        return None if self.isolation == "shared" else tenant_salt(self._secret, tenant)

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    request_id: Hashable | None = None, tenant: str | None = None, *,
                    unsafe_salt: str | None = None) -> Hashable:
        """Queue one request (text or token ids) of ``tenant``; return its id. Bad input raises, queueing nothing."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.validate()
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
        if unsafe_salt is not None and not isinstance(unsafe_salt, str):
            raise TypeError(f"unsafe_salt must be a str or None, got {type(unsafe_salt).__name__}")
        if unsafe_salt is not None and tenant is not None:
            raise ValueError("give a tenant (the engine derives its salt) or an unsafe_salt, not both")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise TypeError("this engine has no tokenizer: pass token ids")
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if self.max_model_len is not None and len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"model's {self.max_model_len} positions")
        self.scheduler.check_fits(len(ids), sampling.max_tokens)
        seq_id = next(self._ids)
        request_id = seq_id if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        salt = unsafe_salt if unsafe_salt is not None else self.salt_for(tenant)
        seq = Seq(seq_id, request_id, ids, sampling, salt, arrival_time=time.perf_counter())
        seq.tenant = tenant
        if self.isolation == "public-prefix":
            seq.public_tokens = public_prefix_length(ids, self.public_prefixes)
        seq.generator = self._make_generator(sampling)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _make_generator(self, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.greedy:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else self._rng.getrandbits(63))
        return gen

    def abort(self, request_id: Hashable) -> RequestOutput:
        """Stop an unfinished request now and free its blocks."""
        seq = self._get(request_id)
        self._finish(seq, "abort")
        return self._output(seq)

    def fork(self, request_id: Hashable, child_id: Hashable | None = None,
             sampling: SamplingParams | None = None) -> Hashable:
        """Continue a running request as two: the child shares every block (copy-on-write on its first write)."""
        parent = self._get(request_id)
        sampling = parent.sampling if sampling is None else sampling
        sampling.validate()
        seq_id = next(self._ids)
        child_id = seq_id if child_id is None else child_id
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        child = Seq(seq_id, child_id, list(parent.prompt_ids), sampling, parent.salt, parent.arrival_time,
                    list(parent.output_ids), num_cached_tokens=parent.num_cached_tokens,
                    first_token_time=parent.first_token_time)
        child.tenant, child.public_tokens = parent.tenant, parent.public_tokens
        child.generator = self._make_generator(sampling)
        self.scheduler.fork(parent, child)  # raises unless the parent is running
        self.requests[child_id] = child
        return child_id

    def _get(self, request_id: Hashable) -> Seq:
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request id {request_id!r} (never added, or already finished)") from None

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated ids (special tokens dropped); empty without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, sample one token per scheduled sequence; return what finished."""
        sched = self.scheduler.schedule()
        finished = self._run(sched) if sched.items else []  # empty only when a lone sequence preempted itself
        if self.debug:
            self.check_invariants()
        return finished

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes_in_use)
        self.store.copy_blocks(sched.cow_pairs)
        logits = self._forward(sched)  # (num_scheduled, vocab)
        tokens = self._sample(sched, logits)
        now, finished = time.perf_counter(), []
        for item, token in zip(sched.items, tokens):
            seq = item.seq
            seq.output_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(self._output(seq))
        self.num_steps += 1
        self.num_mixed_steps += len({it.is_prefill for it in sched.items}) == 2
        return finished

    @torch.no_grad()
    def _forward(self, sched: SchedulerOutput) -> torch.Tensor:
        bm, ids, pos = self.block_manager, [], []
        for it in sched.items:
            ids.extend(it.seq.token_ids[it.start:it.end])
            pos.extend(range(it.start, it.end))
        batch = build_batch(self.store, [(it.start, it.end, bm.block_table(it.seq.seq_id)) for it in sched.items])
        last = torch.tensor(list(itertools.accumulate(it.end - it.start for it in sched.items)), device=self.device) - 1
        with paged_attention(self.model):
            out = self.model(input_ids=torch.tensor([ids], device=self.device),  # (1, T)
                             position_ids=torch.tensor([pos], device=self.device),  # (1, T)
                             use_cache=False, logits_to_keep=last, kvlab_batch=batch)
        return out.logits[0]  # (num_scheduled, vocab): each sequence's last position

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[int]:
        tokens = logits.argmax(-1).tolist()  # greedy for all; sampled rows are replaced below
        for i, it in enumerate(sched.items):
            sp = it.seq.sampling
            if not sp.greedy:
                tokens[i] = sample_next(logits[i], True, sp.temperature, sp.top_p, sp.top_k, it.seq.generator)
        return tokens

    def _stop_reason(self, seq: Seq, token: int) -> str | None:
        sp = seq.sampling
        if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return "stop"
        return "length" if len(seq.output_ids) >= sp.max_tokens else None

    def _finish(self, seq: Seq, reason: str, now: float | None = None) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_time = time.perf_counter() if now is None else now
        del self.requests[seq.request_id]

    def _output(self, seq: Seq) -> RequestOutput:
        done = seq.status is SequenceStatus.FINISHED
        return RequestOutput(
            seq.request_id, list(seq.prompt_ids), list(seq.output_ids),
            self.decode(seq.output_ids), done, seq.finish_reason,
            seq.num_cached_tokens or 0, seq.num_preemptions,
            None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            None if seq.finish_time is None else seq.finish_time - seq.arrival_time)

    # --- run to completion --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 tenants: Sequence[str | None] | None = None, *,
                 unsafe_salts: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Submit all prompts at once, step until they finish; outputs in prompt order.

        A prompt that is refused (bad input) gets an output with ``finish_reason="error"``; the rest run.
        """
        n = len(prompts)
        samplings = list(sampling) if isinstance(sampling, Sequence) else [sampling] * n
        tenants = [None] * n if tenants is None else list(tenants)
        salts = [None] * n if unsafe_salts is None else list(unsafe_salts)
        if len(samplings) != n or len(tenants) != n or len(salts) != n:
            raise ValueError("give one sampling, tenant and salt per prompt (or one sampling for all)")
        results: dict[int, RequestOutput] = {}
        ids: dict[Hashable, int] = {}
        for i, (prompt, sp, tenant, salt) in enumerate(zip(prompts, samplings, tenants, salts)):
            try:
                ids[self.add_request(prompt, sp, tenant=tenant, unsafe_salt=salt)] = i
            except (ValueError, TypeError) as e:
                prompt_ids = list(prompt) if not isinstance(prompt, str) else []
                results[i] = RequestOutput(None, prompt_ids, [], "", True, "error", 0, error=str(e))
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in ids:
                    results[ids[out.request_id]] = out
        return [results[i] for i in range(n)]

    # --- metrics and invariants -------------------------------------------------------------------
    @property
    def kv_bytes_in_use(self) -> int:
        """K/V bytes of the blocks referenced by live sequences now."""
        bm = self.block_manager
        return (bm.pool.num_blocks - bm.num_free_blocks) * self.store.bytes_per_block

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (and later recomputed) so far."""
        return self.scheduler.num_preemptions

    def stats(self) -> dict:
        """Engine-wide numbers: hit rate, KV bytes in use and peak, preemptions, steps, block-manager stats."""
        return {**self.block_manager.stats(), "kv_bytes_in_use": self.kv_bytes_in_use,
                "peak_kv_bytes": self.peak_kv_bytes, "kv_bytes_total": self.store.nbytes,
                "num_preemptions": self.num_preemptions, "num_steps": self.num_steps,
                "num_mixed_steps": self.num_mixed_steps,
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running)}

    def check_invariants(self) -> None:
        """Raise unless the block manager and the queues agree: every live sequence holds its tokens' blocks."""
        bm, sched = self.block_manager, self.scheduler
        bm.check_invariants()
        running = {s.seq_id for s in sched.running}
        check(running == set(bm.seqs), f"running {sorted(running)} but the block manager holds {sorted(bm.seqs)}")
        for seq in sched.running:
            check(seq.status is SequenceStatus.RUNNING and bm.seqs[seq.seq_id].token_ids == seq.token_ids[:-1],
                  f"sequence {seq.seq_id}: its blocks hold other tokens than all but its last")
        for seq in sched.waiting:
            check(seq.status is SequenceStatus.WAITING and seq.seq_id not in bm.seqs,
                  f"waiting sequence {seq.seq_id} still holds blocks")
        live = {s.request_id for s in itertools.chain(sched.running, sched.waiting)}
        check(live == set(self.requests), "the engine's request table and the queues disagree")
