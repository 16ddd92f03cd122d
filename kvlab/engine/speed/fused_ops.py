"""C++ CPU ops: the elementwise parts of a Llama layer in one pass each (``FusedLlama``), and a
few-row GEMM.

transformers' Llama layer spends a few dozen ATen calls a layer between its GEMMs: RMSNorm is six
(square, mean, add, rsqrt, two products), RoPE five over q and five over k, SwiGLU two, each
residual one. Each call reads and writes whole tensors (in a 16-prompt prefill of 544 tokens, tens
of MB a call) or, in a decode step, costs its dispatch. These ops do the same arithmetic in one pass
over the rows (OpenMP over rows through ``at::parallel_for``), built once per machine from
``csrc/fused_ops.cpp`` (``cpp_build``):

- ``rms_norm(x, w, eps)`` -> ``w * (x * (1 / sqrt(mean(x^2) + eps)))`` per row, as ``LlamaRMSNorm``;
  the sum of squares is added up in another order than ATen's, so a result can differ in its last
  bit;
- ``add_rms_norm(x, d, w, eps)``: ``x += d`` in place (the residual), then ``rms_norm`` of the new
  ``x``;
- ``rope(qkv, cos, sin, heads, dim)``: in place, the first ``heads`` heads of each row rotated as
  HF's ``apply_rotary_pos_emb`` does (``x * cos + rotate_half(x) * sin``); built without contracting
  a product and a sum into one FMA, so every value equals HF's bit for bit;
- ``silu_mul(gu)`` -> ``silu(gu[:, :n]) * gu[:, n:]``: SwiGLU on the ``[gate; up]`` GEMM's output;
  ``e^x`` is Cephes' float polynomial (no call, so the loop vectorises), within a few ulp of ATen's.
- ``pack_panels(w)`` and ``panel_gemm(x, panels, bias, n)``: ``F.linear`` for calls of few rows (a
  decode step's), where the build targets AVX-512 (``panel_gemm_available()``); ``packed_linear``
  says why and when it is used.

Rows are contiguous float32 (the checks raise ``RuntimeError`` naming what is not).
"""

from __future__ import annotations

import functools
from typing import Any

from .cpp_build import build

__all__ = ["load"]

# -ffp-contract=off: a product and a sum stay two roundings, as in ATen's separate ops (RoPE's
# bit-equality); -fno-trapping-math: GCC 12 vectorises the e^x loop (its floor and selects) only
# under it; no value changes
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]


@functools.cache
def load() -> Any:
    """The compiled ops, ``csrc/fused_ops.cpp`` (built on first use, then imported:
    ``cpp_build``)."""
    return build("kvlab_fused_ops", ["fused_ops.cpp"], _FLAGS)
