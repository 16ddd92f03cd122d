"""Shared fixtures: the bundled model is loaded once per test session (it is small)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer) of the bundled passphrase model, float32 on CPU."""
    from kvlab.models import load_model

    return load_model(device="cpu", dtype="float32")
