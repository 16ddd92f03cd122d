"""Shared by every test folder: offline Hugging Face, one torch thread, and the bundled model loaded
once.

Nothing here imports torch or ``kvlab.lessons``: ``tests/cache`` runs without torch, and
``tests/cache`` + ``tests/engine`` run from a copy of the package under another name
(``tests/test_layers.py``).
"""

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# read when torch loads: fixtures that run models start at one thread
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files whose tests take tens of seconds each (papermill kernels, the vLLM venv, Ray actors).
# They run first, so the two workers finish together instead of one running a notebook alone at the
# end.
_SLOW_FIRST = ("lessons/test_notebooks.py", "vllm/", "cluster/test_", "serve/test_serve")
# The live timing audit last: its "no sharing detected" checks compare TTFTs, and a notebook run on
# the other core beside them made an isolated server's hit and miss timings differ (p 8.7e-5 in one
# CI run).
_TIMING_LAST = ("audit/",)


def _order(item) -> int:
    if any(part in item.nodeid for part in _SLOW_FIRST):
        return 0
    return 2 if any(part in item.nodeid for part in _TIMING_LAST) else 1


def pytest_collection_modifyitems(config, items):
    """The slow files first, the timing audit last, the rest between (a stable sort: modules stay
    whole)."""
    items.sort(key=_order)


def pytest_runtest_setup(item):
    """The test models are tiny: one torch thread is fastest, and steady when other jobs share the
    cores.

    Applied only once something has imported torch, so the pure-Python tests never load it.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer): the committed bundled model, float32 on CPU (``KVLAB_TEST_MODEL``
    overrides)."""
    from kvlab.engine.models import load_model

    return load_model(os.environ.get("KVLAB_TEST_MODEL"), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def lm(bundled):
    """Alias of ``bundled`` used by the engine, rope, table-3.6 and security tests."""
    return bundled
