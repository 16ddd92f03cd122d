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
from pathlib import Path
from typing import Any

import torch

__all__ = ["build", "build_directory"]


def build_directory() -> Path:
    """The build folder: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/kvlab/torch_extensions``."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvlab" / "torch_extensions"


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
