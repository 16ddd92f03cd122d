"""``SpeedPaths``: kvlab's CPU speed paths as one ``kvlab.engine.accelerator.Accelerator``.

``Engine(model, tok, accelerator=SpeedPaths(packed_linear=True, paged_kernel=True))`` asks for them
by name (a path that cannot run raises ``ValueError`` naming why); ``SpeedPaths.auto(model)`` turns
each on where it runs and keeps why the others are off, for ``kvlab serve``'s one line
(``describe``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ..models import model_device_dtype
from .cpp_build import LOCK_WAIT_S, lock_wait
from .fused_llama import FusedLlama, fused_layers_available
from .packed_linear import PackedLinears, packed_gemm, packed_linear_available
from .paged_kernel import PagedKernel, paged_kernel_available

__all__ = ["NAMES", "BoundSpeedPaths", "SpeedPaths", "why_not"]

# the paths, in the order they are shown
NAMES = ("packed_linear", "paged_kernel", "fused_layers")


def why_not(name: str, model: Any) -> str | None:
    """None when path ``name`` can run ``model`` here (building its C++ if needed), else why."""
    device, dtype = model_device_dtype(model)
    if name == "packed_linear":
        return packed_linear_available(device, dtype)
    if name == "paged_kernel":
        return paged_kernel_available(device, dtype)
    if name == "fused_layers":
        return fused_layers_available(model)
    raise ValueError(f"unknown speed path {name!r}: one of {', '.join(NAMES)}")


@dataclass(frozen=True)
class SpeedPaths:
    """Which speed paths an engine runs (each off by default); ``EngineConfig.accelerator``.

    ``packed_linear``: prepacked GEMMs for the linear layers, oneDNN's and (few rows) kvlab's panel
    GEMM. ``paged_kernel``: a C++ paged-attention kernel that reads K/V in place. ``fused_layers``:
    a Llama decoder run with four fused prepacked GEMMs a layer and one-pass C++ RMSNorm, RoPE and
    SwiGLU. All for a float32 model on a CPU. ``off``: why a path is off, where ``auto`` decided it
    (for ``describe``).
    """

    packed_linear: bool = False
    paged_kernel: bool = False
    fused_layers: bool = False
    off: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in NAMES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def auto(cls, model: Any, off: set[str] | frozenset[str] = frozenset(),
             build_wait_s: float | None = None, rebuild_stale: bool = True) -> SpeedPaths:
        """Each path on where it can run ``model`` here; ``off``: turned off by hand ("turned off").

        ``build_wait_s``: how long a C++ build waits on another process's build of it before the
        path is off (default ``cpp_build.LOCK_WAIT_S``). ``rebuild_stale=False``: a path whose build
        was killed mid-way is off for now, not rebuilt (``kvlab serve``: it listens promptly).
        """
        unknown = set(off) - set(NAMES)
        if unknown:
            raise ValueError(f"unknown speed path(s) {sorted(unknown)}: {', '.join(NAMES)}")
        wait = (
            contextlib.nullcontext()
            if build_wait_s is None and rebuild_stale
            else lock_wait(LOCK_WAIT_S if build_wait_s is None else build_wait_s, rebuild_stale)
        )
        with wait:
            whys = {name: "turned off" if name in off else why_not(name, model) for name in NAMES}
        on = {name: why is None for name, why in whys.items()}
        return cls(**on, off=tuple((n, why) for n, why in whys.items() if why is not None))

    @property
    def on(self) -> dict[str, bool]:
        """``{name: on}`` for every path."""
        return {name: getattr(self, name) for name in NAMES}

    def describe(self) -> str:
        """One line: ``speed paths: packed_linear on, paged_kernel off (why), ...``."""
        whys = dict(self.off)
        parts = [f"{n} on" if on else f"{n} off" + (f" ({whys[n]})" if n in whys else "")
                 for n, on in self.on.items()]
        return "speed paths: " + ", ".join(parts)

    def replace(self, **changes: Any) -> SpeedPaths:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def bind(self, model: Any, store: Any) -> BoundSpeedPaths:
        """The paths ready for ``model`` and its K/V ``store`` (``ValueError``: one cannot run)."""
        return BoundSpeedPaths(self, model, store)


class BoundSpeedPaths:
    """``SpeedPaths`` bound to one engine: its packed weights, its kernel, its fused decoder."""

    def __init__(self, paths: SpeedPaths, model: Any, store: Any) -> None:
        # each raises ValueError naming why where it cannot run (not CPU float32, no oneDNN, no
        # build, ...)
        self.packed = self.kernel = self.decoder = None
        if paths.packed_linear:
            self.packed = PackedLinears(model)
        if paths.paged_kernel:
            self.kernel = PagedKernel(store)
        if paths.fused_layers:
            self.decoder = FusedLlama(model)

    def plan(self, batch: Any) -> Any:
        """The kernel's plan of this step (``paged_kernel.KernelStep``); None without the kernel."""
        return None if self.kernel is None else self.kernel.plan(batch)

    def linear(self, decoder_runs: bool) -> AbstractContextManager[None]:
        """``F.linear`` on the model's weights sent to their packed GEMMs, unless the fused decoder
        (which packs its own) is the one that runs."""
        if self.packed is None or (decoder_runs and self.decoder is not None):
            return contextlib.nullcontext()
        return self.packed.active()

    def head(self, hidden: torch.Tensor, lm_head: Any) -> torch.Tensor | None:
        """The head's packed GEMM on ``hidden`` ``(N, hidden)``; None if its weight is unpacked."""
        packed = None if self.packed is None else self.packed.packed(lm_head.weight)
        return None if packed is None else packed_gemm(hidden, packed, lm_head.bias)
