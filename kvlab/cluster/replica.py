"""Fleet replicas: a kvlab ``Engine`` (optionally a Ray actor) or a model-free stand-in, one interface.

Both keep their own block pool, publish KV events (``Engine(..., enable_kv_events=True)``) and answer:

- ``info()``: block size and model fingerprint (the router hashes prompts with them);
- ``add(request_id, prompt, max_tokens, reply=None)``: queue a request (``reply``: the tokens a model-free
  replica "generates"; an engine ignores it and runs its model, greedy, ``ignore_eos``);
- ``step()``: one engine step -> ``StepResult`` (what finished, who got a first token, the KV-event
  batches, the prefill tokens and decodes it ran, its wall seconds);
- ``fail()``: the replica dies and restarts empty: requests in flight are dropped, the cache is gone.

``SimReplica`` runs kvlab's real ``Scheduler`` and ``BlockManager`` with scripted tokens and no model, so
its scheduling, hits, evictions and events are exactly an engine's for the same tokens (the driver's
sim-vs-Ray check relies on this). ``EngineReplica`` wraps a real ``Engine``. ``ray_replicas`` starts
``EngineReplica``s as Ray actors; ``ray.remote`` is applied there, so importing this module needs no Ray.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EngineReplica", "LocalHandle", "RayHandle", "SimReplica", "StepResult", "ray_available", "ray_replicas",
           "start_ray"]


@dataclass
class StepResult:
    """What one replica step did."""

    finished: list[dict] = field(default_factory=list)  # request_id, output_ids, num_cached_tokens, num_preemptions
    first_token: list[Hashable] = field(default_factory=list)  # requests whose first token came out this step
    batches: list = field(default_factory=list)  # EventBatch, oldest first
    prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    decodes: int = 0  # sequences that decoded one token
    seconds: float = 0.0  # wall time of the step on the replica


class _Capture:
    """Wraps ``Scheduler.schedule`` to keep the last ``SchedulerOutput`` (what a step ran)."""

    def __init__(self, scheduler) -> None:
        self.last = None
        self._orig = scheduler.schedule
        scheduler.schedule = self

    def __call__(self):
        self.last = self._orig()
        return self.last

    def counts(self) -> tuple[int, int]:
        items = self.last.items if self.last is not None else []
        return (sum(it.end - it.start for it in items if it.is_prefill), sum(not it.is_prefill for it in items))


class SimReplica:
    """The scheduler and block manager of an engine, no model: tokens come from the request's ``reply``."""

    def __init__(self, num_blocks: int = 256, block_size: int = 16, *, model_fingerprint: str = "sim",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> None:
        self.config = dict(num_blocks=num_blocks, block_size=block_size, model_fingerprint=model_fingerprint,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self._start()

    def _start(self) -> None:
        from ..cache.block_manager import BlockManager
        from ..engine.scheduler import Scheduler

        c = self.config
        self.block_manager = BlockManager(c["num_blocks"], c["block_size"], model_fingerprint=c["model_fingerprint"],
                                          enable_kv_events=True)
        self.scheduler = Scheduler(self.block_manager, c["max_num_seqs"], c["max_num_batched_tokens"])
        self._capture = _Capture(self.scheduler)
        self.requests: dict[Hashable, Any] = {}
        self._replies: dict[Hashable, list[int]] = {}
        self._ids = 0
        self._kv_seq = 0

    def info(self) -> dict:
        """Block size and model fingerprint."""
        return {"block_size": self.config["block_size"], "model_fingerprint": self.config["model_fingerprint"]}

    def add(self, request_id: Hashable, prompt: Sequence[int], max_tokens: int, reply: Sequence[int] | None = None) -> None:
        """Queue a request; ``reply`` (at least ``max_tokens`` ids) is what it will "generate"."""
        from ..engine.sampling import SamplingParams
        from ..engine.sequence import Sequence as Seq

        if reply is None or len(reply) < max_tokens:
            raise ValueError("a model-free replica needs the reply tokens (at least max_tokens of them)")
        self.scheduler.check_fits(len(prompt), max_tokens)
        seq = Seq(self._ids, request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self._ids += 1
        self.requests[request_id] = seq
        self._replies[request_id] = list(reply)
        self.scheduler.add(seq)

    def step(self) -> StepResult:
        """One step as ``Engine.step`` takes it: schedule, one token per scheduled sequence, finish in order."""
        from ..cache.kv_events import EventBatch

        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        res = StepResult()
        for item in sched.items:
            seq = item.seq
            seq.output_ids.append(self._replies[seq.request_id][len(seq.output_ids)])
            if len(seq.output_ids) == 1:
                res.first_token.append(seq.request_id)
            if len(seq.output_ids) >= seq.sampling.max_tokens:
                self.scheduler.finish(seq, "length")
                del self.requests[seq.request_id]
                del self._replies[seq.request_id]
                res.finished.append({"request_id": seq.request_id, "output_ids": list(seq.output_ids),
                                     "num_cached_tokens": seq.num_cached_tokens or 0,
                                     "num_preemptions": seq.num_preemptions})
        events = self.block_manager.take_events()
        if events:
            res.batches.append(EventBatch(time.time(), tuple(events), self._kv_seq))
            self._kv_seq += 1
        res.prefill_tokens, res.decodes = self._capture.counts()
        res.seconds = time.perf_counter() - t0
        return res

    def fail(self) -> list[Hashable]:
        """Die and restart empty; return the ids of the requests that were in flight."""
        lost = list(self.requests)
        self._start()
        return lost

    def cached_hashes(self) -> set:
        """The block hashes this replica's pool caches now (for checks; the router never calls it)."""
        return set(self.block_manager.pool.cached)

    def stats(self) -> dict:
        """Block-manager stats plus preemptions."""
        return {**self.block_manager.stats(), "num_preemptions": self.scheduler.num_preemptions}


class EngineReplica:
    """A kvlab ``Engine`` on a model (the bundled one by default) with KV events on."""

    def __init__(self, model: str | None = None, num_blocks: int = 256, block_size: int = 16, *, device: str = "cpu",
                 dtype: str = "float32", max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 torch_threads: int | None = 1) -> None:
        import torch

        from ..engine.models import load_model

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.model, self.tokenizer = load_model(model, device=device, dtype=dtype)
        self.config = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens)
        self._start()

    def _start(self) -> None:
        from ..engine.engine import Engine

        self.engine = Engine(self.model, self.tokenizer, enable_kv_events=True, **self.config)
        self._capture = _Capture(self.engine.scheduler)
        self._first_seen: set[Hashable] = set()

    def info(self) -> dict:
        """Block size and the model fingerprint the engine's block manager hashes with."""
        bm = self.engine.block_manager
        return {"block_size": bm.block_size, "model_fingerprint": bm.model_fingerprint}

    def add(self, request_id: Hashable, prompt: Sequence[int], max_tokens: int, reply: Sequence[int] | None = None) -> None:
        """Queue a request; the model generates ``max_tokens`` tokens greedily (``reply`` is ignored)."""
        from ..engine.sampling import SamplingParams

        self.engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id)

    def step(self) -> StepResult:
        """One ``Engine.step``; first tokens read from the engine's live requests."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        seconds = time.perf_counter() - t0
        res = StepResult(seconds=seconds)
        for rid, seq in self.engine.requests.items():
            if seq.output_ids and rid not in self._first_seen:
                self._first_seen.add(rid)
                res.first_token.append(rid)
        for out in outs:
            if out.request_id not in self._first_seen and out.output_ids:
                res.first_token.append(out.request_id)
            self._first_seen.discard(out.request_id)
            res.finished.append({"request_id": out.request_id, "output_ids": list(out.output_ids),
                                 "num_cached_tokens": out.num_cached_tokens, "num_preemptions": out.num_preemptions})
        res.batches = self.engine.take_kv_events()
        res.prefill_tokens, res.decodes = self._capture.counts()
        return res

    def fail(self) -> list[Hashable]:
        """Die and restart empty (a fresh engine, same weights); return the ids that were in flight."""
        lost = list(self.engine.requests)
        self._start()
        return lost

    def cached_hashes(self) -> set:
        """The block hashes this replica's pool caches now (for checks; the router never calls it)."""
        return set(self.engine.block_manager.pool.cached)

    def stats(self) -> dict:
        """The engine's stats."""
        return self.engine.stats()


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


def start_ray(num_cpus: int | None = 2, address: str | None = None, **kwargs: Any) -> None:
    """``ray.init`` for kvlab: a local instance (``num_cpus``, no dashboard) or an existing cluster (``address``).

    Locally, the workers get this checkout on ``PYTHONPATH`` (so a worktree's kvlab is the one they import),
    the raylet and its agents get fixed ports and two minutes to register (a loaded laptop can take that long), and Ray's memory monitor is
    off unless set (our actors are tiny; on a box shared with other jobs it would kill them for others' memory).
    """
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, **kwargs)
        return
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    with _fixed_agent_ports():
        for attempt in range(2):  # on a box busy with other jobs the start-up can still miss a deadline
            try:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": env}, **kwargs)
                return
            except Exception:
                ray.shutdown()
                if attempt:
                    raise


@contextlib.contextmanager
def _fixed_agent_ports():
    """Give Ray's node agents fixed free ports, so the raylet need not wait for them to report theirs.

    With port 0 the raylet waits about 30 s for each agent (a Python process) to write its port to a file and
    aborts when one is late, which happens on a loaded two-core machine. Patches Ray's private ``RayParams``
    for the duration of ``ray.init`` only; if that class changes, Ray starts as usual.
    """
    try:
        from ray._private import parameter
        orig = parameter.RayParams.__init__
    except (ImportError, AttributeError):
        yield
        return

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        for name in ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port",
                     "runtime_env_agent_port"):
            if hasattr(self, name) and not getattr(self, name):
                setattr(self, name, free_port())

    parameter.RayParams.__init__ = init
    try:
        yield
    finally:
        parameter.RayParams.__init__ = orig


def ray_replicas(n: int, **engine_kwargs: Any) -> list[RayHandle]:
    """Start ``n`` ``EngineReplica`` actors (``ray.init`` first; each actor loads its own model copy).

    The actors ask for no CPU (``num_cpus=0``) so that four of them fit a two-core laptop; on a real
    cluster give them ``num_gpus=1`` instead (``ray.remote(num_gpus=1)(EngineReplica)``).
    """
    import ray

    actor_cls = ray.remote(num_cpus=0)(EngineReplica)
    actors = [actor_cls.remote(**engine_kwargs) for _ in range(n)]
    handles = [RayHandle(a) for a in actors]
    ray.get([a.info.remote() for a in actors])  # wait until every model is loaded
    return handles
