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
# The live timing audit last, where the other worker is more likely idle: a notebook run on the
# other core beside it made an isolated server's hit and miss timings differ (p 8.7e-5 in one CI
# run, and p 0.0009 in another after this ordering). Its "nothing shared" checks therefore read the
# server's cached tokens, not the timing test (NULL_TIMING in tests/audit/test_audit.py).
_TIMING_LAST = ("audit/",)


def _order(item) -> int:
    if any(part in item.nodeid for part in _SLOW_FIRST):
        return 0
    return 2 if any(part in item.nodeid for part in _TIMING_LAST) else 1


# Fixtures that take tens of seconds to set up: HF's reference outputs for the engine tests'
# workload, a wheel and its venv, servers in subprocesses, a file's one vLLM worker, a table of
# model runs. `--dist loadgroup` hands a file's tests one at a time to whichever worker is free, so
# both workers built each of them; the tests that use one form one xdist group (one worker) instead.
# Session-scoped ones group across files, module-scoped ones within their file.
_SHARED_SETUP = {
    "workload": "session",  # tests/engine/conftest.py
    "wheel": "module",  # tests/test_wheel.py (its venv uses it)
    "server": "module",  # tests/serve/test_serve.py
    "http_server": "module",  # tests/serve/test_api_surface_clients.py
    "servers": "module",  # tests/audit/test_audit.py
    "smol": "module",  # tests/engine/test_smollm2.py
    "measured": "module",  # tests/lessons/test_table36.py
    "stress_load": "module",  # tests/lessons/test_nb07_security.py
    "vllm_runs": "module",  # tests/vllm/test_vllm_bridge.py
}


def _shared_setup_group(item) -> str | None:
    names = getattr(item, "fixturenames", ())  # every fixture the test needs, also indirectly
    name = next((n for n in _SHARED_SETUP if n in names), None)
    if name is None:
        return None
    return name if _SHARED_SETUP[name] == "session" else f"{item.path.stem}:{name}"


def _join_group(item) -> None:
    """Put the ``@group`` suffix on the test's id, which is what xdist's loadgroup scheduler reads.

    xdist 3.8 writes it to ``item._nodeid``, which pytest 9 no longer reads (the id lives in
    ``item._id``), so there every test ran wherever the scheduler put it: the two Ray files on both
    workers, each starting Ray and its actors. On an older pytest xdist's own suffix works and this
    adds nothing.
    """
    try:
        from _pytest.nodeid import NodeId
    except ImportError:
        return
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    if names and isinstance(getattr(item, "_id", None), NodeId):
        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The slow files first, the timing audit last, the rest between (a stable sort: modules stay
    whole); the tests of one expensive fixture in one xdist group (unless they have one)."""
    items.sort(key=_order)
    for item in items:
        group = _shared_setup_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        if getattr(config.option, "loadgroup", False):  # set in xdist's workers under loadgroup
            _join_group(item)


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
