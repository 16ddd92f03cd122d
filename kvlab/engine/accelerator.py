"""The one seam between the engine and its speed paths: ``EngineConfig.accelerator`` (pure Python).

The teaching path runs without one (``accelerator=None``): the model's own decoder, ``F.linear`` and
the gather + SDPA paged attention. An accelerator (``kvlab.engine.speed.SpeedPaths`` is kvlab's:
prepacked GEMMs, a C++ paged-attention kernel, fused Llama layers) is bound once to an engine's
model and K/V store; the runner then asks the bound object these things and nothing else:

    runner.forward -- plan(batch) ----------> KernelPlan | None  (PagedBatch.kernel, read per
                   -- linear(decoder_runs) -> context             layer by paged_attention_forward)
                   -- head(hidden, lm_head) > logits | None
                   -- decoder --------------> replaces model.base_model, or None

The engine, the runner and the paged attention import nothing of ``kvlab.engine.speed``: they hold
whatever object satisfies these protocols.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["Accelerator", "BoundAccelerator", "KernelPlan"]


class KernelPlan(Protocol):
    """One step's attention kernel: which groups of sequences it attends, and how."""

    def write_heads(self, layer: int, slot_mapping: Any, key: Any, value: Any) -> None:
        """Write one layer's new K/V ``(kv_heads, T, D)`` into ``slot_mapping``, like the store."""

    def takes(self, group: Any, query_heads_per_kv: int) -> bool:
        """Whether it attends ``group`` (an ``AttnGroup``); the others take the SDPA path."""

    def attend(self, group: Any, layer: int, q_all: Any, out: Any, scaling: float | None,
               window: int | None) -> Any:
        """Attend ``group``'s rows of ``q_all`` ``(T, heads, D)`` into ``out`` (made if None)."""


class BoundAccelerator(Protocol):
    """An accelerator bound to one engine's model and K/V store (``Accelerator.bind``)."""

    # runs in place of ``model.base_model`` (same call, same ``(hidden,)`` result); None: the
    # model's own
    decoder: Callable[..., tuple[Any]] | None

    def plan(self, batch: Any) -> KernelPlan | None:
        """This step's kernel plan (None: the SDPA path attends every group)."""

    def linear(self, decoder_runs: bool) -> AbstractContextManager[None]:
        """A context the step's forward runs in (e.g. ``F.linear`` sent to prepacked GEMMs)."""

    def head(self, hidden: Any, lm_head: Any) -> Any:
        """``(N, hidden)`` -> ``(N, vocab)`` logits through ``lm_head``'s weights, or None."""


@runtime_checkable
class Accelerator(Protocol):
    """What ``EngineConfig.accelerator`` names: immutable settings, bound once per engine."""

    def bind(self, model: Any, store: Any) -> BoundAccelerator:
        """Ready for ``model`` and its K/V ``store``; ``ValueError`` if a path cannot run."""

    def describe(self) -> str:
        """One line: which speed paths are on and off, and why."""
