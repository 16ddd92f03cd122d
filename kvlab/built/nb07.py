"""What notebook 07_isolation_and_security.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import hashlib
import hmac

from kvlab.cache.hashing import hash_block
from kvlab.engine import SamplingParams


# --- 07_isolation_and_security.ipynb, cell 5 ---
def tenant_salt(secret: bytes, tenant: str) -> str:
    """A tenant's cache salt: HMAC-SHA256 of its id under the server's secret, in hex."""
    return hmac.new(secret, b"kvlab-tenant\x00" + tenant.encode(), hashlib.sha256).hexdigest()


# --- 07_isolation_and_security.ipynb, cell 8 ---
def salted_hashes(token_ids: list[int], block_size: int, salt: str,
                  salt_block: int = 0) -> list[bytes]:
    """Chained hashes of ``token_ids``' full blocks; block ``salt_block`` adds ("salt", salt)."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        keys = (("salt", salt),) if i == salt_block else ()  # the chain carries the salt on
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


# --- 07_isolation_and_security.ipynb, cell 14 ---
def timing_probe(engine, prompt_ids, tenant):
    """Send one prompt alone as ``tenant``: (TTFT in seconds, prompt tokens served by the cache)."""
    out = engine.generate([list(prompt_ids)], SamplingParams(max_tokens=1), tenants=[tenant])[0]
    return out.ttft, out.num_cached_tokens


# --- 07_isolation_and_security.ipynb, cell 17 ---
def roc_auc(positive_scores, negative_scores):
    """P(a positive scores above a negative), ties count 1/2: Mann-Whitney U / (n_pos * n_neg)."""
    pos, neg = [float(x) for x in positive_scores], [float(x) for x in negative_scores]
    if not pos or not neg:
        raise ValueError("need at least one positive and one negative score")
    ranks = {}  # score -> (first 1-based rank, last rank) of its run of ties
    for r, x in enumerate(sorted(pos + neg), start=1):
        ranks[x] = (ranks.get(x, (r, r))[0], r)
    u = sum((ranks[x][0] + ranks[x][1]) / 2 for x in pos) - len(pos) * (len(pos) + 1) / 2
    return u / (len(pos) * len(neg))
