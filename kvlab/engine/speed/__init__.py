"""kvlab's CPU speed paths, apart from the teaching path: reached only through
``EngineConfig.accelerator`` (``kvlab.engine.accelerator``).

``SpeedPaths`` (``paths``) is the ``Accelerator`` that bundles them:

- ``packed_linear``: oneDNN's prepacked GEMM for the linear layers, and kvlab's panel GEMM for few
  rows;
- ``paged_kernel``: a C++ paged-attention kernel that reads K/V through the block tables in place;
- ``fused_layers`` (``fused_llama``): a Llama decoder with four fused prepacked GEMMs a layer and
  one-pass C++ RMSNorm, RoPE and SwiGLU (``fused_ops``);
- ``cpp_build``: builds ``csrc/*.cpp`` once per machine (``scripts/setup.sh`` runs
  ``python -m kvlab.engine.speed``) and says in one line why a build cannot run.

The engine imports nothing from here: ``import kvlab.engine`` and the teaching path compile nothing.
"""

from .paths import NAMES, SpeedPaths, why_not

__all__ = ["NAMES", "SpeedPaths", "why_not"]
