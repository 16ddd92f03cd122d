import pytest
import torch

from kvlab.engine.models import (
    BUNDLED_MODEL,
    kv_bytes_per_token,
    load_model,
    model_fingerprint,
    resolve_device,
    resolve_dtype,
)


def test_default_loads_the_bundled_model_offline(bundled):
    model, tok = bundled
    assert model.config.model_type == "qwen2"
    # grouped-query attention
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert (BUNDLED_MODEL / "README.md").exists(), "the model card is missing"


def test_bad_path_gives_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_offline_hub_id_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="hf download"):
        load_model("kvlab-nonexistent-org/kvlab-nonexistent-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(RuntimeError, match="no CUDA"):
        load_model(device="cuda")


def test_device_and_dtype_resolution():
    assert resolve_device("auto").type in {"cuda", "mps", "cpu"}
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError):
        resolve_device("tpu-please")
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(None) is None
    with pytest.raises(ValueError):
        resolve_dtype("float13")


def test_fingerprint_tells_models_apart(bundled):
    model, tok = bundled
    fp = model_fingerprint(model, tok)
    assert fp == model_fingerprint(model, tok)
    other = type(model)(model.config)  # same shape, random weights
    assert model_fingerprint(other, tok) != fp


def test_kv_bytes_per_token_of_the_bundled_model(bundled):
    model, _ = bundled
    c = model.config
    assert (
        kv_bytes_per_token(c, "float32")
        == 2
        * c.num_hidden_layers
        * c.num_key_value_heads
        * (c.hidden_size // c.num_attention_heads)
        * 4
    )
    assert kv_bytes_per_token(c, "bfloat16") * 2 == kv_bytes_per_token(c, "float32")
