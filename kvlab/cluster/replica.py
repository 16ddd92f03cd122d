"""Fleet replicas: a kvlab ``Engine`` (optionally a Ray actor) or a model-free stand-in, one
interface.

Both keep their own block pool, publish KV events (``Engine(..., enable_kv_events=True)``) and
answer:

- ``info()``: block size and model fingerprint (the router hashes prompts with them);
- ``add(request_id, prompt, max_tokens, reply=None)``: queue a request (``reply``: the tokens a
  model-free replica "generates"; an engine ignores it and runs its model, greedy, ``ignore_eos``);
- ``step()``: one engine step -> ``StepResult`` (what finished, who got a first token, the KV-event
  batches, the prefill tokens and decodes it ran, its wall seconds);
- ``fail()``: the replica dies and restarts empty: requests in flight are dropped, the cache is
  gone.
- with a host tier (``tier_blocks``): ``export(hashes, parent)`` puts the leading blocks of that
  chain it holds into the object store (a reference, or None when it holds none); ``add(...,
  fetch=[ref])`` has the replica fetch them at its next step, stage them in its tier, and restore
  them instead of recomputing. A fetch that fails (the holder died: its objects are lost) is
  dropped: the request recomputes those tokens.

``SimReplica`` runs kvlab's real ``Scheduler`` and ``BlockManager`` with scripted tokens and no
model (``kvlab.engine.trace_replay.ScriptedScheduler``, the lessons' trace replay), so
its scheduling, hits, evictions and events are exactly an engine's for the same tokens (the driver's
sim-vs-Ray check relies on this). ``EngineReplica`` wraps a real ``Engine``. ``ray_replicas`` starts
``EngineReplica``s as Ray actors; ``ray.remote`` is applied there, so importing this module needs no
Ray.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache.hashing import DEFAULT_BLOCK_SIZE

__all__ = [
    "EngineReplica",
    "LocalHandle",
    "RayHandle",
    "SimReplica",
    "StepResult",
    "ray_available",
    "ray_replicas",
    "start_ray",
]


@dataclass
class StepResult:
    """What one replica step did."""

    # request_id, output_ids, num_cached_tokens, num_preemptions
    finished: list[dict] = field(default_factory=list)
    # requests whose first token came out this step
    first_token: list[Hashable] = field(default_factory=list)
    batches: list = field(default_factory=list)  # EventBatch, oldest first
    prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    decodes: int = 0  # sequences that decoded one token
    moved_tokens: int = 0  # tokens of blocks fetched from another replica and staged this step
    seconds: float = 0.0  # wall time of the step on the replica


def _step_counts(out) -> tuple[int, int]:
    """Prompt tokens computed and sequences decoded by one ``SchedulerOutput`` (``(0, 0)`` for
    None)."""
    items = out.items if out is not None else []
    return sum(it.end - it.start for it in items if it.is_prefill), sum(
        not it.is_prefill for it in items
    )


class _Tiered:
    """What both replicas share for a host tier: export into the object store, fetch and stage at
    step time."""

    object_store: Any = None
    _fetches: list

    def _init_transfer(self, object_store: Any) -> None:
        from .object_store import LocalObjectStore

        self.object_store = object_store if object_store is not None else LocalObjectStore()
        self._fetches = []
        self.fetch_failures = 0

    def _owner(self) -> int:
        return id(self)

    def export(self, hashes: Sequence[bytes], parent: bytes | None = None) -> Any:
        """Put the leading blocks of ``hashes`` this replica holds into the object store: a
        reference, or None."""
        entries = self._collect(list(hashes), parent)
        return self.object_store.put(entries, self._owner()) if entries else None

    def _take_fetches(self) -> int:
        """Fetch and stage every pending transfer; the tokens staged (a failed fetch stages
        nothing)."""
        moved = 0
        for ref in self._fetches:
            try:
                entries = self.object_store.get(ref)
            except Exception:  # noqa: BLE001
                # the holder died, the object is lost: recompute instead
                self.fetch_failures += 1
                continue
            moved += self._stage(entries) * self.config["block_size"]
        self._fetches = []
        return moved

    def _lose_objects(self) -> None:
        kill = getattr(self.object_store, "kill", None)
        if kill is not None:
            kill(self._owner())


class SimReplica(_Tiered):
    """The scheduler and block manager of an engine, no model: tokens come from the request's
    ``reply``."""

    def __init__(
        self,
        num_blocks: int = 256,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        model_fingerprint: str = "sim",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        tier_blocks: int | None = None,
        offload: bool = False,
        object_store: Any = None,
    ) -> None:
        self.config = dict(
            num_blocks=num_blocks,
            block_size=block_size,
            model_fingerprint=model_fingerprint,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.tier_blocks, self.offload = tier_blocks, offload
        self._init_transfer(object_store)
        self._start()

    def _start(self) -> None:
        from ..cache.block_manager import BlockManager
        from ..engine.trace_replay import ScriptedScheduler

        c = self.config
        self.block_manager = BlockManager(
            c["num_blocks"],
            c["block_size"],
            model_fingerprint=c["model_fingerprint"],
            enable_kv_events=True,
        )
        self.run = ScriptedScheduler(
            self.block_manager, c["max_num_seqs"], c["max_num_batched_tokens"]
        )
        self.link = None
        if self.tier_blocks:  # a model-free tier: one "byte" per block, no payload
            from ..cache.host_tier import HostTier, TierLink

            tier = HostTier(self.tier_blocks, c["block_size"], emit=self.block_manager.emit_event)
            self.link = TierLink(tier, 1, offload=self.offload)
            self.block_manager.attach_second_tier(self.link, self.link.on_evict)
        self._restored: dict[int, int] = {}
        self._kv_seq = 0

    def info(self) -> dict:
        """Block size and model fingerprint."""
        return {
            "block_size": self.config["block_size"],
            "model_fingerprint": self.config["model_fingerprint"],
        }

    def _collect(self, hashes: list, parent: bytes | None) -> list:
        from ..cache.host_tier import collect_blocks

        return collect_blocks(
            self.block_manager, self.link.tier if self.link else None, hashes, None, parent
        )

    def _stage(self, entries: list) -> int:
        return self.link.stage(entries, self.block_manager.hash_fn) if self.link is not None else 0

    def add(self, request_id: Hashable, prompt: Sequence[int], max_tokens: int,
            reply: Sequence[int] | None = None, fetch: Sequence[Any] | None = None) -> None:
        """Queue a request; ``reply`` (at least ``max_tokens`` ids) is what it will "generate";
        ``fetch``: refs to pull."""
        if reply is None or len(reply) < max_tokens:
            raise ValueError(
                "a model-free replica needs the reply tokens (at least max_tokens of them)"
            )
        self.run.add(request_id, prompt, list(reply)[:max_tokens])
        self._fetches += [f for f in fetch or () if f is not None]

    @property
    def requests(self) -> dict[Hashable, Any]:
        """The requests in flight, by id."""
        return self.run.requests

    def step(self) -> StepResult:
        """One step as ``Engine.step`` takes it: schedule, one token per scheduled sequence, finish
        in order."""
        from ..cache.kv_events import EventBatch

        t0 = time.perf_counter()
        moved = self._take_fetches()
        step = self.run.step()
        res = StepResult(
            moved_tokens=moved, prefill_tokens=step.prefill_tokens, decodes=step.decodes
        )
        for item in step.output.items:  # at first admission, as num_cached_tokens
            if item.is_prefill and item.seq.seq_id not in self._restored:
                self._restored[item.seq.seq_id] = self.block_manager.seqs[
                    item.seq.seq_id
                ].num_restored_tokens
        res.first_token = [seq.request_id for seq in step.first_token]
        for seq in step.finished:
            res.finished.append({"request_id": seq.request_id, "output_ids": list(seq.output_ids),
                                 "num_cached_tokens": seq.num_cached_tokens or 0,
                                 "num_preemptions": seq.num_preemptions,
                                 "restored_tokens": self._restored.pop(seq.seq_id, 0)})
        events = self.block_manager.take_events()
        if events:
            res.batches.append(EventBatch(time.time(), tuple(events), self._kv_seq))
            self._kv_seq += 1
        res.seconds = time.perf_counter() - t0
        return res

    def fail(self) -> list[Hashable]:
        """Die and restart empty; return the ids of the requests that were in flight."""
        lost = list(self.requests)
        self._lose_objects()
        self._fetches = []
        self._start()
        return lost

    def cached_hashes(self) -> set:
        """The block hashes this replica's pool caches now (for checks; the router never calls
        it)."""
        return set(self.block_manager.pool.cached)

    def stats(self) -> dict:
        """Block-manager stats plus preemptions."""
        tier = self.link.stats() if self.link is not None else {}
        return {
            **self.block_manager.stats(),
            "num_preemptions": self.run.scheduler.num_preemptions,
            **tier,
            "fetch_failures": self.fetch_failures,
        }


class EngineReplica(_Tiered):
    """A kvlab ``Engine`` on a model (the bundled one by default; or a loaded ``(model,
    tokenizer)``) with KV events on."""

    def __init__(
        self,
        model: str | tuple | None = None,
        num_blocks: int = 256,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        torch_threads: int | None = 1,
        tier_blocks: int | None = None,
        offload: bool = False,
        object_store: Any = None,
    ) -> None:
        import torch

        from ..engine.models import load_model

        if torch_threads:
            torch.set_num_threads(torch_threads)
        # (model, tokenizer) already loaded: in-process replicas share the weights
        if isinstance(model, tuple):
            self.model, self.tokenizer = model
        else:
            self.model, self.tokenizer = load_model(model, device=device, dtype=dtype)
        self.config = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
        self.tier_blocks, self.offload = tier_blocks, offload
        self._init_transfer(object_store)
        self._start()

    def _start(self) -> None:
        from ..engine.engine import Engine

        tier = None
        if self.tier_blocks:
            from ..engine.models import kv_shape

            s, p = kv_shape(self.model.config), next(self.model.parameters())
            per_block = (
                2
                * s["layers"]
                * self.config["block_size"]
                * s["kv_heads"]
                * s["head_dim"]
                * p.element_size()
            )
            tier = self.tier_blocks * per_block
        self.engine = Engine(
            self.model,
            self.tokenizer,
            enable_kv_events=True,
            host_tier_bytes=tier,
            offload_evicted=self.offload,
            **self.config,
        )
        self._first_seen: set[Hashable] = set()

    def info(self) -> dict:
        """Block size and the model fingerprint the engine's block manager hashes with."""
        bm = self.engine.block_manager
        return {"block_size": bm.block_size, "model_fingerprint": bm.model_fingerprint}

    def _collect(self, hashes: list, parent: bytes | None) -> list:
        from ..cache.host_tier import collect_blocks

        ht = self.engine.host_tier
        if ht is not None:
            return ht.export(hashes, parent)
        return collect_blocks(self.engine.block_manager, None, hashes, self._read, parent)

    def _read(self, block_id: int) -> tuple:
        from ..engine.offload import to_wire

        store = self.engine.store
        k, v = store.k[:, block_id].to("cpu", copy=True), store.v[:, block_id].to("cpu", copy=True)
        return (to_wire(k), to_wire(v)), store.bytes_per_block

    def _stage(self, entries: list) -> int:
        ht = self.engine.host_tier
        return ht.stage(entries) if ht is not None else 0

    def add(self, request_id: Hashable, prompt: Sequence[int], max_tokens: int,
            reply: Sequence[int] | None = None, fetch: Sequence[Any] | None = None) -> None:
        """Queue a request; the model generates ``max_tokens`` tokens greedily (``reply`` is
        ignored); ``fetch``: refs to pull."""
        from ..engine.sampling import SamplingParams

        self.engine.add_request(
            list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id
        )
        self._fetches += [f for f in fetch or () if f is not None]

    def step(self) -> StepResult:
        """One ``Engine.step``; first tokens read from the engine's live requests."""
        t0 = time.perf_counter()
        moved = self._take_fetches()
        outs = self.engine.step()
        seconds = time.perf_counter() - t0
        res = StepResult(seconds=seconds, moved_tokens=moved)
        for rid, seq in self.engine.requests.items():
            if seq.output_ids and rid not in self._first_seen:
                self._first_seen.add(rid)
                res.first_token.append(rid)
        for out in outs:
            if out.request_id not in self._first_seen and out.output_ids:
                res.first_token.append(out.request_id)
            self._first_seen.discard(out.request_id)
            res.finished.append(
                {
                    "request_id": out.request_id,
                    "output_ids": list(out.output_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "num_preemptions": out.num_preemptions,
                    "restored_tokens": out.num_restored_tokens,
                }
            )
        res.batches = self.engine.take_kv_events()
        res.prefill_tokens, res.decodes = _step_counts(self.engine.scheduler.last_output)
        return res

    def fail(self) -> list[Hashable]:
        """Die and restart empty (a fresh engine, same weights); return the ids that were in
        flight."""
        lost = list(self.engine.requests)
        self._lose_objects()
        self._fetches = []
        self._start()
        return lost

    def cached_hashes(self) -> set:
        """The block hashes this replica's pool caches now (for checks; the router never calls
        it)."""
        return set(self.engine.block_manager.pool.cached)

    def stats(self) -> dict:
        """The engine's stats."""
        return {**self.engine.stats(), "fetch_failures": self.fetch_failures}


class LocalHandle:
    """Calls a replica in this process."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica

    def call(self, method: str, *args: Any) -> Any:
        """``replica.method(*args)``."""
        return getattr(self.replica, method)(*args)


class RayHandle:
    """Calls a replica that runs as a Ray actor (blocking: ``ray.get``)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def call(self, method: str, *args: Any) -> Any:
        """``ray.get(actor.method.remote(*args))``."""
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))


def ray_available() -> bool:
    """Whether Ray can be imported here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropRayTokenNotice(logging.Filter):
    """Drops Ray's one-line notice that a new local cluster uses token authentication (its
    default)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_TOKEN_NOTICE)


def quiet_ray_token_notice() -> None:
    """Silence that notice only (a reader takes it for an error). Setting ``RAY_AUTH_MODE=token``
    instead (Ray's advice) made ``ray.init`` fail with InvalidAuthToken, so Ray keeps its
    default."""
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropRayTokenNotice) for f in log.filters):
        log.addFilter(_DropRayTokenNotice())


def start_ray(num_cpus: int | None = 2, address: str | None = None, **kwargs: Any) -> None:
    """``ray.init`` for kvlab: a local instance (``num_cpus``, no dashboard) or an existing cluster
    (``address``).

    Locally, the workers get this checkout on ``PYTHONPATH`` (so a worktree's kvlab is the one they
    import), the raylet and its agents get two minutes to register
    (``RAY_raylet_start_wait_time_s``, ``RAY_agent_register_timeout_ms``: a loaded laptop can take
    that long), and Ray's memory monitor is off unless set (``RAY_memory_monitor_refresh_ms=0``: our
    actors are tiny; on a box shared with other jobs it would kill them for others' memory). Only
    public ``ray.init`` arguments and Ray's documented ``RAY_`` variables are used. On a busy
    machine the raylet can give up waiting (about 30 s, not configurable in Ray 2.60) for its
    dashboard agent to report its port, even when the port is fixed (``ray start
    --dashboard-agent-listen-port``); the start is then tried again, three times in all. Ray's
    notice that a local cluster uses token authentication is silenced (``quiet_ray_token_notice``).
    """
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, **kwargs)
        return
    quiet_ray_token_notice()
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    root = str(Path(__file__).resolve().parents[2])
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    for attempt in range(3):  # on a box busy with other jobs the start-up can miss a deadline
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": env}, **kwargs)
            return
        except Exception:  # noqa: BLE001
            # Ray raises several kinds for a missed start; the third re-raises
            ray.shutdown()
            if attempt == 2:
                raise


def ray_replicas(n: int, **engine_kwargs: Any) -> list[RayHandle]:
    """Start ``n`` ``EngineReplica`` actors (``ray.init`` first; each actor loads its own model
    copy).

    The actors ask for no CPU (``num_cpus=0``) so that four of them fit a two-core laptop; on a real
    cluster give them ``num_gpus=1`` instead (``ray.remote(num_gpus=1)(EngineReplica)``).
    """
    import ray

    from .object_store import RayObjectStore

    # blocks move between actors through Ray's store
    engine_kwargs.setdefault("object_store", RayObjectStore())
    actor_cls = ray.remote(num_cpus=0)(EngineReplica)
    actors = [actor_cls.remote(**engine_kwargs) for _ in range(n)]
    handles = [RayHandle(a) for a in actors]
    ray.get([a.info.remote() for a in actors])  # wait until every model is loaded
    return handles
