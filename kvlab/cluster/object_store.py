"""How blocks travel between replicas: an object store with two methods, ``put`` and ``get``
(torch-free).

``RayObjectStore`` is Ray's: the holder's actor ``ray.put``s the blocks (so it owns them) and the
fetcher ``ray.get``s them; if the holder dies first, Ray loses the object and ``get`` raises.
``LocalObjectStore`` is an in-process stand-in with the same failure: ``kill(owner)`` loses that
owner's objects. ``PickleObjectStore`` also serializes, to cost what crossing a process boundary
costs. A fetcher treats ``ObjectLost`` as a miss.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Hashable
from typing import Any, Protocol

__all__ = ["LocalObjectStore", "ObjectLost", "ObjectStore", "PickleObjectStore", "RayObjectStore"]


class ObjectLost(RuntimeError):
    """Raised by ``ObjectStore.get`` when the object is gone (its owner died)."""


class ObjectStore(Protocol):
    """What moves blocks between replicas: put an object, get it back by reference."""

    def put(self, obj: Any, owner: Hashable = None) -> Any:
        """Store ``obj`` (owned by ``owner``); a reference to it."""

    def get(self, ref: Any) -> Any:
        """The object behind ``ref``; raises if it is lost."""


class LocalObjectStore:
    """An in-process object store with Ray's failure mode: ``kill(owner)`` loses every object that
    owner put."""

    def __init__(self) -> None:
        self.objects: dict[int, tuple[Hashable, Any]] = {}
        self._ids = itertools.count()

    def put(self, obj: Any, owner: Hashable = None) -> int:
        """Store ``obj``; its reference (an int)."""
        ref = next(self._ids)
        self.objects[ref] = (owner, obj)
        return ref

    def get(self, ref: int) -> Any:
        """The object, or ``ObjectLost`` if its owner was killed."""
        try:
            return self.objects[ref][1]
        except KeyError:
            raise ObjectLost(f"object {ref} is lost (its owner died)") from None

    def kill(self, owner: Hashable) -> int:
        """The owner died: its objects are lost; how many."""
        lost = [r for r, (o, _) in self.objects.items() if o == owner]
        for r in lost:
            del self.objects[r]
        return len(lost)


class PickleObjectStore(LocalObjectStore):
    """``LocalObjectStore`` that serializes on ``put`` and deserializes on ``get``: the copies a
    process boundary costs."""

    def put(self, obj: Any, owner: Hashable = None) -> int:
        """Store ``obj`` pickled; its reference."""
        return super().put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), owner)

    def get(self, ref: int) -> Any:
        """The object, unpickled (a fresh copy), or ``ObjectLost``."""
        return pickle.loads(super().get(ref))


class RayObjectStore:
    """Ray's object store: ``ray.put`` in the holder (which owns the object), ``ray.get`` in the
    fetcher."""

    def put(self, obj: Any, owner: Hashable = None) -> Any:
        """``ray.put(obj)``: owned by the calling process (the holder's actor)."""
        import ray

        return ray.put(obj)

    def get(self, ref: Any) -> Any:
        """``ray.get(ref)`` (raises ``ObjectLost`` if Ray lost it, e.g. its owner died)."""
        import ray

        try:
            return ray.get(ref, timeout=60)
        except Exception as e:  # noqa: BLE001 - OwnerDiedError, ObjectLostError, GetTimeoutError...
            raise ObjectLost(f"{type(e).__name__}: {e}") from e
