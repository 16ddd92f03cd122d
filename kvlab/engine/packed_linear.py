"""oneDNN's prepacked GEMM for a model's ``nn.Linear`` layers on a CPU: an opt-in speed path.

``F.linear`` on a CPU calls a general GEMM that lays the weight out again on every call; oneDNN can
lay it out once ("reorder", the way vLLM's CPU backend prepares its linear layers) and then run each
call on the packed copy. On this project's 2-core machine that made a decode step's linear layers about
twice as fast (``scripts/bench.py --packed-linear`` prints the measurement). The price is memory (a
packed copy of every weight beside the original) and the order of the float32 sums: results agree with
``F.linear`` to float32 rounding, not bit for bit, so this path is off by default
(``EngineConfig.packed_linear``) and the notebooks keep the eager path; the tests check that greedy
tokens under it are still HF's on every test architecture.

Nothing of transformers' is replaced: while the engine is attached, each packed ``nn.Linear`` gets an
instance ``forward`` that calls the packed GEMM, and ``detach`` deletes it, so the model is the caller's
own again between busy periods. A weight changed in place since it was packed (its ``_version`` or its
storage moved) is packed again at the next attach.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["PackedLinears", "packed_linear_available"]


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the packed GEMM can run here, else why not (a sentence)."""
    if device.type != "cpu":
        return f"it runs on a CPU only (the model is on {device.type})"
    if dtype != torch.float32:
        return f"it is wired for float32 only (the model is {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def _packed_forward(
    packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _key(w: torch.Tensor) -> tuple[int, int]:
    return w.data_ptr(), w._version


class PackedLinears:
    """The model's float32 CPU ``nn.Linear`` layers (plain ones, no subclasses), packed once."""

    def __init__(self, model: Any) -> None:
        self.modules = [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear
            and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu"
        ]
        # module -> (weight key when packed, packed weight)
        self._packed: dict[torch.nn.Module, tuple[tuple[int, int], torch.Tensor]] = {}

    def weight(self, m: torch.nn.Linear) -> torch.Tensor:
        """``m``'s packed weight, packed now if it is new or changed since."""
        got = self._packed.get(m)
        if got is None or got[0] != _key(m.weight):
            got = _key(m.weight), torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
            self._packed[m] = got
        return got[1]

    @torch.no_grad()
    def attach(self) -> None:
        """Route every packed layer's ``forward`` through its packed weight."""
        for m in self.modules:
            m.forward = functools.partial(_packed_forward, self.weight(m), m.bias)

    def detach(self) -> None:
        """Give every layer its own ``forward`` back."""
        for m in self.modules:
            m.__dict__.pop("forward", None)

    def linear(self, m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``m(x)`` on the packed weight (the runner's head seam calls it directly)."""
        return _packed_forward(self.weight(m), m.bias, x)
