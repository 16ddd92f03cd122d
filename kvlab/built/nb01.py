"""What notebook 01_qkv_and_kv_cache.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

from math import sqrt

import torch


# --- 01_qkv_and_kv_cache.ipynb, cell 5 ---
def causal_mask(q_len: int, k_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(q_len, k_len), True where query i may see key j: the queries are the LAST q_len of k_len."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (q_len, 1): the queries
    k_pos = torch.arange(k_len, device=device)[None, :]                 # (1, k_len): the keys
    return k_pos <= q_pos                                               # keys up to the query


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention: q (B, H, Tq, D), k and v (B, H, Tk, D) -> (output, weights)."""
    # how well each query matches each key, scaled by sqrt(head_dim) so softmax does not saturate
    scores = q @ k.transpose(-2, -1) / sqrt(q.shape[-1])   # (B, H, Tq, Tk)
    if causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device)   # (Tq, Tk)
        scores = scores.masked_fill(~mask, float("-inf"))   # the future gets weight exp(-inf) = 0
    weights = scores.softmax(dim=-1)   # (B, H, Tq, Tk), each row sums to 1
    return weights @ v, weights        # output (B, H, Tq, D): a weighted sum of the values


# --- 01_qkv_and_kv_cache.ipynb, cell 9 ---
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, kv_heads, T, D) -> (B, kv_heads * n_rep, T, D): query head h reads KV head h // n_rep."""
    if n_rep == 1:
        return x
    b, kvh, t, d = x.shape
    # a new axis of n_rep copies after each KV head (a view, no copy yet), then fold into the heads
    return x[:, :, None].expand(b, kvh, n_rep, t, d).reshape(b, kvh * n_rep, t, d)


# --- 01_qkv_and_kv_cache.ipynb, cell 18 ---
def last_row_ignores_past_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                                  ) -> dict[str, float]:
    """Add noise to the past (all but the last position) of Q, then of K, then of V: how far does
    the last output move?"""
    base = attention(q, k, v)[0][..., -1, :]   # the last position's output, (B, H, D)
    moved = {}
    for name in ("Q", "K", "V"):
        qkv = [q.clone(), k.clone(), v.clone()]
        x = qkv["QKV".index(name)]
        x[..., :-1, :] += torch.randn_like(x[..., :-1, :])  # all earlier positions changed
        moved[f"past {name} changed"] = float((attention(*qkv)[0][..., -1, :] - base).abs().max())
    return moved


# --- 01_qkv_and_kv_cache.ipynb, cell 23 ---
def decode_step_flops(n: int, d_model: int, n_heads: int, n_kv_heads: int, use_cache=True) -> int:
    """Multiply-add FLOPs (2 per MAC) of one attention layer's decode step at context length n."""
    head_dim = d_model // n_heads
    proj_per_token = 2 * d_model * head_dim * (2 * n_heads + 2 * n_kv_heads)   # Q, O and K, V
    tokens = 1 if use_cache else n   # queries computed this step
    # scores (QK^T) and the weighted sum (AV): 2 * 2 * heads * head_dim per (query, key) pair
    return tokens * proj_per_token + 4 * n_heads * head_dim * tokens * n


# --- 01_qkv_and_kv_cache.ipynb, cell 27 ---
def kv_bytes_per_token_by_hand(config, dtype: str | torch.dtype = "float32") -> int:
    """KV-cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    def get(key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads            # no GQA: one KV head per query head
    head_dim = get("head_dim") or get("hidden_size") // heads  # usually hidden_size / heads
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
