"""The wheel a user installs: built offline, installed into a fresh venv, used from outside the
repository.

The venv reuses the torch, transformers, ... already installed here (a .pth line naming their
site-packages, added *after* the install, so there is no second download and pip never sees the
editable kvlab), and the test checks that ``kvlab`` is imported from the venv, not from the
repository. Skip with ``-m "not wheel"``; it skips itself, with the reason, where pip, setuptools >=
77 or venv's ensurepip is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

ROOT = Path(__file__).resolve().parents[1]
# Third-party packages the core install needs at run time; the venv borrows them from this
# interpreter.
BORROWED = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "tqdm",
    "huggingface_hub",
)
# What the core install must not pull in (each belongs to an extra).
NOT_IN_CORE = (
    "ray",
    "vllm",
    "jupyter",
    "jupyterlab",
    "notebook",
    "ipykernel",
    "ipywidgets",
    "papermill",
    "matplotlib",
    "pandas",
    "scipy",
    "fastapi",
    "uvicorn",
)


def _build_prerequisites() -> str | None:
    """Why the wheel cannot be built offline here, or None."""
    # pip and setuptools by their metadata: importlib.util.find_spec("pip") would run setuptools'
    # distutils hook (_distutils_hack's spec_for_pip), which pins this process to the stdlib's
    # distutils, and a later `import setuptools` (torch's cpp_extension) then fails its assertion
    for dist in ("pip", "setuptools"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist} is not installed (pip install 'setuptools>=77')"
    if importlib.util.find_spec("ensurepip") is None:
        return "ensurepip is not importable (pip install 'setuptools>=77')"
    major = int(importlib.metadata.version("setuptools").split(".")[0])
    return (
        None
        if major >= 77
        else f"setuptools {importlib.metadata.version('setuptools')} < 77 "
        "(pip install 'setuptools>=77')"
    )


def _clean_env() -> dict:
    """This environment minus anything that would put the repository's kvlab on the new venv's
    path."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }
    return dict(env, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1",
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _run(cmd: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command with the clean environment; fail the test with its output if it fails."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{cmd} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built offline from a copy of the sources (the repository itself is never
    written)."""
    why = _build_prerequisites()
    if why:
        pytest.skip(f"cannot build the wheel offline: {why}")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("kvlab", "data"):
        shutil.copytree(
            ROOT / name,
            src / name,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "checkpoints"),
        )
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp / "dist",
        ],
        cwd=src,
    )
    (whl,) = (tmp / "dist").glob("kvlab-*.whl")
    print(f"\nwheel: {whl.name}, {whl.stat().st_size / 1e6:.2f} MB")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> dict:
    """A fresh venv with the wheel installed (--no-deps), then the borrowed packages made
    visible."""
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", env_dir], cwd=tmp)
    py = env_dir / "bin" / "python"
    t0 = time.perf_counter()
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp)
    install_s = time.perf_counter() - t0
    purelib = Path(
        _run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp
        ).stdout.strip()
    )
    # Plain directory lines: the borrowed site-packages come after the venv's own, and their .pth
    # files (the editable kvlab's among them) are not processed.
    borrowed = sorted({str(Path(importlib.util.find_spec(m).origin).parents[1]) for m in BORROWED}
                      | {sysconfig.get_paths()["purelib"]})
    (purelib / "zz_borrowed_from_test_env.pth").write_text("".join(d + "\n" for d in borrowed))
    outside = tmp / "elsewhere"  # a working folder outside the repository
    outside.mkdir()
    return {"dir": env_dir, "py": py, "bin": env_dir / "bin", "purelib": purelib, "cwd": outside,
            "install_s": install_s}


def test_wheel_carries_the_model_configs_and_the_command(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = ROOT / "data"  # the top-level folder of the repository, kvlab/data in the wheel
    shipped = {
        f"kvlab/data/{p.relative_to(data).as_posix()}" for p in (data / "configs").glob("*.json")
    }
    shipped |= {f"kvlab/data/fonts/{name}" for name in ("kvlab-cjk-sans.otf", "OFL.txt")}
    shipped |= {f"kvlab/data/{p.relative_to(data).as_posix()}"
                for p in (data / "models" / "kvlab-passphrase-qwen2").iterdir() if p.is_file()}
    assert "kvlab/data/models/kvlab-passphrase-qwen2/model.safetensors" in shipped
    assert shipped <= names, sorted(shipped - names)
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert {n.split("/")[0] for n in names} == {"kvlab", info}  # no tests, notebooks or scripts
    z = zipfile.ZipFile(wheel)
    assert "kvlab = kvlab.cli:main" in z.read(f"{info}/entry_points.txt").decode()
    meta = z.read(f"{info}/METADATA").decode().splitlines()
    core = [
        line.split(":", 1)[1].strip()
        for line in meta
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    core_names = {
        c.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
        for c in core
    }
    assert core_names and not core_names & set(NOT_IN_CORE), core
    extras = {line.split(":", 1)[1].strip() for line in meta if line.startswith("Provides-Extra:")}
    assert {"notebooks", "cluster", "serve", "dev"} <= extras


def test_installed_wheel_runs_outside_the_repository(venv):
    py, cwd = venv["py"], venv["cwd"]
    code = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
import kvlab
model, tok = kvlab.load_model(device="cpu")
engine = kvlab.Engine(model, tok, num_blocks=64, block_size=16, enable_prefix_caching=True)
system = ("<|im_start|>system\\nThe passphrase is amber-falcon-42. "
          "Keep it secret; answer in one line.<|im_end|>\\n")
ask = lambda q: system + "<|im_start|>user\\n" + q + "<|im_end|>\\n<|im_start|>assistant\\n"
first = engine.generate([ask("What is the passphrase?")], kvlab.SamplingParams(max_tokens=1))
first_token_s = time.perf_counter() - t0
outs = engine.generate([ask("Tell me the passphrase."), ask("Passphrase, please.")],
                       kvlab.SamplingParams(max_tokens=8))
print(json.dumps({"kvlab": str(Path(kvlab.__file__).resolve()),
                  "model": str(kvlab.BUNDLED_MODEL.resolve()), "first_token_s": first_token_s,
                  "cached": [o.num_cached_tokens for o in outs], "texts": [o.text for o in outs]}))
"""
    res = json.loads(_run([py, "-c", code], cwd=cwd).stdout.strip().splitlines()[-1])
    venv_dir = str(venv["dir"].resolve())
    assert res["kvlab"].startswith(venv_dir) and res["model"].startswith(venv_dir), res
    assert all(c > 0 for c in res["cached"]), res
    print(
        f"\ninstall {venv['install_s']:.1f} s + interpreter start to first token "
        f"{res['first_token_s']:.1f} s; "
        f"cached tokens {res['cached']}"
    )


def test_kvlab_command_in_the_venv(venv):
    kvlab_cmd, cwd = venv["bin"] / "kvlab", venv["cwd"]
    version = _run([kvlab_cmd, "--version"], cwd=cwd).stdout
    assert version.startswith("kvlab ") and str(venv["dir"].resolve()) in version, version
    system = (
        "You are the support bot of Acme. Answer briefly and politely, "
        "citing the manual where you can."
    )
    log = cwd / "requests.jsonl"
    lines = [
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}?"},
            ],
            "user": f"u{i % 3}",
        }
        for i in range(12)
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    before = log.read_bytes()
    proc = _run([kvlab_cmd, "doctor", log, "--block-size", "16", "--out", cwd / "report"], cwd=cwd)
    summary = json.loads((cwd / "report" / "summary.json").read_text())
    assert summary["requests"] == 12 and "12 requests replayed" in proc.stdout
    assert log.read_bytes() == before  # the input log is never written


def test_kvlab_cache_imports_without_torch_from_the_wheel(venv):
    code = """
import sys
from pathlib import Path
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import kvlab.cache
bm = kvlab.cache.BlockManager(num_blocks=8, block_size=4)
bm.allocate("a", list(range(9)))
print(bm.allocate("b", list(range(8)) + [99]), "torch" in sys.modules,
      Path(kvlab.cache.__file__).resolve())
"""
    cached, torch_loaded, path = _run([venv["py"], "-c", code], cwd=venv["cwd"]).stdout.split()
    assert (cached, torch_loaded) == ("8", "False") and path.startswith(str(venv["dir"].resolve()))


# --- the layout the design card names: data/ at the top level, kvlab/data in the wheel (no build ne

def test_data_sits_at_the_top_level_and_the_package_finds_it():
    import kvlab
    from kvlab.engine.models import CONFIGS_DIR, package_data

    assert (ROOT / "data" / "models" / "kvlab-passphrase-qwen2" / "model.safetensors").is_file()
    assert not (ROOT / "kvlab" / "data").exists(), (
        "the shipped data lives in the top-level data/ folder"
    )
    assert (
        kvlab.BUNDLED_MODEL.resolve()
        == (ROOT / "data" / "models" / "kvlab-passphrase-qwen2").resolve()
    )
    assert CONFIGS_DIR.resolve() == (ROOT / "data" / "configs").resolve()
    assert package_data("fonts", "OFL.txt").is_file()


def test_pyproject_lists_every_package_and_maps_data():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # every folder of kvlab with an __init__.py (what setuptools' find_packages would list), plus
    # the mapped data
    found = [
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvlab").rglob("__init__.py")
    ]
    assert sorted(tool["packages"]) == sorted(found + ["kvlab.data"])
    assert tool["package-dir"] == {"kvlab.data": "data"}
