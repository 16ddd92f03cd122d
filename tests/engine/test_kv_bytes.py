"""kv_bytes_per_token: the formula, the shipped public configs, and the bytes of real caches."""

import pytest
import torch

from kvlab.engine.models import (
    BUNDLED_MODEL,
    CONFIGS_DIR,
    cache_nbytes,
    kv_bytes_per_token,
    kv_shape,
    load_model,
    load_public_config,
    random_model,
)

SHIPPED = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))




def test_the_configs_the_notebooks_need_are_shipped():
    assert {"Qwen1.5-7B-Chat", "Qwen2.5-0.5B-Instruct", "Llama-3.1-8B-Instruct"} <= set(SHIPPED)


@pytest.mark.parametrize("name,dtype,expected", [
    ("Qwen1.5-7B-Chat", "float16", 2 * 32 * 32 * 128 * 2),  # no GQA: 0.5 MiB per token
    ("Qwen2.5-0.5B-Instruct", "bfloat16", 2 * 24 * 2 * 64 * 2),  # 14 query heads share 2 KV heads
    ("Qwen2.5-7B-Instruct", "bfloat16", 2 * 28 * 4 * 128 * 2),
    ("Llama-3.1-8B-Instruct", "bfloat16", 2 * 32 * 8 * 128 * 2),
    ("Llama-3.1-8B-Instruct", "float32", 2 * 32 * 8 * 128 * 4),
])
def test_public_config_numbers(name, dtype, expected):
    assert kv_bytes_per_token(load_public_config(name), dtype) == expected


@pytest.mark.parametrize("name", SHIPPED)
def test_dict_and_hf_config_object_agree(name):
    from transformers import AutoConfig

    raw = load_public_config(name)
    cfg = AutoConfig.for_model(
        raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"}
    )
    assert kv_shape(cfg) == kv_shape(raw)
    assert kv_bytes_per_token(cfg, "bfloat16") == kv_bytes_per_token(raw, "bfloat16")


def _prefill_cache(model, n_tokens: int):
    with torch.no_grad():
        ids = torch.randint(0, model.config.vocab_size, (1, n_tokens))
        return model(input_ids=ids, use_cache=True).cache


@pytest.mark.parametrize("name", SHIPPED)
def test_formula_equals_bytes_of_a_real_cache_of_each_public_shape(name):
    """A 2-layer random model keeps the public KV shape (heads, head_dim); its real cache is
    measured."""
    model = random_model(
        name, num_layers=2, hidden_size=64, intermediate_size=32, vocab_size=64, device="cpu"
    )
    cache = _prefill_cache(model, 9)
    assert cache.layers[0].keys.shape[1:] == (kv_shape(load_public_config(name))["kv_heads"], 9,
                                              kv_shape(load_public_config(name))["head_dim"])
    assert cache_nbytes(cache) == 9 * kv_bytes_per_token(model.config, "float32")
    layers = load_public_config(name)["num_hidden_layers"]
    assert kv_bytes_per_token(model.config, "float32") * layers // 2 == kv_bytes_per_token(
        load_public_config(name)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_formula_equals_bytes_of_the_bundled_models_cache(dtype):
    if (BUNDLED_MODEL / "config.json").exists():
        model, _ = load_model(device="cpu", dtype=dtype)
    else:  # the bundled model is not there yet: same architecture family at random
        model = random_model(
            "Qwen2.5-0.5B-Instruct",
            num_layers=2,
            hidden_size=64,
            intermediate_size=32,
            vocab_size=64,
            device="cpu",
            dtype=dtype,
        )
    cache = _prefill_cache(model, 17)
    assert cache.layers[0].keys.dtype == getattr(torch, dtype)
    assert cache_nbytes(cache) == 17 * kv_bytes_per_token(model.config, dtype)


def test_bigger_dtype_or_more_kv_heads_cost_proportionally():
    cfg = {
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 64,
    }
    assert kv_bytes_per_token(cfg, "float32") == 2 * kv_bytes_per_token(cfg, "bfloat16")
    assert kv_bytes_per_token({**cfg, "num_key_value_heads": 8}) == 4 * kv_bytes_per_token(cfg)
    # explicit head_dim wins
    assert kv_bytes_per_token({**cfg, "head_dim": 32}) == 4 * kv_bytes_per_token(cfg)
