"""Shared fixtures: one torch thread, and the bundled model loaded once per test session."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test models are tiny: one thread is fastest, and steady when other jobs share the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer): the committed bundled model, float32 on CPU (``KVLAB_TEST_MODEL`` overrides)."""
    from kvlab.engine.models import load_model

    return load_model(os.environ.get("KVLAB_TEST_MODEL"), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def lm(bundled):
    """Alias of ``bundled`` used by the engine, rope, table-3.6 and security tests."""
    return bundled


ENGINE_MAX_NEW = 10


@pytest.fixture(scope="session")
def workload(lm):
    """(prompt ids, HF generate's greedy ids) for the 200-prompt passphrase workload the engine tests share."""
    from kvlab.engine.models import encode
    from kvlab.engine.reference import hf_generate
    from kvlab.lessons.passphrase import question_prompts

    model, tok = lm
    ids = [encode(tok, p) for p in question_prompts()]
    return ids, [hf_generate(model, tok, p, max_new_tokens=ENGINE_MAX_NEW) for p in ids]
