"""Reusing the middle: position-independent chunk caching with selective recompute
(CacheBlend-style).

A prefix cache (``kvlab.prefix``) serves only a prompt's *leading* tokens. A RAG prompt is
``system prompt + passages (in any order) + question``: after the system prompt nothing is a prefix
of anything, so each passage is recomputed in every request. CacheBlend (Yao et al., EuroSys 2025)
keeps each passage's K/V and fixes two errors when it is reused elsewhere:

1. **positions**: the keys were rotated (RoPE) for the positions the chunk was computed at; rotating
   them again by the offset moves them exactly (``rerotate_keys``; layer 0 then matches a full
   prefill);
2. **missing cross-attention**: from layer 1 on, a reused token's K/V encode only the context it was
   computed in, not the passages now before it. ``blend_prefill`` computes one early layer's true
   K/V for the combined prompt, picks the ``recompute`` share of reused tokens whose K/V deviate
   most, and recomputes those tokens (and every non-reused one) through all layers with full
   attention over the combined context; the other reused tokens keep their cached K/V.

``recompute=1.0`` is a full prefill (token-identical); ``recompute=0.0`` is naive reuse (positions
fixed, cross-attention missing). ``ChunkCache`` keys entries by the chunk's token ids, the tenant's
scope (an HMAC salt as in ``kvlab.engine.tenants``) and the model's fingerprint: another tenant
never hits them.

Why here and not in ``kvlab/engine``: blending works on Hugging Face caches and forwards, next to
``kvlab.prefix``'s ``PrefixKV``; the paged engine has no per-token recompute inside a block.
References: CacheBlend (arXiv 2405.16444), EPIC (arXiv 2410.15332), LMCache's blending docs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.engine.models import encode, eos_ids, model_device_dtype, model_fingerprint, synchronize
from kvlab.engine.rope import inverse_frequencies, rotate_half
from kvlab.engine.tenants import check_secret, tenant_salt
from kvlab.prefix import PrefixKV, continue_from_cache

# model types whose keys are rotated by the "rotate half" RoPE on their first rotary dims; each is
# checked in tests/lessons/test_chunk_cache.py (re-rotated layer-0 keys equal a full prefill's)
ROPE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "phi", "stablelm")
ISOLATION = ("tenant", "shared")

# per layer (keys, values), each (1, kv_heads, seq, head_dim)
Layers = list[tuple[torch.Tensor, torch.Tensor]]


class ChunkReuseError(ValueError):
    """This model or prompt cannot reuse cached chunks at another offset."""


# ----------------------------------------------------------------------------- moving keys

def rotary_spec(config: Any) -> tuple[float, int]:
    """(RoPE base, rotary dims) of a model whose cached keys may be moved; ``ChunkReuseError``
    otherwise."""
    kind = getattr(config, "model_type", None)
    if kind not in ROPE_MODEL_TYPES:
        raise ChunkReuseError(
            "reusing a chunk at another offset re-rotates its cached keys, which needs rotary "
            f"position embeddings (RoPE); model type {kind!r} is not one of the RoPE models this "
            f"is checked on {ROPE_MODEL_TYPES} (absolute or ALiBi positions cannot be moved "
            "by rotating keys)"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ChunkReuseError(
            "chunk blending needs full attention in every layer; this config has a "
            f"sliding window of {config.sliding_window} tokens"
        )
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ChunkReuseError(
            f"only plain RoPE keys are re-rotated here; this config uses RoPE scaling {rope_type!r}"
        )
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factor = float(
        params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    )
    head_dim = int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    return theta, int(head_dim * factor)


def rerotate_keys(
    keys: torch.Tensor, delta: int, theta: float, rotary_dim: int | None = None
) -> torch.Tensor:
    """Move RoPE'd keys (batch, kv_heads, seq, head_dim) by ``delta`` positions; dims past
    ``rotary_dim`` stay.

    A rotation by p followed by one by delta is a rotation by p + delta, so the result equals the
    key computed at p + delta up to float rounding. The angles are computed in float32.
    """
    rotary_dim = keys.shape[-1] if rotary_dim is None else rotary_dim
    if delta == 0:
        return keys
    rot, rest = keys[..., :rotary_dim].float(), keys[..., rotary_dim:]
    angle = delta * inverse_frequencies(rotary_dim, theta, device=keys.device)  # (rotary_dim/2,)
    cos, sin = torch.cat((angle, angle)).cos(), torch.cat((angle, angle)).sin()  # (rotary_dim,)
    moved = (rot * cos + rotate_half(rot) * sin).to(keys.dtype)
    return torch.cat((moved, rest), dim=-1) if rest.shape[-1] else moved


# ----------------------------------------------------------------------------- the chunk cache

@dataclass(frozen=True)
class ChunkKV:
    """One chunk's K/V, computed once at positions ``start ..``; never written after it is
    stored."""

    token_ids: tuple[int, ...]
    layers: Layers
    start: int
    build_seconds: float = 0.0


class ChunkCache:
    """K/V of text chunks keyed by (tenant scope, model fingerprint, token ids): reusable at any
    offset.

    A cache belongs to the model (and tokenizer) it was built with; build a new one after changing
    weights. ``isolation="tenant"`` (default) gives each tenant its own scope, an HMAC of the tenant
    id under a server ``secret``; ``"shared"`` lets every tenant hit every chunk (see notebook 03b
    for what that leaks).
    """

    def __init__(self, model: Any, tokenizer: Any, *, isolation: str = "tenant",
                 secret: bytes | str | None = None) -> None:
        if isolation not in ISOLATION:
            raise ValueError(f"unknown isolation {isolation!r}: use one of {ISOLATION}")
        self.theta, self.rotary_dim = rotary_spec(model.config)  # refuse non-RoPE models up front
        self.model, self.tokenizer, self.isolation = model, tokenizer, isolation
        self.fingerprint = model_fingerprint(model, tokenizer)
        self._secret = check_secret(secret)
        self._entries: dict[str, ChunkKV] = {}
        self.hits = self.misses = 0

    def scope(self, tenant: str | None) -> str:
        """The scope a tenant's chunks live in: its salt, or "" when every tenant shares."""
        return "" if self.isolation == "shared" else tenant_salt(self._secret, tenant)

    def key(self, ids: Sequence[int], tenant: str | None = None) -> str:
        """The content key of a chunk for ``tenant``: sha256 over scope, model fingerprint and token
        ids."""
        h = hashlib.sha256(f"{self.scope(tenant)}|{self.fingerprint}|".encode())
        h.update(",".join(map(str, ids)).encode())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: tuple[Sequence[int], str | None]) -> bool:
        """``(ids, tenant) in cache``: whether that tenant would hit the chunk (no hit is
        counted)."""
        ids, tenant = item
        return self.key(list(ids), tenant) in self._entries

    def nbytes(self) -> int:
        """Bytes of K and V held by all entries."""
        return sum(
            t.numel() * t.element_size()
            for e in self._entries.values()
            for kv in e.layers
            for t in kv
        )

    def put(
        self, ids: str | Sequence[int], layers: Layers, start: int = 0, tenant: str | None = None
    ) -> ChunkKV:
        """Store K/V a request already computed for ``ids`` at positions ``start ..`` (copied: the
        caller's stay theirs)."""
        ids = encode(self.tokenizer, ids)
        if not ids or any(k.shape[-2] != len(ids) or v.shape[-2] != len(ids) for k, v in layers):
            raise ValueError(
                f"need one (keys, values) per layer, each holding the chunk's {len(ids)} tokens"
            )
        if len(layers) != self.model.config.num_hidden_layers:
            raise ValueError(
                f"{len(layers)} layers given, the model has {self.model.config.num_hidden_layers}"
            )
        entry = ChunkKV(
            tuple(ids), [(k.detach().clone(), v.detach().clone()) for k, v in layers], int(start)
        )
        self._entries[self.key(ids, tenant)] = entry
        return entry

    @torch.no_grad()
    def compute(self, ids: str | Sequence[int], tenant: str | None = None) -> ChunkKV:
        """The chunk's entry in ``tenant``'s scope: a hit, or computed once alone at positions 0 ..
        and stored."""
        ids = encode(self.tokenizer, ids)
        if not ids:
            raise ValueError("an empty chunk has no K/V to cache")
        entry = self._entries.get(self.key(ids, tenant))
        if entry is not None:
            self.hits += 1
            return entry
        self.misses += 1
        device, _ = model_device_dtype(self.model)
        t0 = time.perf_counter()
        cache = self.model(
            input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1
        ).cache
        synchronize(device)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        entry = ChunkKV(tuple(ids), layers, 0, time.perf_counter() - t0)
        self._entries[self.key(ids, tenant)] = entry
        return entry


# ----------------------------------------------------------------------------- blending


@dataclass
class Blend:
    """One blended prefill: the first token's logits, the cache to decode on, and what was
    reused."""

    prompt_ids: list[int]
    logits: torch.Tensor  # (vocab,) at the last prompt token
    cache: Any  # transformers DynamicCache over the whole prompt, positions in order
    reused: list[int]  # prompt positions whose K/V came from the chunk cache
    recomputed: list[int]  # the reused positions picked for recompute
    # (len(reused),) K/V deviation at select_layer, None when not measured
    deviation: torch.Tensor | None
    # select, prefill, ttft (hits only), miss
    seconds: dict[str, float] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # filled by blend_generate


class _Stop(Exception):
    """Raised by a forward hook to end a forward pass after the layer it watches."""


def _cache(model: Any, layers: Layers) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


@torch.no_grad()
def true_kv_at(model: Any, ids: Sequence[int], layer: int, prefix: PrefixKV | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` for the prompt's tokens after ``prefix``, computed for the combined
    context.

    Runs layers 0 .. ``layer`` only (a hook stops the forward after it). Each (1, kv_heads, T,
    head_dim).
    """
    device, _ = model_device_dtype(model)
    m = len(prefix) if prefix is not None else 0
    cache = _cache(
        model, [(lay.keys, lay.values) for lay in prefix.cache.layers] if prefix is not None else []
    )

    def stop(*_: Any) -> None:
        raise _Stop

    handle = model.base_model.layers[layer].register_forward_hook(stop)
    try:
        model(input_ids=torch.tensor([list(ids[m:])], device=device), cache=cache, use_cache=True,
              position_ids=torch.arange(m, len(ids), device=device)[None], logits_to_keep=1)
    except _Stop:
        pass
    finally:
        handle.remove()
    return cache.layers[layer].keys[:, :, m:], cache.layers[layer].values[:, :, m:]


Pieces = Sequence[tuple[str | Sequence[int], bool]]  # (text or ids, reuse from the chunk cache?)


def _check_prefix(
    chunks: ChunkCache, prefix: PrefixKV, ids: Sequence[int], first_reused: int
) -> None:
    """Raise unless ``prefix`` is an exact cache of the prompt's first tokens on the chunk cache's
    model."""
    device, dtype = model_device_dtype(chunks.model)
    k = prefix.cache.layers[0].keys
    if prefix.fingerprint != chunks.fingerprint or k.device != device or k.dtype != dtype:
        raise ChunkReuseError(
            "the prefix cache was built by another model, tokenizer, "
            "device or dtype than the chunk cache"
        )
    if prefix.seq_length() != len(prefix) or tuple(ids[:len(prefix)]) != prefix.token_ids:
        raise ChunkReuseError(
            "the prefix cache does not hold exactly the prompt's first tokens (or was written into)"
        )
    if first_reused < len(prefix):
        raise ChunkReuseError(
            f"a reused chunk starts at {first_reused}, inside the {len(prefix)}-token prefix cache"
        )


def _fetch(chunks: ChunkCache, pieces: list[tuple[list[int], bool]], tenant: str | None
           ) -> tuple[list[int], Layers, float]:
    """Reused positions, their K/V moved to those positions (per layer), and the seconds spent on
    misses."""
    reused, parts, miss, pos = [], [], 0.0, 0
    for ids, reuse in pieces:
        if reuse and ids:
            before = chunks.misses
            entry = chunks.compute(ids, tenant)
            miss += entry.build_seconds if chunks.misses > before else 0.0
            delta = pos - entry.start  # from where it was computed to where it sits now
            parts.append(
                [
                    (rerotate_keys(k, delta, chunks.theta, chunks.rotary_dim), v)
                    for k, v in entry.layers
                ]
            )
            reused += range(pos, pos + len(ids))
        pos += len(ids)
    layers = [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
              for i in range(len(parts[0]))] if parts else []
    return reused, layers, miss


def _deviation(model: Any, ids: list[int], reused: list[int], moved: Layers, layer: int,
               prefix: PrefixKV | None) -> torch.Tensor:
    """Per reused token, the L2 distance of its cached K/V at ``layer`` from the true ones.
    (len(reused),)"""
    m = len(prefix) if prefix is not None else 0
    k_true, v_true = true_kv_at(model, ids, layer, prefix)  # (1, kv_heads, N - m, head_dim) each
    at = torch.tensor(reused, device=k_true.device) - m
    k_used, v_used = moved[layer]
    sq = (k_true[:, :, at] - k_used).float().pow(2).sum((0, 1, 3)) + (
        v_true[:, :, at] - v_used
    ).float().pow(2).sum((0, 1, 3))
    return sq.sqrt()


def _kept_cache(model: Any, prefix: PrefixKV | None, moved: Layers, kept: list[int]) -> Any:
    """A cache of the prefix's K/V followed by the kept reused tokens' (``kept`` indexes
    ``moved``)."""
    layers = []
    for i in range(model.config.num_hidden_layers):
        ks = [prefix.cache.layers[i].keys] if prefix is not None else []
        vs = [prefix.cache.layers[i].values] if prefix is not None else []
        if kept:
            at = torch.tensor(kept, dtype=torch.long, device=moved[i][0].device)
            ks.append(moved[i][0][:, :, at])
            vs.append(moved[i][1][:, :, at])
        if ks:
            layers.append((torch.cat(ks, 2), torch.cat(vs, 2)))
    return _cache(model, layers)


def _attention_mask(
    key_pos: torch.Tensor, query_pos: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask (1, 1, queries, keys): a query sees the keys at its own position or before."""
    allowed = key_pos[None, :] <= query_pos[:, None]  # (Q, K)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=key_pos.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def pick_tokens(deviation: torch.Tensor, count: int) -> list[int]:
    """Indices of the ``count`` largest deviations, in increasing order."""
    if count <= 0:
        return []
    return sorted(torch.topk(deviation, min(count, deviation.numel())).indices.tolist())


@torch.no_grad()
def blend_prefill(
    chunks: ChunkCache,
    pieces: Pieces,
    recompute: float,
    *,
    tenant: str | None = None,
    prefix: PrefixKV | None = None,
    select_layer: int = 1,
) -> Blend:
    """Prefill a prompt made of ``(text or ids, reuse)`` pieces, reusing the chunk cache for pieces
    marked reuse.

    Reused chunks are fetched (computed alone once on a miss) and their keys moved to where they
    sit. ``recompute`` (0..1) of the reused tokens, those whose K/V at ``select_layer`` deviate most
    from that layer's true K/V, are recomputed with every non-reused token and the last one; the
    rest keep their cached K/V. ``prefix``: an exact ``PrefixKV`` of the prompt's first tokens
    (never recomputed).
    """
    model = chunks.model
    if not 0.0 <= recompute <= 1.0:
        raise ValueError(f"recompute is a share of the reused tokens in [0, 1], got {recompute}")
    if not 1 <= select_layer < model.config.num_hidden_layers:
        raise ValueError(
            f"select_layer must be in 1 .. {model.config.num_hidden_layers - 1}: layer 0's K/V "
            "depend only on token and position, so re-rotated chunks are exact there; "
            f"got {select_layer}"
        )
    encoded = [(encode(chunks.tokenizer, piece), bool(reuse)) for piece, reuse in pieces]
    ids = [t for p, _ in encoded for t in p]
    if not ids:
        raise ValueError("the prompt is empty")
    m = len(prefix) if prefix is not None else 0
    if prefix is not None:
        starts = [
            sum(len(p) for p, _ in encoded[:i])
            for i, (p, reuse) in enumerate(encoded)
            if reuse and p
        ]
        _check_prefix(chunks, prefix, ids, min(starts, default=len(ids)))
    device, dtype = model_device_dtype(model)
    t0 = time.perf_counter()
    reused, moved, miss = _fetch(chunks, encoded, tenant)
    count = round(recompute * len(reused))
    t_sel, deviation = time.perf_counter(), None
    if 0 < count < len(reused):
        deviation = _deviation(model, ids, reused, moved, select_layer, prefix)
        picked = pick_tokens(deviation, count)
    else:
        picked = list(range(count))  # none, or all of them
    t_sel = time.perf_counter() - t_sel
    last = len(ids) - 1  # always computed: its logits start the answer
    kept = [i for i in sorted(set(range(len(reused))) - set(picked)) if reused[i] != last]
    kept_pos = list(range(m)) + [reused[i] for i in kept]
    computed = sorted(set(range(m, len(ids))) - {reused[i] for i in kept})
    cache = _kept_cache(model, prefix, moved, kept)
    q_pos = torch.tensor(computed, device=device)
    mask = None  # the default causal mask is right when every computed token follows every kept one
    if kept_pos != list(range(len(kept_pos))) or computed != list(range(len(kept_pos), len(ids))):
        mask = _attention_mask(torch.tensor(kept_pos + computed, device=device), q_pos, dtype)
    t_fwd = time.perf_counter()
    out = model(
        input_ids=torch.tensor([[ids[p] for p in computed]], device=device),
        position_ids=q_pos[None],
        cache=cache,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[0, -1]
    synchronize(device)
    t1 = time.perf_counter()
    # back to positions 0 .. N-1
    order = torch.argsort(torch.tensor(kept_pos + computed, device=device))
    cache = _cache(
        model, [(lay.keys[:, :, order], lay.values[:, :, order]) for lay in out.cache.layers]
    )
    seconds = {"select": t_sel, "prefill": t1 - t_fwd, "ttft": t1 - t0 - miss, "miss": miss}
    return Blend(ids, logits, cache, reused, [reused[i] for i in picked], deviation, seconds)


@torch.no_grad()
def blend_generate(chunks: ChunkCache, pieces: Pieces, recompute: float, *,
                   tenant: str | None = None, prefix: PrefixKV | None = None, select_layer: int = 1,
                   max_new_tokens: int = 32) -> Blend:
    """``blend_prefill``, then greedy decoding on its cache; the generated ids are in
    ``.token_ids``."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    b = blend_prefill(
        chunks, pieces, recompute, tenant=tenant, prefix=prefix, select_layer=select_layer
    )
    stop = eos_ids(chunks.model, chunks.tokenizer)
    first = int(b.logits.argmax())
    b.token_ids = [first]
    if first not in stop and max_new_tokens > 1:
        rest, *_ = continue_from_cache(chunks.model, b.cache, [first], len(b.prompt_ids),
                                       max_new_tokens=max_new_tokens - 1, stop_ids=stop)
        b.token_ids += rest
    return b
