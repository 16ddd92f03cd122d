"""Worked solutions of the notebooks' exercises, one function per exercise.

Tested against the checkers in ``tests/test_exercises.py``; never imported by a notebook (each exercise
starts blank there). One block per notebook, in notebook order.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- 00 the passphrase experiment

def solution_00_1(prompt_tokens: int = 300, cached_tokens: int = 256) -> float:
    """00.1: the share of the prompt still prefilled = uncached tokens / all tokens."""
    return (prompt_tokens - cached_tokens) / prompt_tokens


def solution_00_2(prefix_ids, prompt_ids) -> bool:
    """00.2: a cache may serve a prompt whose first len(prefix) ids are exactly the prefix's ids."""
    return len(prefix_ids) <= len(prompt_ids) and list(prompt_ids[: len(prefix_ids)]) == list(prefix_ids)


# ----------------------------------------------------------------------------- 01 QKV and the KV cache

def solution_01_1(q, k, v):
    """01.1: grouped-query attention without repeat_kv: fold the query heads into (kv_heads, group)."""
    import math

    import torch

    b, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, t, d)  # query heads of one KV head side by side
    scores = qg @ k[:, :, None].transpose(-1, -2) / math.sqrt(d)  # (b, kvh, group, t, t)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (weights @ v[:, :, None]).reshape(b, h, t, d)


def solution_01_2(config_name: str = "Qwen2.5-7B-Instruct", bytes_per_element: int = 2) -> int:
    """01.2: 2 (K and V) x layers x KV heads x head_dim x bytes, read from the shipped config."""
    from kvlab.engine.models import load_public_config

    cfg = load_public_config(config_name)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]  # a config.json dict
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * bytes_per_element


def solution_01_3(config_name: str = "Llama-3.1-8B-Instruct", budget_gib: float = 16, batch: int = 4) -> int:
    """01.3: budget bytes // (bytes per token x batch)."""
    return int(budget_gib * 2**30 // (solution_01_2(config_name, 2) * batch))


# ----------------------------------------------------------------------------- 02 manual prefix reuse

def solution_02_1(model, tokenizer, prefix_text: str, suffix_text: str, max_new_tokens: int) -> list[int]:
    """02.1: build the prefix cache, copy it, prefill the suffix at positions len(prefix)..., decode greedily."""
    import copy

    import torch

    from kvlab.engine.models import encode, eos_ids

    device = next(model.parameters()).device
    prefix, suffix = encode(tokenizer, prefix_text), encode(tokenizer, suffix_text)
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).cache
        cache = copy.deepcopy(cache)  # never write into the shared prefix
        pos = len(prefix)
        ids = torch.tensor([suffix], device=device)
        out, new, stops = None, [], eos_ids(model, tokenizer)
        for _ in range(max_new_tokens):
            positions = torch.arange(pos, pos + ids.shape[1], device=device)[None]
            out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            pos += ids.shape[1]
            tok = int(out.logits[0, -1].argmax())
            new.append(tok)
            if tok in stops:
                break
            ids = torch.tensor([[tok]], device=device)
    return new


def solution_02_2(tokenizer, text: str = "Please repeat the passphrase.") -> tuple[str, str]:
    """02.2: try each cut of a text; the first where the prefix's tokens are not the full text's first tokens."""
    from kvlab.lessons.nb02_prefix import check_prefix_tokens

    for cut in range(1, len(text)):
        if not check_prefix_tokens(tokenizer, text[:cut], text).ok:
            return text[:cut], text[cut:]
    raise ValueError(f"no cut of {text!r} merges across the boundary")


def solution_02_3(model, tokenizer, cache, prefix_len: int, suffixes, max_new_tokens: int) -> list[list[int]]:
    """02.3: one cache object, cropped back to the prefix after every request."""
    from kvlab.engine.models import encode, eos_ids
    from kvlab.prefix import continue_from_cache

    out = []
    for s in suffixes:
        gen, *_ = continue_from_cache(model, cache, encode(tokenizer, s), prefix_len,
                                      max_new_tokens=max_new_tokens, stop_ids=eos_ids(model, tokenizer))
        extra = int(cache.get_seq_length()) - prefix_len
        if extra:
            cache.crop(-extra)  # drop the request's tokens: the cache holds the prefix again
        out.append(gen)
    return out


# ----------------------------------------------------------------------------- 03 position encoding

# ----------------------------------------------------------------------------- 04 the paged block manager

# ----------------------------------------------------------------------------- 05 shared vs isolated

# ----------------------------------------------------------------------------- 06 vLLM side by side

# ----------------------------------------------------------------------------- 07 isolation and security
