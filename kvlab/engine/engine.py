"""A small paged inference engine on real Hugging Face weights: continuous batching + prefix caching.

    engine = Engine(model, tokenizer, num_blocks=256, block_size=16, enable_prefix_caching=True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))   # or add_request(...) + step()

``cache="radix"`` runs the same engine on SGLang's radix tree instead of vLLM's hash blocks, in pages of
``page_size`` slots (1 by default: token granular; ``kvlab.engine.radix_adapter``).
``cache=obj`` runs it on any object implementing ``kvlab.cache.CacheManager`` (e.g. a ``BlockManager`` built by
the caller, or a participant's own); it brings its own size, and one missing a member is refused (``TypeError``).

One ``step()``: the scheduler picks decodes and prefills (preempting when blocks run out), copy-on-write
pairs are copied in the K/V store, the new tokens of all scheduled sequences run through the model in
**one** packed forward (paged attention reads each sequence's cached K/V through its block table), and
one token is sampled per sequence from its last position's logits (only those positions reach the LM
head, which the step computes as ``W @ x.T``, the same product as ``F.linear`` in the operand order that
CPU BLAS runs faster for a few rows). Greedy is argmax; sampling uses a per-request generator seeded from the request's seed, so
outputs do not depend on batching.

Host tier: ``host_tier_bytes=N`` keeps evicted cached blocks in host memory, up to N bytes (LRU), and copies them
back when a later prompt's chain misses the pool but hits the tier (``kvlab.engine.offload``; ``offload_evicted=False``
keeps the tier only as a staging area for blocks fetched from another replica). Restored tokens count in
``num_cached_tokens`` (they are not computed) and apart in ``RequestOutput.num_restored_tokens``.

Tenants: ``add_request(..., tenant="acme")``. Under ``isolation="tenant"`` or ``"public-prefix"`` the
engine derives the tenant's cache salt from the tenant id and its server ``secret`` (HMAC-SHA256,
``kvlab.engine.tenants``); a request cannot choose or forge a salt. ``"public-prefix"`` shares the whole blocks
of prefixes the operator registered with ``add_public_prefix`` across tenants and salts the rest.
The raw ``unsafe_salt=`` keyword bypasses the derivation (tests and teaching only: whoever can set
it can join another tenant's cache). Under ``"shared"`` tenants may still be named (they scope ``abort`` and
``fork``) but share every prefix: the first such request warns (``SharedTenantsWarning``, once per engine).

A request with bad input (empty prompt, a prompt that is neither text nor a sequence of int token ids
in ``[0, vocab)``, too long for the model or the pool, a sampling parameter out of range, an unknown id
to abort) raises a clear error for that request only; nothing is queued and the other requests keep
running. ``generate`` turns such an error into a finished output with ``finish_reason="error"``.

A request that fails *inside* a step (its forward or its sampling raises, or its logits are NaN) does
not take the step down: it finishes with ``finish_reason="error"`` and the message in ``error``, its
blocks are freed, and the blocks whose K/V the failed forward never wrote leave the prefix cache. When
the packed forward raises, the step's requests are run one at a time to find the culprit; a request
that read the failed request's blocks in the same step is prefilled again in a later step. Every other
request produces exactly the tokens it would have produced alone.

Threads: ``add_request``, ``abort``, ``fork`` and ``step`` (and ``generate``, one step at a time) hold
one re-entrant lock, so a second thread may add or abort requests while a loop in another thread calls
``step()``: its call waits until the running step ends. ``add_request`` and ``generate`` tokenize and check
a prompt before taking the lock (only the queueing holds it), so a huge prompt never stalls a running step.
Automatic request ids skip every id in use, so they never collide with ids chosen by the caller.
``abort``/``fork`` take the ``tenant`` the request was added with and refuse another tenant's request as
unknown. The server ``secret`` must be ``bytes`` or ``str`` of at least 16 bytes; without one each engine
draws a random secret. The engine checks at construction that its paged attention runs for every layer of
the model, and refuses (``NotImplementedError``) architectures it cannot serve.

Reference: nano-vllm ``nanovllm/engine/llm_engine.py`` and ``model_runner.py``; vLLM ``LLMEngine``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import random
import threading
import time
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.block_pool import check
from ..cache.interface import CacheManager
from ..cache.kv_events import EventBatch
from .kv_store import PagedKVStore
from .models import encode, eos_ids, model_device_dtype, model_fingerprint
from .offload import HostOffload
from .paged_attention import MissingBatchError, build_batch, check_config, paged_attention
from .radix_adapter import adopt_cache, make_cache_manager
from .sampling import SamplingParams, sample_next
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence as Seq
from .sequence import SequenceStatus
from .tenants import SharedTenantsWarning, check_policy, check_secret, public_prefix_length, tenant_salt

__all__ = ["Engine", "RequestOutput", "SamplingParams", "UnknownRequestError"]


def _config_eos(model: Any) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])


class UnknownRequestError(LookupError):
    """Raised for a request id the engine does not hold (or that belongs to another tenant)."""


def _locked(method):
    """Run ``method`` holding the engine's lock (re-entrant: ``generate`` calls ``add_request`` and ``step``)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _head_as_w_xt(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` computed as ``(W @ x.T).T``: the same product as ``F.linear``, in another operand order.

    Measured (issue 15): for 16 rows of a 151,936 x 896 head, 0.58x the time of ``F.linear`` on 2 CPU threads
    (MKL), 0.84x on one; a few rows are all the head sees, one per scheduled sequence.
    """
    # x (..., hidden); weight (vocab, hidden)
    rows = x.reshape(-1, x.shape[-1])  # (N, hidden)
    out = (head.weight @ rows.T).T  # (N, vocab)
    if head.bias is not None:
        out = out + head.bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])  # (..., vocab)


@contextlib.contextmanager
def _fast_head(model: Any) -> Any:
    """Within the block, a plain ``nn.Linear`` LM head runs as ``W @ x.T``; the model's own post-processing of its logits still runs."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or "forward" in vars(head):  # a subclass (LoRA, quantised) or already swapped
        yield
        return
    head.forward = functools.partial(_head_as_w_xt, head)
    try:
        yield
    finally:
        del head.forward


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


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
    num_restored_tokens: int = 0  # of num_cached_tokens: copied back from the host tier (evicted or fetched)


class Engine:
    """Paged K/V store + block manager + scheduler around one Hugging Face causal LM."""

    def __init__(self, model: Any, tokenizer: Any, *, num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, debug: bool = False, seed: int = 0,
                 isolation: str = "shared", secret: bytes | str | None = None, cache: str | CacheManager = "blocks",
                 page_size: int = 1, enable_kv_events: bool = False, host_tier_bytes: int | None = None,
                 offload_evicted: bool = True) -> None:
        secret = check_secret(secret)  # bytes/str of >= 16 bytes; None -> a random one for this engine
        self.model, self.tokenizer, self.debug = model, tokenizer, debug
        self.device, self.dtype = model_device_dtype(model)
        if isinstance(cache, str):
            if num_blocks is None:
                num_blocks = 512 if kv_cache_bytes is None else PagedKVStore.blocks_for_bytes(
                    model, kv_cache_bytes, block_size)
            # cache="radix": SGLang's radix tree on the same slots, in pages of page_size (kvlab.engine.radix_adapter)
            self.block_manager: CacheManager = make_cache_manager(
                cache, num_blocks, block_size, page_size, isolation,
                model_fingerprint(model, tokenizer, every_weight=False), enable_prefix_caching, enable_kv_events)
        else:  # the caller's own kvlab.cache.CacheManager (e.g. a BlockManager they built): it brings its sizes
            self.block_manager = adopt_cache(cache, num_blocks, kv_cache_bytes)
        self.store = PagedKVStore.for_model(model, self.block_manager.num_blocks, self.block_manager.block_size)
        # host_tier_bytes: evicted blocks wait in host memory and come back on a hit (kvlab.engine.offload)
        self.host_tier = None if host_tier_bytes is None else HostOffload(
            self.store, self.block_manager, host_tier_bytes, offload=offload_evicted)
        self._restored: dict[int, int] = {}  # seq id -> prompt tokens restored from the host tier at first admission
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
        self._secret = secret  # server-side only
        self.public_prefixes: list[tuple[int, ...]] = []  # token ids; used under "public-prefix"
        self._lock = threading.RLock()  # add_request / abort / fork / step from several threads
        self._pending: list[RequestOutput] = []  # finished during a generate() that did not own them
        self._held: set[int] = set()  # seq ids whose outputs a running generate() collects itself
        self.enable_kv_events = enable_kv_events
        self._kv_batches: list[EventBatch] = []  # one per step that changed the cache (enable_kv_events=True)
        self._kv_seq = 0  # sequence number of the next batch
        self._warned_shared_tenants = False  # SharedTenantsWarning: once per engine
        self._check_architecture()

    @torch.no_grad()
    def _check_architecture(self) -> None:
        """Run one token through the model with the paged attention; refuse a model it does not fully serve.

        An allow-list (``kvlab.engine.paged_attention``): the model is served only if its forward takes
        ``position_ids``, its config has an int ``vocab_size``, the paged attention runs exactly once for
        every layer through transformers' ``AttentionInterface``, every attention call asks for nothing
        beyond causal SDPA with a scale and an optional sliding window (``check_attention_call``: no sink
        logits, soft-capping, position bias, own mask, dropout, non-causal module, or any other keyword
        that is not None), and its config's attention features are ones it implements (``check_config``:
        full and sliding-window layer types only, no chunked or bidirectional attention, each layer's
        window passed to its attention call). Anything else is refused here, before any request, with
        ``NotImplementedError`` naming the architecture and the feature.
        """
        name = getattr(self.model.config, "model_type", None) or type(self.model).__name__
        if not isinstance(getattr(self.model.config, "vocab_size", None), int):
            raise NotImplementedError(
                f"kvlab's paged attention cannot run {name!r}: its config has no int vocab_size (a multimodal wrapper? "
                "load its language model alone)")
        batch = build_batch(self.store, [(0, 1, [0])])
        zero = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        try:
            with paged_attention(self.model):
                self.model(input_ids=zero, position_ids=zero, use_cache=False,
                           logits_to_keep=torch.zeros(1, dtype=torch.long, device=self.device), kvlab_batch=batch)
        except MissingBatchError as e:
            raise NotImplementedError(
                f"kvlab's paged attention cannot run {name!r}: its layers do not pass the forward keyword "
                "kvlab_batch down to the attention function") from e
        except NotImplementedError as e:
            raise NotImplementedError(f"kvlab's paged attention cannot run {name!r}: {e}") from e
        except Exception as e:
            raise NotImplementedError(
                f"kvlab's paged attention cannot run {name!r}: its forward failed under the paged attention "
                f"({_describe(e)})") from e
        finally:
            self.store.k[:, 0].zero_()
            self.store.v[:, 0].zero_()
        try:
            self._check_probe(batch)
        except NotImplementedError as e:
            raise NotImplementedError(f"kvlab's paged attention cannot run {name!r}: {e}") from e

    def _check_probe(self, batch: Any) -> None:
        """After the probe: every layer attended once, positions come from ``position_ids``, the config is served."""
        if sorted(batch.layers_run) != list(range(self.store.num_layers)):
            missing = sorted(set(range(self.store.num_layers)) - set(batch.layers_run))
            raise NotImplementedError(
                f"it never ran for layers {missing} of {self.store.num_layers} (calls: {batch.layers_run}); the "
                "model's attention does not go through transformers' AttentionInterface (e.g. ALiBi or custom "
                "attention code), so its K/V would never reach the paged store and the outputs would be wrong")
        if "position_ids" not in inspect.signature(self.model.forward).parameters:
            raise NotImplementedError(
                "its forward takes no position_ids, so the tokens of a packed step would get positions from their "
                "place in the step instead of their place in the sequence")
        check_config(self.model.config, dict(zip(batch.layers_run, batch.windows_run)))

    # --- requests ---------------------------------------------------------------------------------------
    def add_public_prefix(self, prefix: str | Sequence[int]) -> int:
        """Register an operator prefix (e.g. a system prompt) every tenant may share; return its tokens."""
        ids = tuple(encode(self.tokenizer, prefix))  # tokenized before the lock, as in add_request
        if not ids:
            raise ValueError("a public prefix needs at least one token")
        with self._lock:
            if ids not in self.public_prefixes:
                self.public_prefixes.append(ids)
        return len(ids)

    def salt_for(self, tenant: str | None) -> str | None:
        """The cache salt the engine gives ``tenant`` under its policy (None under "shared")."""
        return None if self.isolation == "shared" else tenant_salt(self._secret, tenant)

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    request_id: Hashable | None = None, tenant: str | None = None, *,
                    unsafe_salt: str | None = None) -> Hashable:
        """Queue one request (text or token ids) of ``tenant``; return its id. Bad input raises, queueing nothing.

        ``request_id=None`` gives an automatic id: an int that no live request uses. The prompt is
        tokenized and checked *before* the engine lock is taken, so a huge prompt never stalls a running
        ``step()``; only the queueing (ids, generator, queues) holds the lock.
        """
        checked = self._check_request(prompt, sampling, tenant, unsafe_salt)
        with self._lock:
            return self._queue(checked, request_id)

    def _check_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None, tenant: str | None,
                       unsafe_salt: str | None) -> tuple[list[int], SamplingParams, str | None, str | None]:
        """Tokenize and check one request without the lock (it reads only what never changes after construction).

        Returns ``(token ids, sampling, tenant, salt)``, or raises ``TypeError``/``ValueError`` naming the problem.
        """
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
        ids = encode(self.tokenizer, prompt)  # text, or real int ids: floats, bools, bytes, dicts... raise
        if not ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if self.max_model_len is not None and len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                             f"model's {self.max_model_len} positions")
        self.scheduler.check_fits(len(ids), sampling.max_tokens)  # the pool's size only: fixed at construction
        salt = unsafe_salt if unsafe_salt is not None else self.salt_for(tenant)
        if tenant is not None and self.isolation == "shared" and not self._warned_shared_tenants:
            self._warned_shared_tenants = True  # once per engine
            warnings.warn(SharedTenantsWarning(
                f"tenant {tenant!r} on an engine with isolation='shared': tenants share every cached prefix "
                "(one tenant's prompts can speed up, and so reveal themselves to, another's); use "
                "isolation='tenant' or 'public-prefix' to keep them apart"), stacklevel=3)
        return ids, sampling, tenant, salt

    def _queue(self, checked: tuple[list[int], SamplingParams, str | None, str | None],
               request_id: Hashable | None) -> Hashable:
        """Queue a checked request (under the lock): give it its ids and generator; return its request id."""
        ids, sampling, tenant, salt = checked
        seq_id, request_id = self._new_ids(request_id)
        seq = Seq(seq_id, request_id, ids, sampling, salt, arrival_time=time.perf_counter())
        seq.tenant = tenant
        if self.isolation == "public-prefix":
            seq.public_tokens = public_prefix_length(ids, self.public_prefixes)
        seq.generator = self._make_generator(sampling)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _new_ids(self, request_id: Hashable | None) -> tuple[int, Hashable]:
        """A fresh internal sequence id, and ``request_id`` or, for None, an automatic id no live request uses."""
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq_id = next(self._ids)
        if request_id is None:
            request_id = seq_id
            while request_id in self.requests:  # a caller chose this number: never collide with it
                request_id = next(self._ids)
        return seq_id, request_id

    def _make_generator(self, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.greedy:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else self._rng.getrandbits(63))
        return gen

    @_locked
    def abort(self, request_id: Hashable, *, tenant: str | None = None) -> RequestOutput:
        """Stop an unfinished request of ``tenant`` (the one it was added with) now and free its blocks."""
        seq = self._get(request_id, tenant)
        self._finish(seq, "abort")
        return self._output(seq)

    @_locked
    def fork(self, request_id: Hashable, child_id: Hashable | None = None,
             sampling: SamplingParams | None = None, *, tenant: str | None = None) -> Hashable:
        """Continue a running request of ``tenant`` as two: the child shares every block (copy-on-write on its
        first write). A refused fork changes nothing, not even the engine's random generator."""
        parent = self._get(request_id, tenant)
        sampling = parent.sampling if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling.validate()
        if parent.status is not SequenceStatus.RUNNING or not parent.output_ids:
            raise ValueError("only a running sequence that has generated a token can be forked")
        seq_id, child_id = self._new_ids(child_id)
        child = Seq(seq_id, child_id, list(parent.prompt_ids), sampling, parent.salt, parent.arrival_time,
                    list(parent.output_ids), num_cached_tokens=parent.num_cached_tokens,
                    first_token_time=parent.first_token_time)
        child.tenant, child.public_tokens = parent.tenant, parent.public_tokens
        child.generator = self._make_generator(sampling)  # after every check: a refused fork draws nothing
        self.scheduler.fork(parent, child)
        self.requests[child_id] = child
        return child_id

    def _get(self, request_id: Hashable, tenant: str | None = None) -> Seq:
        seq = self.requests.get(request_id)
        if seq is None or seq.tenant != tenant:  # another tenant's request looks like an unknown one
            who = "" if tenant is None else f" of tenant {tenant!r}"
            raise UnknownRequestError(f"unknown request id {request_id!r}{who} (never added, already finished, "
                                      "or added with another tenant)")
        return seq

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated ids (special tokens dropped); empty without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @_locked
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or a finished output waits to be returned by ``step()``."""
        return bool(self._pending) or self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------------------
    @_locked
    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, sample one token per scheduled sequence; return what finished.

        Also returned: outputs of requests that finished during an earlier ``generate()`` call that did
        not own them (requests added with ``add_request``), so no output is ever lost.
        """
        sched = self.scheduler.schedule()
        finished = self._run(sched) if sched.items else []  # empty only when a lone sequence preempted itself
        if self.debug:
            self.check_invariants()
        self._batch_kv_events()
        outputs, self._pending = self._pending, []
        return outputs + [self._output(seq) for seq in finished if seq.seq_id not in self._held]

    def _batch_kv_events(self) -> None:
        """Wrap the KV events queued since the last batch in one ``EventBatch`` with the next sequence number."""
        if self.enable_kv_events:
            events = self.block_manager.take_events()
            if events:
                self._kv_batches.append(EventBatch(time.time(), tuple(events), self._kv_seq))
                self._kv_seq += 1

    @_locked
    def take_kv_events(self) -> list[EventBatch]:
        """The KV-event batches (one per step that changed the prefix cache) since the last call, oldest first.

        Needs ``Engine(..., enable_kv_events=True)``. Events from outside a step (an abort, ``reset_prefix_cache``)
        go into a batch of their own. A router consumes these (``kvlab.cluster.router``), as Dynamo's or
        Ray Serve's routers consume vLLM's ``KVEventBatch`` stream.
        """
        self._batch_kv_events()
        batches, self._kv_batches = self._kv_batches, []
        return batches

    @_locked
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused, False, while a request holds blocks); emits ``AllBlocksCleared``."""
        return self.block_manager.reset_prefix_cache()  # the radix cache raises NotImplementedError

    def _run(self, sched: SchedulerOutput) -> list[Seq]:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes_in_use)
        self.store.copy_blocks(sched.cow_pairs)
        if self.host_tier is not None:  # the host tier's restores were copied in at admission: count them
            for it in sched.items:
                if it.is_prefill and it.seq.seq_id not in self._restored:
                    self._restored[it.seq.seq_id] = self.host_tier.block_manager.seqs[it.seq.seq_id].num_restored_tokens
        tokens, errors, untrusted = self._compute(sched)
        now, finished = time.perf_counter(), []
        for i in reversed(range(len(sched.items))):  # latest first: a block leaves the cache once nobody holds it
            seq, start = sched.items[i].seq, sched.items[i].start
            uncache_from = start if i in untrusted else None  # K/V of [start, end) was never (reliably) written
            if i in errors:
                seq.error = errors[i]
                self._finish(seq, "error", now, uncache_from)
                finished.append(seq)
            elif i in untrusted:  # it read blocks a failed request never wrote: prefill it again later
                self.scheduler.requeue(seq, uncache_from)
                if not seq.output_ids:
                    seq.num_cached_tokens = None  # counted at its next admission instead
        finished.reverse()
        for item, token in zip(sched.items, tokens):
            if token is None:
                continue
            seq = item.seq
            seq.output_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        self.num_steps += 1
        self.num_mixed_steps += len({it.is_prefill for it in sched.items}) == 2
        return finished

    def _positions(self, item: ScheduledSeq) -> range:
        """Positions of the tokens ``item`` computes this step: where they sit in their sequence.

        A subclass that changes this changes what RoPE sees; notebook 05's ``PositionRestartEngine`` overrides it
        to run the "positions restart after the cache" bug.
        """
        return range(item.start, item.end)

    @torch.no_grad()  # no autograd graph: it would chain every step through the K/V store and keep it all alive
    def _forward(self, sched: SchedulerOutput) -> torch.Tensor:
        bm, ids, pos = self.block_manager, [], []
        for it in sched.items:
            ids.extend(it.seq.token_ids[it.start:it.end])
            pos.extend(self._positions(it))
        batch = build_batch(self.store, [(it.start, it.end, bm.block_table(it.seq.seq_id)) for it in sched.items])
        last = torch.tensor(list(itertools.accumulate(it.end - it.start for it in sched.items)), device=self.device) - 1
        with paged_attention(self.model), _fast_head(self.model):
            out = self.model(input_ids=torch.tensor([ids], device=self.device),  # (1, T)
                             position_ids=torch.tensor([pos], device=self.device),  # (1, T)
                             use_cache=False, logits_to_keep=last, kvlab_batch=batch)
        return out.logits[0]  # (num_scheduled, vocab): each sequence's last position

    def _compute(self, sched: SchedulerOutput) -> tuple[list[int | None], dict[int, str], set[int]]:
        """One token per scheduled item, without letting one request's failure reach the others.

        Returns ``(tokens, errors, untrusted)``: ``tokens[i]`` is None where item i did not get a token;
        ``errors[i]`` is why item i failed; ``untrusted`` holds the items whose K/V of this step must never
        be read: those that failed in their forward (or gave NaN logits) and those that read such K/V in
        this step (prefix hits on blocks a failed request registered at its admission). When the packed
        forward raises, or gives NaN logits for some item (a NaN key or value reaches other sequences of
        the step too: a masked slot still multiplies its value by 0, and 0 * NaN is NaN), each item is
        run alone, in order, to find the culprits. An item is checked for such a dependency before it is
        sampled, so its random generator only advances for a kept token. The blocks of untrusted items
        are zeroed before anyone can reuse them.
        """
        items, bm = sched.items, self.block_manager
        bs = bm.block_size
        tables = [bm.block_table(it.seq.seq_id) for it in items]
        tokens: list[int | None] = [None] * len(items)
        errors: dict[int, str] = {}
        untrusted: set[int] = set()
        bad: set[int] = set()  # blocks whose K/V this step did not reliably write
        try:
            logits = self._forward(sched)  # (num_scheduled, vocab)
            top = logits.argmax(-1)  # (num_scheduled,): argmax treats NaN as the largest, so a row with NaN points at one
            greedy, nan = top.tolist(), logits.gather(-1, top[:, None])[:, 0].isnan().tolist()
            if any(nan) and len(items) > 1:
                logits = None
        except Exception:
            logits = None  # find the culprits: each item alone
        for i, it in enumerate(items):
            if bad and any(b in bad for b in tables[i][: it.start // bs]):
                untrusted.add(i)
                bad.update(tables[i][it.start // bs:])
                continue
            try:
                if logits is not None:
                    row, top, is_nan = logits[i], greedy[i], nan[i]
                else:
                    row = self._forward(SchedulerOutput(items=[it]))[0]
                    top, is_nan = int(row.argmax()), bool(row.isnan().any())
                if is_nan:
                    raise FloatingPointError("the model's logits for this request are NaN")
            except Exception as e:
                errors[i] = _describe(e)
                untrusted.add(i)
                bad.update(tables[i][it.start // bs:])
                continue
            sp = it.seq.sampling
            try:
                tokens[i] = top if sp.greedy else sample_next(row, True, sp.temperature, sp.top_p, sp.top_k,
                                                              it.seq.generator)
            except Exception as e:  # its K/V is fine: only the sampling failed
                errors[i] = _describe(e)
        if bad:  # never read again, not even as a masked or padding slot
            self.store.clear_blocks(sorted(bad))
        return tokens, errors, untrusted

    def _stop_reason(self, seq: Seq, token: int) -> str | None:
        sp = seq.sampling
        if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return "stop"
        return "length" if len(seq.output_ids) >= sp.max_tokens else None

    def _finish(self, seq: Seq, reason: str, now: float | None = None, uncache_from: int | None = None) -> None:
        self.scheduler.finish(seq, reason, uncache_from)
        seq.finish_time = time.perf_counter() if now is None else now
        del self.requests[seq.request_id]

    def _output(self, seq: Seq) -> RequestOutput:
        done = seq.status is SequenceStatus.FINISHED
        return RequestOutput(
            seq.request_id, list(seq.prompt_ids), list(seq.output_ids),
            self.decode(seq.output_ids), done, seq.finish_reason,
            seq.num_cached_tokens or 0, seq.num_preemptions,
            None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            None if seq.finish_time is None else seq.finish_time - seq.arrival_time, seq.error,
            (self._restored.pop if done else self._restored.get)(seq.seq_id, 0))

    # --- run to completion --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 tenants: Sequence[str | None] | None = None, *,
                 unsafe_salts: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Submit all prompts at once, step until they finish; outputs in prompt order.

        ``prompts`` (and ``tenants``, ``unsafe_salts``, a list of samplings) must be a list or tuple: a lone
        string raises ``TypeError`` (pass ``[prompt]``) instead of running one request per character.
        A prompt that is refused (bad input) gets an output with ``finish_reason="error"``; the rest run.
        Requests added earlier with ``add_request`` (or by another thread meanwhile) run in the same steps;
        the outputs of those that finish during this call are kept, and the next ``step()`` returns them.
        This call returns once its own requests are done.
        """
        for name, value in (("prompts", prompts), ("tenants", tenants), ("unsafe_salts", unsafe_salts)):
            if not isinstance(value, (list, tuple)) and (name == "prompts" or value is not None):
                one = f"; for one, pass [{name[:-1]}]" if isinstance(value, (str, bytes)) else ""
                raise TypeError(f"{name} must be a list or tuple, one per prompt, got {type(value).__name__}{one}")
        n = len(prompts)
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        tenants = [None] * n if tenants is None else list(tenants)
        salts = [None] * n if unsafe_salts is None else list(unsafe_salts)
        if len(samplings) != n or len(tenants) != n or len(salts) != n:
            raise ValueError("give one sampling, tenant and salt per prompt (or one sampling for all)")
        results: dict[int, RequestOutput] = {}
        own: dict[int, Seq] = {}
        try:
            for i, (prompt, sp, tenant, salt) in enumerate(zip(prompts, samplings, tenants, salts)):
                try:
                    checked = self._check_request(prompt, sp, tenant, salt)  # tokenized without the lock
                    with self._lock:  # held from the queueing to the claim: no other step() can return its output
                        seq = self.requests[self._queue(checked, None)]
                        self._held.add(seq.seq_id)
                    own[i] = seq
                except (ValueError, TypeError) as e:
                    clean = isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt)
                    results[i] = RequestOutput(None, list(prompt) if clean else [], [], "", True, "error", 0,
                                               error=str(e))
            while True:
                with self._lock:
                    if all(seq.is_finished for seq in own.values()):
                        break
                    self._pending = self.step()  # others' outputs (and earlier pending ones): for the next step()
        except BaseException:
            with self._lock:  # this call returns nothing: hand what finished to the next step() instead
                self._pending.extend(self._output(seq) for seq in own.values() if seq.is_finished)
            raise
        finally:
            with self._lock:
                self._held.difference_update(seq.seq_id for seq in own.values())
        results.update({i: self._output(seq) for i, seq in own.items()})
        return [results[i] for i in range(n)]

    # --- metrics and invariants -------------------------------------------------------------------
    @property
    def kv_bytes_in_use(self) -> int:
        """K/V bytes of the blocks referenced by live sequences now."""
        bm = self.block_manager
        return (bm.num_blocks - bm.num_free_blocks) * self.store.bytes_per_block

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (and later recomputed) so far."""
        return self.scheduler.num_preemptions

    @_locked
    def stats(self) -> dict:
        """Engine-wide numbers: hit rate, KV bytes in use and peak, preemptions, steps, block-manager stats."""
        return {**self.block_manager.stats(), "kv_bytes_in_use": self.kv_bytes_in_use,
                "peak_kv_bytes": self.peak_kv_bytes, "kv_bytes_total": self.store.nbytes,
                "num_preemptions": self.num_preemptions, "num_steps": self.num_steps,
                "num_mixed_steps": self.num_mixed_steps,
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                **(self.host_tier.stats() if self.host_tier is not None else {})}

    @_locked
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
