"""Worked solutions of the notebooks' exercises, one function per exercise."""

from __future__ import annotations

from kvlab.cache import cdiv

# --------------------------------------------------------------------- 00 the passphrase experiment

def solution_00_1(prompt_tokens: int = 300, cached_tokens: int = 256) -> float:
    """00.1: the share of the prompt still prefilled = uncached tokens / all tokens."""
    return (prompt_tokens - cached_tokens) / prompt_tokens


def solution_00_2(prefix_ids, prompt_ids) -> bool:
    """00.2: a cache may serve a prompt whose first len(prefix) ids are exactly the prefix's ids."""
    return (len(prefix_ids) <= len(prompt_ids)
            and list(prompt_ids[: len(prefix_ids)]) == list(prefix_ids))


def build_00_suffix_prefill(model, cache, prefix_len: int, suffix_ids):
    """00.B: only the suffix through the model, on the prefix's cache, at the positions after the
    prefix."""
    import torch

    device = next(model.parameters()).device
    # (1, S)
    positions = torch.arange(prefix_len, prefix_len + len(suffix_ids), device=device)[None]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(suffix_ids)], device=device),
                    position_ids=positions,
                    cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]  # (vocab,)


# -------------------------------------------------------------------------- 01 QKV and the KV cache

def solution_01_1(q, k, v):
    """01.1: grouped-query attention without repeat_kv: fold the query heads into (kv_heads,
    group)."""
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
    # a config.json dict
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * bytes_per_element


# --------------------------------------------------------------------------- 02 manual prefix reuse

def solution_02_2(tokenizer, text: str = "Please repeat the passphrase.") -> tuple[str, str]:
    """02.2: try each cut of a text; the first where the prefix's tokens are not the full text's
    first tokens."""
    from kvlab.lessons.nb02_prefix import check_prefix_tokens

    for cut in range(1, len(text)):
        if not check_prefix_tokens(tokenizer, text[:cut], text).ok:
            return text[:cut], text[cut:]
    raise ValueError(f"no cut of {text!r} merges across the boundary")


# ----------------------------------------------------------------------------- 03 position encoding

def ex03_1_suffix_positions(prefix_len: int, suffix_len: int) -> list[int]:
    """03.1: the suffix continues where the cached prefix (positions 0 .. prefix_len - 1) ended."""
    return list(range(prefix_len, prefix_len + suffix_len))


def ex03_2_rerotation_delta(start_in_a: int, start_in_b: int) -> int:
    """03.2: rotate from the position the keys were computed at to the one they are needed at."""
    return start_in_b - start_in_a


def ex03_3_positions_from_mask(mask):
    """03.3: each real token's index among the real tokens of its row; pads get 0."""
    m = mask.long()
    return (m.cumsum(-1) - 1).clamp(min=0) * m


def ex03_4_exact_layers(errors, tol: float = 2e-2) -> list[int]:
    """03.4: the layers whose re-rotated keys match the recomputed ones up to float rounding."""
    d = errors[(errors["treatment"] == "group 2: A's segment K/V re-rotated by Δ")
               & (errors["tensor"] == "K")]
    worst = d.groupby("layer")["relative error"].max()
    return sorted(int(layer) for layer, e in worst.items() if e < tol)


def build_03_rope_suffix(k, prefix_len: int, theta: float = 10000.0):
    """Build 03: pair (i, i + D/2) is the complex number a + ib; turning it by φ multiplies it by
    e^(iφ)."""
    import torch

    half, t = k.shape[-1] // 2, k.shape[-2]
    # after the cached prefix
    pos = torch.arange(prefix_len, prefix_len + t, dtype=torch.float64, device=k.device)
    angle = pos[:, None] * theta ** (-2 * torch.arange(half, dtype=torch.float64,
                                                       device=k.device) / k.shape[-1])
    z = torch.complex(k[..., :half].double(),
                      k[..., half:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], -1).to(k.dtype)

# ----------------------------------------------------------------------- 04 the paged block manager

def ex04_1_predict(n: int, block_size: int) -> int:
    """04.1: whole blocks of the first n - 1 tokens (the last prompt token is always computed)."""
    return (n - 1) // block_size * block_size


def ex04_2_find_leaks(manager) -> set[int]:
    """04.2: blocks whose ref count exceeds the number of block-table entries that point at them."""
    from collections import Counter

    held = Counter(b for seq in manager.seqs.values() for b in seq.block_table)
    return {b.block_id for b in manager.pool.blocks if b.ref_count > held[b.block_id]}


def ex04_3_build(system: list[int], timestamp: list[int], question: list[int]) -> list[int]:
    """04.3: the changing part goes last, so every block before it can still be shared."""
    return system + question + timestamp

# ---------------------------------------------------------------------------- 05 shared vs isolated

def ex05_1_bug_rows() -> dict[int, str]:
    """05.1: the decision-table row each group's bug breaks (group 2 breaks
    "overlap-different-start" as well)."""
    return {1: "positions-agree", 2: "same-start", 3: "independent-context"}


def ex05_2_kv_ratio(num_requests: int = 16, prefix_tokens: int = 512, private_tokens: int = 63,
                    block_size: int = 16) -> float:
    """05.2: block-granular shared / isolated KV bytes: the prefix's full blocks once, every other
    block per request."""
    full = prefix_tokens // block_size
    per_request = cdiv(prefix_tokens + private_tokens, block_size)
    return (full + num_requests * (per_request - full)) / (num_requests * per_request)


def ex05_3_position_fix():
    """05.3: a positions function for ``Engine(..., positions=)`` numbering the computed tokens
    where they sit."""
    def fixed_positions(item):
        return range(item.start, item.end)  # after the cached prefix, not from 0

    return fixed_positions

# ----------------------------------------------------------------------------- 06 vLLM side by side

def ex06_1_cached_tokens(prompt_tokens: int = 250, shared_tokens: int = 200,
                         block_size: int = 32) -> int:
    """06.1: whole blocks of the shared part, never the last prompt token."""
    return min(shared_tokens, prompt_tokens - 1) // block_size * block_size


def ex06_2_ttft_ideal(prompt_tokens: int, cached_tokens: int) -> float:
    """06.2: the share of prompt tokens that still need a forward pass."""
    return (prompt_tokens - cached_tokens) / prompt_tokens


def ex06_3_batch_counts() -> bool:
    """06.3: True: a block is registered under its hash when it is allocated, so a request admitted
    in the same step hits it; the step writes every new token's K/V in each layer before attention
    reads it."""
    return True

# ------------------------------------------------------------------------ 07 isolation and security
def ex07_1_salt_split(public_tokens: int = 40, block_size: int = 16) -> tuple[int, int]:
    """07.1: the salt enters the first block that extends past the public prefix; only whole public
    blocks before it are shared. 40 tokens in blocks of 16: blocks 0 and 1 (32 tokens) are whole,
    block 2 straddles -> (2, 32)."""
    salted = public_tokens // block_size
    return salted, salted * block_size


def ex07_2_prefill_tokens(n_tenants: int = 8, system_tokens: int = 120, question_tokens: int = 10,
                          block_size: int = 16) -> tuple[int, int]:
    """07.2: with per-tenant salts every tenant prefills its whole prompt; with the public prefix
    every tenant after the first reuses the system prompt's whole blocks (120 // 16 = 7 blocks = 112
    tokens) -> (1040, 256)."""
    n = system_tokens + question_tokens
    shared = (system_tokens // block_size) * block_size
    return n_tenants * n, n_tenants * n - (n_tenants - 1) * shared


def ex07_3_auc(positives, negatives) -> float:
    """07.3: ROC AUC over all positive-negative pairs, a win counting 1 and a tie one half."""
    pairs = [(p > n) + 0.5 * (p == n) for p in positives for n in negatives]
    return sum(pairs) / len(pairs)


def ex09_1_policy(router, request):
    """Notebook 09: the replica with the largest cached overlap minus its active blocks, ties to the
    lowest id."""
    hashes = router.hashes(request)
    return max(router.replicas,
               key=lambda r: (router.index.overlap(r, hashes) - router.active_blocks(r), -r))


# --------------------------------------------------------------------------- 03b reusing the middle

def ex03b_1_rerotate(keys, delta: int, theta: float):
    """03b.1: turn pair (i, i + d/2) of every key by delta * inv_freq[i]: k * cos + rotate_half(k) *
    sin."""
    import torch

    from kvlab.engine.rope import inverse_frequencies, rotate_half

    angle = delta * inverse_frequencies(keys.shape[-1], theta, device=keys.device)  # (head_dim/2,)
    angle = torch.cat((angle, angle))  # (head_dim,): the layout of rotate_half
    return keys * angle.cos() + rotate_half(keys) * angle.sin()


# --------------------------------------------------------------------- 10 is this endpoint sharing?
def ex10_1_min_samples(alpha: float = 1e-3) -> int:
    """10.1: the smallest exact two-sided KS p-value with n per side is 2 / C(2n, n) (no overlap); 7
    for 1e-3."""
    import math

    n = 1
    while 2 / math.comb(2 * n, n) >= alpha:
        n += 1
    return n


def ex10_2_right_guess_gain(before: int = 100, secret: int = 5, after: int = 40,
                            block_size: int = 32) -> int:
    """10.2: whole blocks through the known text (145 // 32 = 4 blocks, 128 tokens) minus the whole
    blocks before the secret (100 // 32 = 3 blocks, 96 tokens) -> 32; with 64-token blocks 128 - 64
    = 64."""
    return (before + secret + after) // block_size * block_size - before // block_size * block_size


# ---------------------------------------------------------------------------- 11 tiers and transfer

def ex11_1_worth_pulling(prefix_tokens: int, recompute_per_token: float, copy_per_token: float,
                         fixed: float) -> bool:
    """Notebook 11: pull when one transfer's fixed cost plus the copy is strictly cheaper than
    recomputing the prefix."""
    return fixed + copy_per_token * prefix_tokens < recompute_per_token * prefix_tokens


# --------------------------------------------------------------- build exercises (01.B, 02.B, 04.B)

def build_01_decode_step(cache, layer, q, k, v):
    """01.B: append k, v (B, KVH, 1, D) to cache[layer]; q (B, H, 1, D) attends over every cached
    position."""
    import math

    import torch

    if layer in cache:
        k = torch.cat([cache[layer][0], k], dim=-2)  # (B, KVH, T, D)
        v = torch.cat([cache[layer][1], v], dim=-2)
    cache[layer] = (k, v)
    b, h, _, d = q.shape
    group = h // k.shape[1]  # query heads per KV head
    qg = q.reshape(b, k.shape[1], group, 1, d)  # (B, KVH, group, 1, D)
    # (B, KVH, group, 1, T)
    weights = (qg @ k[:, :, None].transpose(-1, -2) / math.sqrt(d)).softmax(-1)
    return (weights @ v[:, :, None]).reshape(b, h, 1, d)


def build_02_continue(model, cache, suffix_ids, start_pos, max_new_tokens, stop_ids):
    """02.B: prefill the suffix at start_pos.. on top of the cache, then one greedy token per step
    at the next position."""
    import torch

    device = next(model.parameters()).device
    ids, pos, new = list(suffix_ids), start_pos, []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            positions = torch.arange(pos, pos + len(ids), device=device)[None]  # (1, T)
            out = model(input_ids=torch.tensor([ids], device=device), position_ids=positions,
                        cache=cache,
                        use_cache=True)
            pos += len(ids)
            ids = [int(out.logits[0, -1].argmax())]
            new.append(ids[0])
            if ids[0] in stop_ids:
                break
    return new


def build_04_block_hashes(token_ids, block_size, extra_keys=()):
    """04.B1: each full block hashed with its parent's hash; the extra keys (fingerprint, salt) in
    block 0 only."""
    from kvlab.cache.hashing import hash_block

    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            extra_keys if i == 0 else ())
        out.append(parent)
    return out


def build_04_take(blocks):
    """04.B2: the head of the free list (freed longest ago); what it caches is evicted now,
    lazily."""
    b = next(iter(blocks.free))
    del blocks.free[b]
    if blocks.hash_of[b] is not None:
        blocks.uncache(b)  # evicted: no request can hit it any more
    blocks.ref[b] = 1
    return b


def build_04_free(blocks, seq_id):
    """04.B2: one reference less per block, tail first; at 0 a cached block joins the tail, an
    uncached one the head."""
    for b in reversed(blocks.tables.pop(seq_id)):
        blocks.ref[b] -= 1
        if blocks.ref[b] == 0:
            blocks.free[b] = None  # the tail: evicted last, a later request may still hit it
            if blocks.hash_of[b] is None:
                # no hash, never a hit: reuse it first (vLLM's order)
                blocks.free.move_to_end(b, last=False)


def build_04_allocate(blocks, seq_id, token_ids, hashes):
    """04.B3: hit the longest cached prefix (never the last token's block), one more reference per
    hit, take the rest."""
    bs, n, table = blocks.block_size, len(token_ids), []
    for h in hashes[: (n - 1) // bs]:  # the last prompt token is always computed
        b = blocks.lookup(h)
        if b is None:
            break  # the chain is broken: nothing after this block can be a hit
        if blocks.ref[b] == 0:
            del blocks.free[b]  # cached but unreferenced: it leaves the free list
        blocks.ref[b] += 1
        table.append(b)
    cached = len(table) * bs
    for i in range(len(table), -(-n // bs)):
        table.append(blocks.take())  # ref count 1
        if i < n // bs:
            blocks.register(table[-1], hashes[i])  # a full block: later requests may hit it
    blocks.tables[seq_id] = table
    return cached


# ------------------------------------------------------------------------- build exercises 05.B1-B2

def build_05_append(blocks, seq_id, token_ids):
    """05.B1: token_ids ends with the new token: a new block when it starts one; the block it fills
    is registered."""
    from kvlab.built.nb04 import hash_block

    bs, table, n = blocks.block_size, blocks.tables[seq_id], len(token_ids)
    if (n - 1) % bs == 0:
        table.append(blocks.take())  # the last block was full
    if n % bs == 0:
        parent = blocks.hash_of[table[-2]] if len(table) > 1 else None
        # a later request may hit it
        blocks.register(table[-1], hash_block(parent, token_ids[-bs:]))


def build_05_slot_mapping(block_table, block_size, start, end):
    """05.B2: position p's K/V goes to physical block block_table[p // block_size], at offset p %
    block_size."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
