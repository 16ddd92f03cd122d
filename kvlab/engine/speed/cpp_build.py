"""Build a small C++ CPU extension once per machine, then import the build: the step kvlab's kernels share.

``torch.utils.cpp_extension.load_inline`` compiles the source (a C++ compiler and ninja) into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/kvlab/torch_extensions``. A build's name hashes its source, its
flags, the CPU's kind (``-march=native`` builds for the CPU that made it) and the torch version; a build
made before under that name is imported as it is. ``load_inline`` would build it again whenever its
command line changed, and that line holds the torch installation's include paths: each venv on the machine
(a fresh clone's, for one) would rebuild it, about 30 s, and the next venv again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["EXP_SOURCE", "build", "build_directory", "build_failure"]

# C++ that both kernels paste into their sources (after <algorithm>, <cmath>, <cstdint> and <cstring>)
EXP_SOURCE = r"""
// e^x by Cephes' expf polynomial: no call and no branch, so a loop of it vectorises (GCC 12: under
// -fno-trapping-math). e^-87 (~1.6e-38) for x below -87, inf from about 88.4 up (the float e^x overflows
// from 88.72), NaN for NaN
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 89.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  // x - n * ln 2 in two parts (ln 2 = 0.693359375 - 2.12194440e-4)
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  // 2^n from its exponent bits (n is in [-126, 128] after the clamp, 2^128 the bits of inf; a NaN's n is
  // taken as 0, and y carries the NaN)
  int32_t bits = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float p;
  std::memcpy(&p, &bits, sizeof p);
  return y * p;
}
"""


def build_directory() -> Path:
    """The build folder: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/kvlab/torch_extensions``."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvlab" / "torch_extensions"


def build_failure(load: Callable[[], Any]) -> str | None:
    """None when ``load()`` (building if needed) succeeds, else the error: ``"<type>: <its first line>"``."""
    try:
        load()
    # broad on purpose: whatever the build raises (no compiler, no ninja, a compile error) is the reason
    # the feature is refused; the engine raises it as a ValueError naming it
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:300]}"
    return None


def build(stem: str, decl: str, source: str, functions: list[str], flags: list[str]) -> Any:
    """The module ``stem_<hash>`` built from ``source`` (its ``functions`` declared in ``decl``)."""
    from torch.utils import cpp_extension

    cpu = torch.backends.cpu.get_cpu_capability()
    key = "\n".join([source, *flags, cpu, torch.__version__]).encode()
    name = f"{stem}_{hashlib.sha256(key).hexdigest()[:12]}"
    path = build_directory() / name
    built = path / f"{name}.so"
    if built.is_file():
        try:
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        # a partial or foreign file (e.g. a build under way in another process): build it here instead
        except ImportError:
            pass
    path.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(
        name,
        cpp_sources=[decl, source],
        functions=functions,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(path),
        verbose=False,
    )
