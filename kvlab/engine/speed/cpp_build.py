"""Build a C++ CPU extension from ``csrc/*.cpp`` once per machine, then import the build.

``torch.utils.cpp_extension.load`` compiles the sources (a C++ compiler and ninja) into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/kvlab/torch_extensions``. A build's name hashes its sources
(and the headers beside them), its flags, what ``-march=native`` means on this CPU (``cpu_key``) and
the torch version; a build made before under that name is imported as it is. ``load`` alone would
build it again whenever its command line changed, and that line holds the torch installation's
include paths: each venv on the machine (a fresh clone's, for one) would rebuild it, about 30 s, and
the next venv again.

What can go wrong is said in one line (``BuildError``, ``build_failure``): no compiler, no ninja, a
compile error (its first ``error:`` line), or a ``lock`` that torch leaves in the build folder while
it builds. A build killed mid-way leaves that lock behind, and torch would wait on it forever: a
lock that no live process holds (``lock_holders``; without ``/proc``, one older than
``STALE_LOCK_S``) is removed and the build runs; a lock a live process holds (or a killed start's
compiler still working in the folder) is waited on for ``LOCK_WAIT_S`` at most, then the build gives
up naming the process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CSRC",
    "LOCK_WAIT_S",
    "STALE_LOCK_S",
    "BuildError",
    "build",
    "build_directory",
    "build_failure",
    "build_name",
    "cpu_key",
    "lock_holders",
    "lock_wait",
]

# the C++ sources and their shared header
CSRC = Path(__file__).resolve().parent / "csrc"
# seconds a start waits on a build another live process is running, before it goes on without it
# (``kvlab serve`` waits less: ``lock_wait``)
LOCK_WAIT_S = float(os.environ.get("KVLAB_BUILD_WAIT_S", "600"))
# where no /proc says who holds a lock: older than this, a killed build's (a build takes ~30 s)
STALE_LOCK_S = 600.0


class BuildError(RuntimeError):
    """A C++ speed path could not be built here; the message is one line saying why."""


def build_directory() -> Path:
    """The build folder: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/kvlab/torch_extensions``."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvlab" / "torch_extensions"


def compiler() -> str:
    """The C++ compiler torch's build runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


@functools.cache
def _cpu_key(cxx: str) -> str:
    # what -march=native turns on, as the compiler resolves it: its -march value and enabled flags
    try:
        out = subprocess.run([cxx, "-march=native", "-Q", "--help=target"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    lines = [" ".join(line.split()) for line in out.splitlines()]
    resolved = sorted(line for line in lines if line.startswith("-m") and ("[enabled]" in line
                                                                           or "-march=" in line))
    if resolved:
        return "march:" + hashlib.sha256("\n".join(resolved).encode()).hexdigest()[:16]
    # no GCC-style answer (clang, no compiler): the CPU's own feature flags
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next((line for line in cpuinfo.read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    words = " ".join(sorted(flags.partition(":")[2].split()))
    return "cpuflags:" + hashlib.sha256(words.encode()).hexdigest()[:16]


def cpu_key() -> str:
    """What ``-march=native`` builds for on this CPU: a hash of the compiler's resolved flags.

    Two CPUs of one capability level (both "AVX-512") can differ in what ``-march=native`` turns on,
    so a home folder shared by both must not load the other's build. Without a GCC-style compiler: a
    hash of the CPU's feature flags (``/proc/cpuinfo``).
    """
    return _cpu_key(compiler())


def lock_holders(lock: Path) -> list[int] | None:
    """The ids of the live processes building under ``lock``: those that hold it open (torch keeps
    it open while it builds) and those working in its folder (a killed start's ninja and compiler
    run on).

    None where this cannot be told (no readable ``/proc``).
    """
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target, folder, holders = str(lock.resolve()), str(lock.parent.resolve()), []
    for pid in filter(str.isdigit, os.listdir(proc)):
        try:
            if os.readlink(proc / pid / "cwd") == folder:
                holders.append(int(pid))
                continue
            fds = os.listdir(proc / pid / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(proc / pid / "fd" / fd) == target:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    return holders


# False within ``lock_wait(..., rebuild_stale=False)``: a killed build's lock is removed, not
# rebuilt
REBUILD_STALE = True


@contextlib.contextmanager
def lock_wait(seconds: float, rebuild_stale: bool = True) -> Iterator[None]:
    """Within the block, a build waits at most ``seconds`` on another live build (``kvlab serve``:
    it must start listening promptly; elsewhere ``LOCK_WAIT_S``). ``rebuild_stale=False``: a killed
    build's lock is removed and the path stays off for now (a rebuild takes minutes on 2 cores)."""
    global LOCK_WAIT_S, REBUILD_STALE
    old, LOCK_WAIT_S = (LOCK_WAIT_S, REBUILD_STALE), seconds
    REBUILD_STALE = rebuild_stale
    try:
        yield
    finally:
        LOCK_WAIT_S, REBUILD_STALE = old


def _clear_lock(path: Path, name: str, wait_s: float) -> None:
    """Remove a killed build's lock under ``path``; wait for a live one ``wait_s`` s at most."""
    lock, deadline, said = path / "lock", time.monotonic() + wait_s, False
    while lock.exists():
        holders = lock_holders(lock)
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if holders == [] or (holders is None and age > STALE_LOCK_S):
            # a build killed mid-way: nobody will release it
            print(f"kvlab: removing a stale build lock ({lock}, {age:.0f} s old, no live process "
                  "holds it)", file=sys.stderr, flush=True)
            lock.unlink(missing_ok=True)
            if not REBUILD_STALE:
                raise BuildError(
                    f"a killed build of {name} left its lock (removed now); not rebuilt "
                    "during this start: the next start or `python -m kvlab.engine.speed` "
                    "builds it"
                )
            return
        who = (f"process {', '.join(map(str, holders))}" if holders
               else f"a process unknown here ({age:.0f} s)")
        if time.monotonic() >= deadline:
            raise BuildError(f"another build of {name} holds {lock} ({who}); gave up after "
                             f"{wait_s:.0f} s")
        if not said:
            print(f"kvlab: waiting up to {wait_s:.0f} s for {who}'s build of {name} ({lock})",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))


def _check_tools() -> None:
    """Raise ``BuildError`` naming a missing tool (a compiler, ninja), before torch builds."""
    from torch.utils import cpp_extension

    cxx = compiler()
    if shutil.which(cxx) is None:
        where = f"CXX={cxx!r} is not a program" if "CXX" in os.environ else "no c++ on PATH"
        raise BuildError(f"no C++ compiler found ({where}; install g++ or set CXX)")
    if not cpp_extension.is_ninja_available():
        raise BuildError("ninja not found (pip install ninja)")


def _import(name: str, built: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_name(stem: str, sources: Sequence[str], flags: Sequence[str]) -> str:
    """``stem_<hash>``: a hash of the sources and headers, flags, ``cpu_key()``, torch version."""
    texts = [p.read_text() for p in [*(CSRC / s for s in sources), *sorted(CSRC.glob("*.h"))]]
    key = "\n".join([*texts, *flags, cpu_key(), torch.__version__]).encode()
    return f"{stem}_{hashlib.sha256(key).hexdigest()[:12]}"


def build(stem: str, sources: Sequence[str], flags: list[str], wait_s: float | None = None) -> Any:
    """The module ``build_name(...)`` built from ``csrc/<source>`` (each with its PYBIND11_MODULE).

    ``wait_s``: how long to wait on another live process's build of it (default ``LOCK_WAIT_S``).
    """
    paths = [CSRC / s for s in sources]
    name = build_name(stem, sources, flags)
    path = build_directory() / name
    built = path / f"{name}.so"
    if built.is_file():
        try:
            return _import(name, built)
        # a partial or foreign file: build it here instead
        except ImportError:
            pass
    _check_tools()
    path.mkdir(parents=True, exist_ok=True)
    _clear_lock(path, name, LOCK_WAIT_S if wait_s is None else wait_s)
    if built.is_file():
        # another process finished it while this one waited
        try:
            return _import(name, built)
        except ImportError:
            pass
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name,
        sources=[str(p) for p in paths],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(CSRC)],
        build_directory=str(path),
        verbose=False,
    )


def _one_line(e: BaseException) -> str:
    """``e`` in one line: a build's first compiler ``error:`` line, else the first line."""
    text = str(e).strip()
    if isinstance(e, AssertionError) and text.endswith(("distutils/core.py", "distutils\\core.py")):
        # setuptools' _distutils_hack asserts when the stdlib's distutils was imported first (e.g.
        # by importlib.util.find_spec("pip")): torch.utils.cpp_extension imports setuptools
        return (
            "AssertionError: setuptools could not load its own distutils in this process (the "
            f"standard library's was imported first: {text}); build in a fresh Python process"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    error = next((line for line in lines if "error:" in line and not line.startswith("[")), None)
    first = error or (lines[0] if lines else "")
    return f"{type(e).__name__}: {first[:300]}"


def build_failure(load: Callable[[], Any]) -> str | None:
    """None when ``load()`` (building if needed) succeeds, else why not: ``"<type>: <reason>"``."""
    try:
        load()
    # broad on purpose: whatever the build raises (no compiler, no ninja, a compile error, a held
    # lock) is the reason the feature is refused; the engine raises it as a ValueError naming it
    except Exception as e:  # noqa: BLE001
        return _one_line(e)
    return None
