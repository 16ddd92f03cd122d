"""kvlab.engine.speed.cpp_build: a killed build's lock never hangs a start, a missing compiler is
one line, and the build cache is keyed by what ``-march=native`` means on this CPU. Nothing here
compiles: the build itself (``torch.utils.cpp_extension.load``) is replaced by a stand-in."""

import os
import subprocess
import sys
import time

import pytest

from kvlab.engine.speed import cpp_build, paged_kernel
from kvlab.engine.speed.cpp_build import BuildError, build, build_failure, build_name

# flags no real build uses: a build name of its own in a fresh folder
FLAGS = ["-O0", "-DKVLAB_TEST_ONLY"]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A fresh TORCH_EXTENSIONS_DIR; ``load`` stands in for torch's build and records its calls."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def load(name, **kwargs):
        calls.append(name)
        return f"module {name}"

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpp_build, "_check_tools", lambda: None)
    name = build_name("kvlab_test", ["paged_kernel.cpp"], FLAGS)
    folder = tmp_path / name
    folder.mkdir()
    return folder, calls


def test_a_killed_builds_lock_is_removed_and_the_build_runs(fresh, capsys):
    folder, calls = fresh
    # what torch leaves behind when its build is killed: the lock file, held by nobody
    (folder / "lock").touch()
    t0 = time.monotonic()
    assert build("kvlab_test", ["paged_kernel.cpp"], FLAGS, wait_s=30) == f"module {folder.name}"
    assert time.monotonic() - t0 < 10
    assert calls == [folder.name] and not (folder / "lock").exists()
    assert "removing a stale build lock" in capsys.readouterr().err


def test_a_server_start_removes_a_killed_builds_lock_without_rebuilding(fresh):
    folder, calls = fresh
    (folder / "lock").touch()
    t0 = time.monotonic()
    with cpp_build.lock_wait(30, rebuild_stale=False):
        why = build_failure(lambda: build("kvlab_test", ["paged_kernel.cpp"], FLAGS))
    assert time.monotonic() - t0 < 10
    assert why.startswith("BuildError: a killed build of kvlab_test_") and "not rebuilt" in why
    # the lock is gone, so the next start builds; this one built nothing
    assert not (folder / "lock").exists() and calls == []
    # outside the server's start, the same stale lock is rebuilt
    (folder / "lock").touch()
    assert build("kvlab_test", ["paged_kernel.cpp"], FLAGS) == f"module {folder.name}"


def test_a_lock_a_live_process_holds_is_waited_on_then_given_up_naming_it(fresh):
    folder, calls = fresh
    lock = folder / "lock"
    # another start building it now: it holds the lock open, as torch's FileBaton does
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
            "print('held', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        why = build_failure(lambda: build("kvlab_test", ["paged_kernel.cpp"], FLAGS, wait_s=1))
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert 1 <= waited < 10
    assert why.startswith("BuildError: another build of kvlab_test_") and "\n" not in why
    assert f"process {holder.pid}" in why and "gave up after 1 s" in why
    # the lock is the live build's: left alone, and nothing built here
    assert lock.exists() and calls == []


def test_where_no_proc_tells_who_holds_it_an_old_lock_is_stale_and_a_young_one_is_waited_on(
    fresh, monkeypatch
):
    folder, calls = fresh
    lock = folder / "lock"
    lock.touch()
    monkeypatch.setattr(cpp_build, "lock_holders", lambda path: None)
    with pytest.raises(BuildError, match="a process unknown here"):
        build("kvlab_test", ["paged_kernel.cpp"], FLAGS, wait_s=0.3)
    old = time.time() - cpp_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    build("kvlab_test", ["paged_kernel.cpp"], FLAGS, wait_s=0.3)
    assert calls == [folder.name] and not lock.exists()


def test_the_lock_holders_are_the_processes_with_it_open_or_building_in_its_folder(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    if cpp_build.lock_holders(lock) is None:
        pytest.skip("no /proc here")
    assert cpp_build.lock_holders(lock) == []
    fd = os.open(lock, os.O_RDONLY)
    try:
        assert cpp_build.lock_holders(lock) == [os.getpid()]
    finally:
        os.close(fd)
    # a killed start's ninja or compiler, still working in the build folder: a live build too
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 10
        while orphan.pid not in cpp_build.lock_holders(lock) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpp_build.lock_holders(lock) == [orphan.pid]
    finally:
        orphan.kill()
        orphan.wait()


@pytest.mark.parametrize("where", ["CXX", "PATH"])
def test_no_compiler_is_said_in_one_line(tmp_path, monkeypatch, where):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    if where == "CXX":
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    else:
        # ninja may be there; no c++ is
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
    why = build_failure(lambda: build("kvlab_test", ["paged_kernel.cpp"], FLAGS))
    assert why.startswith("BuildError: no C++ compiler found (") and "\n" not in why
    assert ("is not a program" if where == "CXX" else "no c++ on PATH") in why
    # the kernel's own loader (not its cached result): refused with that line
    monkeypatch.setattr(paged_kernel, "load", paged_kernel.load.__wrapped__)
    import torch

    assert "no C++ compiler found" in paged_kernel.paged_kernel_available(
        torch.device("cpu"), torch.float32
    )


def test_a_compile_error_is_its_first_error_line():
    e = RuntimeError(
        "Error building extension 'kvlab_x': [1/2] c++ -MMD -MF main.o.d -DTORCH_EXTENSION_NAME=x "
        "-isystem /venv/include ... -c /src/main.cpp -o main.o\nFAILED: main.o\n"
        "/src/main.cpp:3:1: error: 'foo' was not declared in this scope\n    3 | foo();\n"
    )
    assert (
        cpp_build._one_line(e)
        == "RuntimeError: /src/main.cpp:3:1: error: 'foo' was not declared in this scope"
    )
    assert cpp_build._one_line(BuildError("ninja not found")) == "BuildError: ninja not found"


def test_the_distutils_clash_is_explained():
    """setuptools' assertion when the stdlib's distutils came first is a bare path: the reason
    names it and the way out (a fresh-clone CI run once hit it through find_spec("pip"))."""
    why = cpp_build._one_line(AssertionError("/usr/lib/python3.11/distutils/core.py"))
    assert why.startswith("AssertionError: setuptools could not load its own distutils")
    assert "/usr/lib/python3.11/distutils/core.py" in why and "fresh Python process" in why
    # any other assertion stays as it was
    assert cpp_build._one_line(AssertionError("x > 0")) == "AssertionError: x > 0"


def test_the_build_key_is_what_march_native_resolves_to(monkeypatch):
    answers = {}

    def run(cmd, **kwargs):
        if answers["out"] is None:
            raise FileNotFoundError(cmd[0])
        return subprocess.CompletedProcess(cmd, 0, stdout=answers["out"], stderr="")

    monkeypatch.setattr(cpp_build.subprocess, "run", run)

    def key(out, cxx="g++"):
        answers["out"] = out
        cpp_build._cpu_key.cache_clear()
        return cpp_build._cpu_key(cxx)

    base = (
        "The following options are target specific:\n"
        "  -march=                     \tsapphirerapids\n"
        "  -mavx512f                   \t[enabled]\n"
        "  -mavx512fp16                \t[enabled]\n"
        "  -mamx-tile                  \t[disabled]\n"
        "  -mtune=                     \tsapphirerapids\n"
    )
    try:
        same = key(base)
        assert same.startswith("march:") and key(base) == same
        # two AVX-512 CPUs of one capability level that differ in one extension: two builds
        assert (
            key(
                base.replace(
                    "-mavx512fp16                \t[enabled]",
                    "-mavx512fp16                \t[disabled]",
                )
            )
            != same
        )
        assert (
            key(base.replace("sapphirerapids\n  -mavx512f", "icelake-server\n  -mavx512f")) != same
        )
        # a flag that is off either way, or the spacing, changes nothing
        assert key(base.replace("-mamx-tile                  \t[disabled]\n", "")) == same
        assert key(base.replace("\t", "  ")) == same
        # no GCC-style answer: the CPU's feature flags
        assert key(None).startswith("cpuflags:") and key("clang: unknown argument").startswith(
            "cpuflags:"
        )
    finally:
        cpp_build._cpu_key.cache_clear()


def test_the_real_key_resolves_march_native_where_the_compiler_can_say():
    import shutil

    cxx = cpp_build.compiler()
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler here")
    said = subprocess.run(
        [cxx, "-march=native", "-Q", "--help=target"], capture_output=True, text=True
    )
    if said.returncode != 0 or "-march=" not in said.stdout:
        pytest.skip(f"{cxx} does not print its resolved target flags (not GCC)")
    assert cpp_build.cpu_key().startswith("march:")


def test_a_server_start_waits_a_bounded_time_then_runs_without_the_kernel_saying_why(
    lm, tmp_path, monkeypatch
):
    """``kvlab serve``'s choice (``SpeedPaths.auto`` with a build wait) while another process builds
    the kernel."""
    from kvlab.engine.speed import SpeedPaths

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_build, "_check_tools", lambda: None)
    # the kernel's own loader, not its cached module
    monkeypatch.setattr(paged_kernel, "load", paged_kernel.load.__wrapped__)
    folder = tmp_path / build_name("kvlab_paged_kernel", ["paged_kernel.cpp"], paged_kernel._FLAGS)
    folder.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
            "print('held', flush=True); time.sleep(60)",
            str(folder / "lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        speed = SpeedPaths.auto(lm[0], {"packed_linear", "fused_layers"}, build_wait_s=1)
        assert time.monotonic() - t0 < 10
    finally:
        holder.kill()
        holder.wait()
    assert not speed.paged_kernel and "gave up after 1 s" in dict(speed.off)["paged_kernel"]
    assert (
        "\n" not in speed.describe()
        and "paged_kernel off (no C++ build" in speed.describe()
    )


def test_the_build_command_says_one_line_per_extension_and_fails_without_a_compiler(tmp_path):
    # python -m kvlab.engine.speed (scripts/setup.sh): both builds side by side, in a fresh folder
    # with no compiler, so nothing compiles: one line each naming why, and exit status 1
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-g++")}
    run = subprocess.run([sys.executable, "-m", "kvlab.engine.speed"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 1, run
    lines = run.stderr.strip().splitlines()
    assert sorted(line.split()[1] for line in lines) == ["fused_ops", "paged_kernel"], lines
    assert all("not built" in line and "is not a program" in line for line in lines), lines
