"""Worked solutions of the notebooks' exercises, one function per exercise.

Tested against the checkers in ``tests/test_exercises.py``; never imported by a notebook (each exercise
starts blank there). One block per notebook, in notebook order.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- 00 the passphrase experiment

# ----------------------------------------------------------------------------- 01 QKV and the KV cache

# ----------------------------------------------------------------------------- 02 manual prefix reuse

# ----------------------------------------------------------------------------- 03 position encoding

# ----------------------------------------------------------------------------- 04 the paged block manager

# ----------------------------------------------------------------------------- 05 shared vs isolated

# ----------------------------------------------------------------------------- 06 vLLM side by side

# ----------------------------------------------------------------------------- 07 isolation and security
def ex07_1_salt_split(public_tokens: int = 40, block_size: int = 16) -> tuple[int, int]:
    """07.1: the salt enters the first block that extends past the public prefix; only whole public blocks before it
    are shared. 40 tokens in blocks of 16: blocks 0 and 1 (32 tokens) are whole, block 2 straddles -> (2, 32)."""
    salted = public_tokens // block_size
    return salted, salted * block_size


def ex07_2_prefill_tokens(n_tenants: int = 8, system_tokens: int = 120, question_tokens: int = 10,
                          block_size: int = 16) -> tuple[int, int]:
    """07.2: with per-tenant salts every tenant prefills its whole prompt; with the public prefix every tenant after
    the first reuses the system prompt's whole blocks (120 // 16 = 7 blocks = 112 tokens) -> (1040, 256)."""
    n = system_tokens + question_tokens
    shared = (system_tokens // block_size) * block_size
    return n_tenants * n, n_tenants * n - (n_tenants - 1) * shared


def ex07_3_auc(positives, negatives) -> float:
    """07.3: ROC AUC over all positive-negative pairs, a win counting 1 and a tie one half."""
    pairs = [(p > n) + 0.5 * (p == n) for p in positives for n in negatives]
    return sum(pairs) / len(pairs)
