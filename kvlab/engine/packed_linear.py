"""oneDNN's prepacked GEMM for a model's ``nn.Linear`` layers on a CPU: an opt-in speed path.

``F.linear`` on a CPU calls a general GEMM that lays the weight out again on every call; oneDNN can
lay it out once ("reorder", the way vLLM's CPU backend prepares its linear layers) and then run each
call on the packed copy. On this project's 2-core machine that made a decode step's linear layers about
twice as fast (``scripts/bench.py --packed-linear`` prints the measurement). The price is memory (a
packed copy of every weight beside the original) and the order of the float32 sums: results agree with
``F.linear`` to float32 rounding, not bit for bit, so this path is off by default
(``EngineConfig.packed_linear``) and the notebooks keep the eager path; the tests check that greedy
tokens under it are still HF's on every test architecture.

Nothing of the model is replaced or patched: the runner runs each step's forward inside ``active()``, a
``TorchFunctionMode`` (torch's own dispatch hook, scoped like ``paged_step()``) that sends every
``F.linear`` whose weight is one of the model's packed ``nn.Linear`` weights to the packed GEMM and lets
every other call through. Outside a step the model runs ``F.linear`` as before. A weight changed in
place since it was packed (its ``_version`` or its storage moved) is packed again at its next call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PackedLinears", "packed_gemm", "packed_linear_available"]


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the packed GEMM can run here, else why not (a sentence)."""
    if device.type != "cpu":
        return f"it runs on a CPU only (the model is on {device.type})"
    if dtype != torch.float32:
        return f"it is wired for float32 only (the model is {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def packed_gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` on ``w``'s packed copy (``torch.ops.mkldnn._reorder_linear_weight``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinears:
    """The model's float32 CPU ``nn.Linear`` weights (plain layers, no subclasses), each packed once."""

    def __init__(self, model: Any) -> None:
        """Refuses a model it cannot run (``ValueError`` naming why): its first parameter's device and dtype."""
        p = next(model.parameters())
        why = packed_linear_available(p.device, p.dtype)
        if why is not None:
            raise ValueError(f"packed_linear: {why}")
        # id -> the weight itself (the identity check keeps a reused id from matching)
        self._weights = {
            id(m.weight): m.weight
            for m in model.modules()
            if type(m) is torch.nn.Linear
            and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu"
        }
        # id -> ((data_ptr, _version) when packed, packed weight)
        self._packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    @property
    def weights(self) -> list[torch.Tensor]:
        """The weights it packs."""
        return list(self._weights.values())

    def packed(self, w: torch.Tensor) -> torch.Tensor | None:
        """``w``'s packed copy (packed now if new or changed in place since), or None if ``w`` is not one."""
        if self._weights.get(id(w)) is not w:
            return None
        key = (w.data_ptr(), w._version)
        got = self._packed.get(id(w))
        if got is None or got[0] != key:
            got = key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed[id(w)] = got
        return got[1]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, ``F.linear`` on a packed weight runs the packed GEMM."""
        with torch.no_grad(), _PackedMode(self):
            yield


class _PackedMode(TorchFunctionMode):
    def __init__(self, linears: PackedLinears) -> None:
        super().__init__()
        self.linears = linears

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, *rest = args
            packed = self.linears.packed(w)
            if packed is not None:
                return packed_gemm(x, packed, rest[0] if rest else kwargs.get("bias"))
        return func(*args, **kwargs)
