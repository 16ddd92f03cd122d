"""Ray starts once per test session (about 20 s on 2 cores), shared by every file that uses real
actors; so are the actors themselves (``ray_replicas_for``)."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """The ``ray`` module with a local instance running (Ray is in the dev extra: a start that fails
    fails)."""
    ray = pytest.importorskip(
        "ray", reason="Ray is the optional extra kvlab[cluster]: pip install -e .[cluster]"
    )
    from kvlab.cluster import start_ray

    start_ray(num_cpus=2)
    try:
        yield ray
    finally:
        ray.shutdown()


class ReplicaPool:
    """``EngineReplica`` actors kept for the session. Each file asks for ``n`` with its own engine
    settings and gets live actors re-initialised to them (a new actor costs torch's import and a
    model load, about 20 s each on a busy 2-core machine); an actor a test killed is replaced by a
    new one from ``ray_replicas``."""

    def __init__(self, ray):
        self.ray = ray
        self.handles = []

    def _alive(self, handle) -> bool:
        try:
            self.ray.get(handle.actor.__ray_ready__.remote(), timeout=120)
        except self.ray.exceptions.RayActorError:
            return False
        return True

    def get(self, n: int, **engine_kwargs) -> list:
        """``n`` actors, each as ``ray_replicas(n, **engine_kwargs)`` would start it (the bundled
        model on CPU, float32, one torch thread: the pool does not take other model settings)."""
        from kvlab.cluster import ray_replicas
        from kvlab.cluster.object_store import RayObjectStore

        assert not {"model", "device", "dtype", "torch_threads"} & set(engine_kwargs), engine_kwargs

        # defined here, so that cloudpickle sends the function itself, not a reference to this
        # conftest (which the actor cannot import)
        def fresh_replica(replica, kwargs):
            """On the actor: ``EngineReplica.__init__`` again on the model it already loaded (a
            new engine, object store and counters: what a new actor has, without torch's import
            and the model load)."""
            replica.__init__((replica.model, replica.tokenizer), **kwargs)
            return replica.info()

        self.handles = [h for h in self.handles if self._alive(h)]
        reused = self.handles[:n]
        # the re-initialisations run on every actor at once, as ray_replicas loads its actors
        ready = [
            h.actor.__ray_call__.remote(
                fresh_replica, {"object_store": RayObjectStore(), **engine_kwargs}
            )
            for h in reused
        ]
        self.ray.get(ready)
        if len(reused) < n:
            self.handles += ray_replicas(n - len(reused), **engine_kwargs)
        return self.handles[:n]


@pytest.fixture(scope="session")
def ray_replicas_for(ray_session):
    """``ray_replicas_for(n, **engine_kwargs)``: live ``RayHandle``s, fresh engines (see
    ``ReplicaPool``); the actors are killed when the session ends."""
    pool = ReplicaPool(ray_session)
    try:
        yield pool.get
    finally:
        for handle in pool.handles:
            ray_session.kill(handle.actor)
