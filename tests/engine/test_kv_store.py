"""Paged K/V storage: slot-mapping writes read back through block tables, block copies, sizes."""

import pytest
import torch

from kvlab.engine.kv_store import PagedKVStore
from kvlab.engine.models import blocks_for_bytes


def _store(**kw):
    args = dict(num_layers=2, num_blocks=6, block_size=4, kv_heads=2, head_dim=3)
    args.update(kw)
    return PagedKVStore(**args)


def test_write_by_slot_read_by_block_table():
    store = _store()
    table = [5, 1, 3]  # logical block i -> physical block, deliberately not contiguous
    n = 10
    k = torch.randn(n, 2, 3)  # (T, kv_heads, head_dim)
    v = torch.randn(n, 2, 3)
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
    store.write_heads(1, slots, k.transpose(0, 1), v.transpose(0, 1))
    rk, rv = store.k[1, table].reshape(-1, 2, 3)[:n], store.v[1, table].reshape(-1, 2, 3)[:n]
    assert torch.equal(rk, k) and torch.equal(rv, v)
    rk, rv = store.gather_heads(1, torch.tensor(table))  # the read the attention does, head-major
    assert torch.equal(rk[:, :n], k.transpose(0, 1)) and torch.equal(rv[:, :n], v.transpose(0, 1))
    assert torch.count_nonzero(store.k[0]) == 0  # other layer untouched
    assert torch.count_nonzero(store.k[1, [0, 2, 4]]) == 0  # blocks outside the table untouched


def test_gather_heads_reads_blocks_head_major_and_contiguous():
    store = _store()
    store.k.normal_()
    store.v.normal_()
    ids = torch.tensor([4, 1, 4])
    keys, values = store.gather_heads(1, ids)
    # (kv_heads, n * block_size, head_dim)
    assert keys.shape == values.shape == (2, 12, 3) and keys.is_contiguous()
    # the logical view, gathered and transposed
    want_k = store.k[1, ids].reshape(12, 2, 3).transpose(0, 1)
    assert torch.equal(keys, want_k) and torch.equal(
        values, store.v[1, ids].reshape(12, 2, 3).transpose(0, 1)
    )
    k = torch.randn(2, 5, 3)  # (kv_heads, T, head_dim), the layout a model computes
    store.write_heads(0, torch.tensor([0, 1, 2, 3, 20]), k, -k)
    assert torch.equal(store.k[0, 0].transpose(0, 1), k[:, :4]) and torch.equal(
        store.k[0, 5, 0], k[:, 4]
    )
    assert torch.equal(store.v[0, 5, 0], -k[:, 4])


def test_copy_blocks_copies_every_layer_and_only_the_pairs():
    store = _store()
    store.k.normal_()
    store.v.normal_()
    before_k, before_v = store.k.clone(), store.v.clone()
    store.copy_blocks([(1, 4), (2, 0)])
    assert torch.equal(store.k[:, 4], before_k[:, 1]) and torch.equal(store.v[:, 4], before_v[:, 1])
    assert torch.equal(store.k[:, 0], before_k[:, 2]) and torch.equal(store.v[:, 0], before_v[:, 2])
    for b in (1, 2, 3, 5):
        assert torch.equal(store.k[:, b], before_k[:, b])
    store.copy_blocks([])  # nothing to do


def test_sizes_and_dtype():
    store = _store(dtype=torch.float16)
    # K and V x layers x slots x heads x dim x bytes
    assert store.bytes_per_block == 2 * 2 * 4 * 2 * 3 * 2
    assert store.nbytes == 6 * store.bytes_per_block
    assert store.k.dtype == torch.float16 and store.device.type == "cpu"
    with pytest.raises(ValueError):
        _store(num_blocks=0)


def test_for_model_matches_config():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kvlab.engine.models import kv_bytes_per_token

    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    model = Qwen2ForCausalLM(cfg)
    store = PagedKVStore.for_model(model, num_blocks=5, block_size=8)
    assert store.k.shape == (3, 5, 8, 2, 8)
    assert store.bytes_per_block == 8 * kv_bytes_per_token(cfg, torch.float32)
    assert blocks_for_bytes(model, 3 * store.bytes_per_block + 1, 8) == 3
