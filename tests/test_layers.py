"""The pure-Python core must stay torch-free: a reader can copy those files without installing torch."""

import subprocess
import sys

PURE = ["hashing", "block_pool", "block_manager", "metrics", "scheduler", "sequence", "workloads", "passphrase"]


def test_pure_python_modules_do_not_import_torch():
    code = ("import sys, importlib\n"
            f"for m in {PURE!r}: importlib.import_module('kvlab.' + m)\n"
            "import kvlab\n"
            "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the pure-Python core pulled in: {out}"


def test_lazy_exports_resolve():
    import kvlab

    for name in kvlab.__all__:
        assert getattr(kvlab, name) is not None
