"""oneDNN's prepacked GEMM for a model's ``nn.Linear`` layers on a CPU: an opt-in speed path.

``F.linear`` on a CPU calls a general GEMM that lays the weight out again on every call; oneDNN can
lay it out once ("reorder", the way vLLM's CPU backend prepares its linear layers) and then run each
call on the packed copy. On this project's 2-core machine that made a decode step's linear layers
about twice as fast (``scripts/bench.py --packed-linear`` prints the measurement). The price is
memory (a packed copy of every weight beside the original) and the order of the float32 sums:
results agree with ``F.linear`` to float32 rounding, not bit for bit, so this path is off by default
(``SpeedPaths.packed_linear``) and the notebooks keep the eager path; the tests check that greedy
tokens under it are still HF's on every test architecture.

A decode step's GEMMs have few rows (one per sequence), and they are bound by reading the weights:
at 16 rows oneDNN read SmolLM2's weights well below the rate one core streams memory at (commit
deb8871 gives the numbers; ``scripts/bench.py`` measures this machine's streaming read bandwidth).
Where the C++ ops (``fused_ops``) are built with AVX-512, each weight is also laid out in panels of
16 output columns, k by k (``pack_panels``), and calls of up to ``PANEL_ROWS`` rows run
``panel_gemm``: up to 16 rows' sums in registers per panel, one pass over the panels, each
prefetched into L2 ahead of its use; all of SmolLM2's GEMMs at 16 and 64 rows, on one thread and
two, measured faster this way than with oneDNN (commit deb8871). Larger calls (prefills) keep
oneDNN, which blocks for reuse across many rows. The panels are a second packed copy of each weight.

Nothing of the model is replaced or patched: the runner runs each step's forward inside
``active()``, a ``TorchFunctionMode`` (torch's own dispatch hook, scoped like ``paged_step()``) that
sends every ``F.linear`` whose weight is one of the model's packed ``nn.Linear`` weights to the
packed GEMM and lets every other call through. Outside a step the model runs ``F.linear`` as before.
A weight changed in place since it was packed (its ``_version`` or its storage moved) is packed
again at its next call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "PANEL_ROWS",
    "PackedLinears",
    "PackedWeight",
    "pack",
    "packed_gemm",
    "packed_linear_available",
]

# calls of up to this many rows go to the panel GEMM where it runs. All of SmolLM2's GEMMs, median
# ms, oneDNN -> panels: 1 thread 56.6 -> 41.8 at 16 rows, 96.7 -> 81.1 at 32, 172 -> 159 at 64; 2
# threads 32.5 -> 22.3 at 16, 91.8 -> 82.9 at 64, 168 -> 164 at 128
PANEL_ROWS = 64
_NO_BIAS = torch.empty(0)


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the packed GEMM can run here, else why not (a sentence)."""
    if device.type != "cpu":
        return f"it runs on a CPU only (the model is on {device.type})"
    if dtype != torch.float32:
        return f"it is wired for float32 only (the model is {dtype})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


class PackedWeight(NamedTuple):
    """A weight's packed copies: oneDNN's, and the panels where the panel GEMM runs (else None)."""

    onednn: torch.Tensor
    panels: torch.Tensor | None
    out_features: int


@functools.cache
def _panel_ops() -> Any:
    """The C++ ops when their panel GEMM runs here (built with AVX-512), else None."""
    from . import fused_ops
    from .cpp_build import build_failure

    if build_failure(fused_ops.load) is not None:
        return None
    ops = fused_ops.load()
    return ops if ops.panel_gemm_available() else None


def pack(w: torch.Tensor) -> PackedWeight:
    """``w``'s (a float32 CPU ``(out, in)`` weight) packed copies."""
    w = w.detach()
    ops = _panel_ops()
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, None),
                        None if ops is None else ops.pack_panels(w.contiguous()), w.shape[0])


def packed_gemm(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` on ``w``'s packed copies (``pack``): the panels up to ``PANEL_ROWS``
    rows, else oneDNN's."""
    k = x.shape[-1]
    if packed.panels is not None and x.dtype == torch.float32 and x.numel() <= PANEL_ROWS * k:
        b = _NO_BIAS if bias is None else bias.contiguous()
        out = _panel_ops().panel_gemm(
            x.reshape(-1, k).contiguous(), packed.panels, b, packed.out_features
        )
        return out.view(*x.shape[:-1], packed.out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")


class PackedLinears:
    """The model's float32 CPU ``nn.Linear`` weights (plain layers, no subclasses), each packed
    once."""

    def __init__(self, model: Any) -> None:
        """Refuses a model it cannot run (``ValueError`` naming why): its first parameter's device
        and dtype."""
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
        self._packed: dict[int, tuple[tuple[int, int], PackedWeight]] = {}

    @property
    def weights(self) -> list[torch.Tensor]:
        """The weights it packs."""
        return list(self._weights.values())

    def packed(self, w: torch.Tensor) -> PackedWeight | None:
        """``w``'s packed copies (packed now if new or changed in place since), or None if ``w`` is
        not one."""
        if self._weights.get(id(w)) is not w:
            return None
        key = (w.data_ptr(), w._version)
        got = self._packed.get(id(w))
        if got is None or got[0] != key:
            got = key, pack(w)
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
