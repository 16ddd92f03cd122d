"""kvlab.engine.speed.fused_ops against transformers' own arithmetic: RoPE bit for bit, RMSNorm and
SwiGLU to float32 rounding (their sums and e^x are computed in another order or by another
polynomial), the residual sum exactly, special values as ATen gives them, and a clear error for
input they do not take."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kvlab.engine.speed import fused_ops


@pytest.fixture(scope="module")
def ops():
    try:
        return fused_ops.load()
    except Exception as e:  # noqa: BLE001 -- no compiler here: the engine refuses fused_layers, naming it
        pytest.skip(f"the C++ ops do not build here: {e}")


# 1 and 3 rows: a decode step's shapes (one thread task); 600: several tasks of the parallel loop
ROWS = [1, 3, 600]


@pytest.mark.parametrize("rows", ROWS)
def test_rope_is_hf_apply_rotary_pos_emb_bit_for_bit_and_leaves_v_alone(ops, rows):
    heads, kv_heads, d = 6, 2, 32
    cfg = transformers.LlamaConfig(
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )
    torch.manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d) * 4
    # positions far apart, as a packed step of several sequences
    pos = (torch.arange(rows) * 7 + 3)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(qkv[None], position_ids=pos)
    q = qkv[:, : heads * d].view(1, rows, heads, d).transpose(1, 2)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(1, rows, kv_heads, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got = qkv.clone()
    ops.rope(got, cos[0].contiguous(), sin[0].contiguous(), heads + kv_heads, d)
    assert torch.equal(got[:, : heads * d].view(1, rows, heads, d).transpose(1, 2), want_q)
    assert torch.equal(
        got[:, heads * d : (heads + kv_heads) * d].view(1, rows, kv_heads, d).transpose(1, 2),
        want_k,
    )
    assert torch.equal(got[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_the_residual_sum_match_llama_rms_norm(ops, rows):
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(200, eps=1e-5)  # 200: not a multiple of the 16 partial sums
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x, delta = torch.randn(rows, 200) * 3, torch.randn(rows, 200)
    with torch.no_grad():
        torch.testing.assert_close(
            ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=2e-6, atol=2e-6
        )
        summed = x.clone()
        got = ops.add_rms_norm(summed, delta, norm.weight, 1e-5)
        # the residual, updated in place, exactly as x + delta
        assert torch.equal(summed, x + delta)
        torch.testing.assert_close(got, norm(x + delta), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_silu_times_up(ops, rows):
    torch.manual_seed(rows)
    gu = torch.randn(rows, 2 * 300) * 6
    torch.testing.assert_close(
        ops.silu_mul(gu), F.silu(gu[:, :300]) * gu[:, 300:], rtol=1e-6, atol=1e-30
    )


def test_special_values_come_out_as_aten_gives_them(ops):
    gate = torch.tensor(
        [[float("nan"), float("inf"), -float("inf"), -100.0, 100.0, 0.0, -0.0, 1e-30, 30.0]]
    )
    up = torch.ones_like(gate)
    torch.testing.assert_close(ops.silu_mul(torch.cat([gate, up], 1)), F.silu(gate), equal_nan=True,
                               rtol=1e-6, atol=0.0)
    # a NaN anywhere in a row makes the whole normed row NaN (the runner finds a NaN row's request
    # by it)
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    got = ops.rms_norm(x, torch.ones(4), 1e-6)
    assert got[0].isnan().all() and not got[1].isnan().any()


def test_input_they_do_not_take_is_refused_naming_it(ops):
    with pytest.raises(RuntimeError, match="x must be 2-D with contiguous rows"):
        ops.rms_norm(torch.randn(3, 4).t(), torch.ones(3), 1e-6)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ops.rms_norm(torch.randn(3, 4, dtype=torch.float64), torch.ones(4), 1e-6)
    with pytest.raises(
        RuntimeError, match="the weight must be a contiguous 1-D float32 CPU tensor"
    ):
        ops.rms_norm(torch.randn(3, 4), torch.ones(4, 2)[:, 0], 1e-6)
    with pytest.raises(RuntimeError, match="the weight has 5 values for rows of 4"):
        ops.rms_norm(torch.randn(3, 4), torch.ones(5), 1e-6)
    with pytest.raises(RuntimeError, match="the delta's shape differs"):
        ops.add_rms_norm(torch.randn(3, 4), torch.randn(2, 4), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="rope: 4 heads of 8 do not fit rows of 24"):
        ops.rope(torch.randn(2, 24), torch.randn(2, 8), torch.randn(2, 8), 4, 8)
    with pytest.raises(RuntimeError, match=r"rope: cos and sin must be \(2, 8\)"):
        ops.rope(torch.randn(2, 24), torch.randn(3, 8), torch.randn(2, 8), 2, 8)
    with pytest.raises(RuntimeError, match="gate_up must have an even width"):
        ops.silu_mul(torch.randn(2, 7))
