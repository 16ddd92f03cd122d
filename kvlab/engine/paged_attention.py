"""Paged attention for any HF decoder via transformers' ``AttentionInterface``: per layer, write the
step's new K/V, then attend each sequence's K/V through its block table. An allow-list: a call that
asks for more is refused by ``check_call`` (what is checked once, at construction: admission.py)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from ..cache.block_manager import cdiv
from .kv_store import PagedKVStore
from .paged_batch import AttnGroup, MissingBatchError, PagedBatch

__all__ = [
    "ATTN_NAME",
    "AttnGroup",
    "MissingBatchError",
    "PagedBatch",
    "attend_fresh",
    "attend_per_sequence",
    "attend_union",
    "attn_mask",
    "build_batch",
    "check_call",
    "group_by_query_length",
    "paged_attention_forward",
    "paged_step",
    "register",
]

ATTN_NAME = "kvlab_paged"
_sdpa = F.scaled_dot_product_attention
# the keywords the paged attention implements
IMPLEMENTED_KWARGS = frozenset({"kvlab_batch", "scaling", "sliding_window", "dropout", "is_causal"})
# transformers' bookkeeping keywords that carry no attention semantics (positions come from
# ``kvlab_batch``)
METADATA_KWARGS = frozenset(
    "position_ids cache_position use_cache output_attentions output_hidden_states "
    "output_router_logits return_dict logits_to_keep".split()
)
# what a refusal calls some keywords (any other one is named as the keyword itself)
_FEATURES = {
    "s_aux": "per-head attention sink logits (s_aux)",
    "softcap": "attention logit soft-capping (softcap)",
    "position_bias": "an additive position bias (position_bias, e.g. ALiBi or relative positions)",
    "encoder_hidden_states": "cross-attention (encoder_hidden_states)",
}


# small-batch attention FLOPs a CPU does while it moves one byte (~100 GFLOP/s, ~12 GB/s)
FLOPS_PER_BYTE = 8


def _plan_union(g: AttnGroup, group: int, element_size: int) -> bool:
    """Whether ``g`` attends over the union of its blocks, each read once (decided once per step:
    sets ``g.union``)."""
    # cost per KV head and key: the bytes a gather copies (K and V, written once, read twice)
    # against the attention FLOPs (4 * query rows * head_dim) of the keys a query may not see; a
    # repeated block: no union
    if g.union is None:
        b, m = g.block_tables.shape
        # query rows of one sequence per KV head
        q_rows = g.query_index.shape[1] * group
        distinct = sorted({blk for t in g.tables for blk in t})
        # per key and head_dim (in blocks: block_size cancels)
        u, gather = len(distinct), FLOPS_PER_BYTE * element_size * 2 * 3
        cheaper = gather * u + 4 * b * q_rows * u < gather * b * m + 4 * q_rows * b * m
        g.union = b > 1 and cheaper and all(len(set(t)) == len(t) for t in g.tables)
        if g.union:
            bs, col = g.block_size, {blk: i for i, blk in enumerate(distinct)}
            pos = torch.full((b, u, bs), -1, dtype=torch.long)
            for i, table in enumerate(g.tables):
                keys = torch.arange(len(table))[:, None] * bs + torch.arange(bs)
                pos[i, [col[blk] for blk in table]] = keys
            g.union_blocks = torch.tensor(distinct, dtype=torch.long, device=g.block_tables.device)
            g.union_pos = pos.view(b, u * bs).to(g.block_tables.device)
    return g.union


def build_batch(store: PagedKVStore, seqs: Sequence[tuple[int, int, Sequence[int]]]) -> PagedBatch:
    """Metadata of one packed step from ``(start, end, block_table)`` per sequence (K/V before
    ``start`` is stored).

    The sequences are attended in groups of similar query lengths (``group_by_query_length``), each
    padded to its longest query and longest block table.
    """
    bs, dev, slots, offsets, off = store.block_size, store.device, [], [], 0
    for start, end, table in seqs:
        if not 0 <= start < end or cdiv(end, bs) > len(table):
            raise ValueError(f"bad span [{start}, {end}) for a block table of {len(table)} blocks")
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        offsets.append(off)
        off += end - start
    groups = []
    for idx in group_by_query_length([e - s for s, e, _ in seqs]):
        rows = [(offsets[i], *seqs[i]) for i in idx]
        qm, m = max(e - s for _, s, e, _ in rows), max(len(t) for *_, t in rows)
        # padded with 0 to (B, Qmax) and (B, max_blocks)
        q_idx = torch.tensor([[*range(o, o + e - s), *[0] * (qm - e + s)] for o, s, e, _ in rows])
        q_pos = torch.tensor([[*range(s, e), *[0] * (qm - e + s)] for _, s, e, _ in rows])
        tables = [list(t) for *_, t in rows]
        bt = torch.tensor([[*t, *[0] * (m - len(t))] for t in tables])
        valid = torch.tensor([[j < e - s for j in range(qm)] for _, s, e, _ in rows])
        # context length of each sequence after this step
        ctx = torch.tensor([e for *_, e, _ in rows])
        dense = bool(valid.all()) and all(o == i * qm for i, (o, *_) in enumerate(rows))
        fresh = all(s == 0 for _, s, _, _ in rows)
        tensors = (t.to(dev) for t in (q_idx, valid, q_pos, bt, ctx))
        groups.append(AttnGroup(*tensors, bs, dense, fresh, tables=tables))
    return PagedBatch(store, torch.tensor(slots, dtype=torch.long, device=dev), groups, off)


def group_by_query_length(lengths: Sequence[int], max_padding: float = 1.5) -> list[list[int]]:
    """Groups of sequences, sorted by length and cut greedily so ``longest x count <= max_padding x
    sum`` in each."""
    # real: the tokens of the last group
    groups, real = [], 0
    # longest first; a stable sort keeps equal lengths in order
    for i in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        n = lengths[i]
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= max_padding * (real + n):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


# K/V gathered per attention call: small enough to stay in a core's cache (issue 31)
KV_CHUNK_BYTES = 2 * 2**20


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvlab_batch: PagedBatch | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: write this layer's new K/V, attend over each sequence's
    pages.

    An allow-list: a call that asks for more than causal (+window) SDPA with a scale raises
    ``NotImplementedError`` naming the feature. Each group of sequences is attended by the
    accelerator's kernel where it takes it (``PagedBatch.kernel``), else over its new K/V alone
    (``attend_fresh``: nothing cached before it), over the union of its blocks (``attend_union``) or
    per sequence (``attend_per_sequence``).
    """
    # query (1, heads, T, D); key, value (1, kv_heads, T, D), RoPE already applied
    batch, layer = kvlab_batch, getattr(module, "layer_idx", None)
    check_call(
        module, query, key, value, attention_mask, dropout, batch, sliding_window, is_causal, kwargs
    )
    store, window = batch.store, sliding_window
    # (kv_heads, T, D); the kernel writes them in one call where it is on
    (batch.kernel or store).write_heads(layer, batch.slot_mapping, key[0], value[0])
    # (T, heads, D), (T, kv_heads, D)
    q_all, k_all, v_all = (x[0].transpose(0, 1) for x in (query, key, value))
    _, heads, d = q_all.shape
    # query heads per KV head (grouped-query attention)
    kv_heads = k_all.shape[1]
    group = heads // kv_heads
    # e.g. a decode-only step: no gather, no scatter
    whole = len(batch.groups) == 1 and batch.groups[0].dense
    out = None if whole else torch.empty_like(q_all)
    for g in batch.groups:
        if batch.kernel is not None and batch.kernel.takes(g, group):
            out = batch.kernel.attend(g, layer, q_all, out, scaling, window)
            continue
        b, q_len = g.query_index.shape
        # (B, Qmax, heads, D): a view of the whole step, else gathered by index
        q, k, v = (x.reshape(b, q_len, *x.shape[1:]) if whole else x[g.query_index]
                   for x in (q_all, k_all, v_all))
        if g.fresh and (window is None or window >= q_len):
            o = attend_fresh(q, k, v, scaling)
        else:
            # GQA without repeating K/V: query head h reads KV head h // group, so a KV head's
            # query heads become extra query rows of it, (B, kv_heads, group * Qmax, D)
            q = q.view(b, q_len, kv_heads, group, d).permute(0, 2, 3, 1, 4)
            q = q.reshape(b, kv_heads, group * q_len, d)
            if g.union or (g.union is None and _plan_union(g, group, store.k.element_size())):
                o = attend_union(g, store, layer, q, scaling, window)
            else:
                o = attend_per_sequence(g, store, layer, q, scaling, window)
            # back to (B, Qmax, heads, D)
            o = o.reshape(b, kv_heads, group, q_len, d).permute(0, 3, 1, 2, 4)
            o = o.reshape(b, q_len, heads, d)
        if whole:
            # (1, T, heads, D), contiguous as from SDPA
            return o.reshape(1, b * q_len, heads, d).contiguous(), None
        out[g.query_index[g.query_valid]] = o[g.query_valid]
    # (1, T, heads, D)
    return out.unsqueeze(0), None


def attn_mask(
    g: AttnGroup, group: int, window: int | None, dtype: torch.dtype, union: bool = False
) -> torch.Tensor:
    """Additive mask (0 or -inf) of GQA's stacked query rows (SDPA would convert a bool one per
    layer), once a step.

    ``(B, 1, group * Qmax, Kmax)``; with ``union``, ``(1, 1, B * group * Qmax, U * block_size)``
    over its keys."""
    key = (union, group, window, dtype)
    if key not in g.masks:
        # (B, 1, Ku) with -1 where the key is not the sequence's, or (K,)
        n = g.block_tables.shape[1] * g.block_size
        k_pos = (
            g.union_pos[:, None] if union else torch.arange(n, device=g.context.device)
        )
        # (B, Qmax, 1)
        q_pos = g.query_pos[:, :, None]
        # (B, Qmax, K)
        ok = (k_pos >= 0) & (k_pos <= q_pos) & (k_pos < g.context[:, None, None])
        if window is not None:
            ok &= k_pos > q_pos - window
        # a row that sees nothing (padding) sees every key: finite, never read
        ok |= ~ok.any(-1, keepdim=True)
        b, q_len, k_len = ok.shape
        shape = (1, 1, b * group * q_len, k_len) if union else (b, 1, group * q_len, k_len)
        ok = ok[:, None].expand(b, group, q_len, k_len).reshape(shape)
        mask = torch.zeros(shape, dtype=dtype, device=ok.device)
        g.masks[key] = mask.masked_fill_(~ok, float("-inf"))
    return g.masks[key]


def attend_fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Sequences with nothing cached before this step: plain causal SDPA over the step's own K/V, no
    mask.

    ``q`` ``(B, Qmax, heads, D)``, ``k`` and ``v`` ``(B, Qmax, kv_heads, D)`` -> ``(B, Qmax, heads,
    D)``. A padded query row is past every real one, so causality alone keeps the real rows exact.
    """
    group = q.shape[2] // k.shape[2]
    # (B, heads or kv_heads, Qmax, D)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o = _sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=group > 1)
    # (B, Qmax, heads, D)
    return o.transpose(1, 2)


def attend_union(g: AttnGroup, store: PagedKVStore, layer: int, q: torch.Tensor,
                 scaling: float | None, window: int | None) -> torch.Tensor:
    """Every sequence of ``g`` against the union of its blocks, each block gathered once
    (``_plan_union``).

    ``q`` ``(B, kv_heads, group * Qmax, D)`` (a KV head's query rows) -> the same shape: one SDPA
    per KV head over all the group's query rows, a mask (``attn_mask(union=True)``) keeping each
    row to its own sequence's keys.
    """
    b, kv_heads, rows, d = q.shape
    # (kv_heads, U * block_size, D)
    k, v = store.gather_heads(layer, g.union_blocks)
    # (1, 1, B * group * Qmax, U * block_size)
    mask = attn_mask(g, rows // g.query_index.shape[1], window, q.dtype, union=True)
    q = q.transpose(0, 1).reshape(1, kv_heads, b * rows, d)
    k, v = k.to(q.dtype)[None], v.to(q.dtype)[None]
    o = _sdpa(q, k, v, attn_mask=mask, scale=scaling)
    # (B, kv_heads, group * Qmax, D)
    return o.view(kv_heads, b, rows, d).transpose(0, 1)


def attend_per_sequence(g: AttnGroup, store: PagedKVStore, layer: int, q: torch.Tensor,
                        scaling: float | None, window: int | None) -> torch.Tensor:
    """Each sequence of ``g`` against its own block table, a few sequences at a time
    (``KV_CHUNK_BYTES``), so their gathered K/V is still in cache when the attention reads it.

    ``q`` ``(B, kv_heads, group * Qmax, D)`` (a KV head's query rows) -> the same shape.
    """
    b, kv_heads, rows, d = q.shape
    # (B, 1, group * Qmax, Kmax)
    mask = attn_mask(g, rows // g.query_index.shape[1], window, q.dtype)
    # K/V bytes of one sequence in one layer
    per_seq = g.block_tables.shape[1] * store.bytes_per_block // store.num_layers
    step, outs = max(1, KV_CHUNK_BYTES // per_seq), []
    for i in range(0, b, step):
        n = min(step, b - i)
        # (kv_heads, n * Kmax, D) -> (n, kv_heads, Kmax, D)
        k, v = store.gather_heads(layer, g.block_tables[i : i + n].reshape(-1))
        k = k.to(q.dtype).view(kv_heads, n, -1, d).transpose(0, 1)
        v = v.to(q.dtype).view(kv_heads, n, -1, d).transpose(0, 1)
        part = slice(i, i + n)
        outs.append(_sdpa(q[part], k, v, attn_mask=mask[part], scale=scaling))
    # (B, kv_heads, group * Qmax, D)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def refuse_feature(feature: str) -> None:
    """Refuse an attention feature by name (a call's keyword or a config's)."""
    raise NotImplementedError(f"{feature} is not implemented by kvlab's paged attention")


def check_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    batch: PagedBatch | None,
    sliding_window: Any,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> None:
    """Refuse (``NotImplementedError``, naming it) what one call asks beyond causal (+window) SDPA
    with a scale; record its layer and window. Every call: a layer may ask what the probe's did not.
    """
    layer, refuse = getattr(module, "layer_idx", None), refuse_feature
    if batch is None:
        raise MissingBatchError(
            f"attention {ATTN_NAME!r} needs the forward keyword `kvlab_batch` (run it through "
            "kvlab.engine.Engine, or inside `paged_step()` on a model switched to it)"
        )
    if attention_mask is not None:
        what = type(attention_mask).__name__
        refuse(f"the model's own attention mask (a {what} passed to the attention)")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        refuse("non-causal (bidirectional) attention")
    if dropout:
        refuse(f"attention dropout (p={dropout}; put the model in eval mode)")
    if sliding_window is not None and (type(sliding_window) is not int or sliding_window < 1):
        refuse(f"a sliding window of {sliding_window!r} (only a positive int of tokens)")
    if kwargs.get("output_attentions"):
        refuse("returning attention weights (output_attentions=True)")
    for name, v in kwargs.items():
        # an unknown keyword is accepted only when off (None)
        if name not in METADATA_KWARGS and v is not None:
            refuse(_FEATURES.get(name, f"the attention keyword {name!r} (a {type(v).__name__}, "
                                       "not None)"))
    if not isinstance(layer, int):
        raise NotImplementedError(
            f"an attention module without an int layer_idx ({type(module).__name__}): kvlab's "
            "paged attention stores K/V per layer"
        )
    batch.layers_run.append(layer)
    batch.windows_run.append(sliding_window)
    if query.shape[0] != 1 or query.shape[2] != batch.num_tokens:
        raise ValueError(
            f"expected a packed (1, heads, {batch.num_tokens}, D) query, got {tuple(query.shape)}"
        )
    store, kv_heads, d = batch.store, key.shape[1], query.shape[-1]
    if kv_heads != store.kv_heads or {key.shape[-1], value.shape[-1], d} != {store.head_dim}:
        raise NotImplementedError(
            f"layer {layer} has {kv_heads} KV heads with key/value/query widths {key.shape[-1]}/"
            f"{value.shape[-1]}/{d}, but the store holds {store.kv_heads} x {store.head_dim} for "
            "every layer: per-layer sizes, or keys and values of different widths (e.g. multi-head "
            "latent attention), are not implemented"
        )


# our own state, like nano-vllm's context
_IN_STEP: ContextVar[bool] = ContextVar("kvlab_paged_step", default=False)


def register(model: Any) -> tuple[str, str]:
    """Register kvlab's attention and mask for ``model`` (transformers' public interfaces); return
    ``(own, name)``."""
    from transformers import AttentionInterface, AttentionMaskInterface

    # switched by another engine
    own = model.config._attn_implementation.removeprefix(ATTN_NAME + "_")
    # it carries the model's own implementation, run outside paged_step()
    name = f"{ATTN_NAME}_{own}"
    AttentionInterface.register(name, functools.partial(_attention, own))
    AttentionMaskInterface.register(name, functools.partial(_mask, own))
    return own, name


@contextlib.contextmanager
def paged_step() -> Iterator[None]:
    """Within the block, an attached model's forward is a kvlab step: no mask of its own, paged
    attention."""
    token = _IN_STEP.set(True)
    try:
        yield
    finally:
        _IN_STEP.reset(token)


def _attention(own: str, module: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The registered attention: the paged one inside ``paged_step()``, the model's own (``own``)
    outside it."""
    if _IN_STEP.get():
        return paged_attention_forward(module, *args, **kwargs)
    if kwargs.get("kvlab_batch") is not None:
        raise RuntimeError(
            "a forward with kvlab_batch runs inside kvlab.engine.paged_attention.paged_step()"
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is no registered function: each model runs its modeling module's own
    # eager_attention_forward
    modeling = vars(sys.modules[type(module).__module__])
    fn = modeling.get("eager_attention_forward") if own == "eager" else ALL_ATTENTION_FUNCTIONS[own]
    if fn is None:
        raise NotImplementedError(
            f"{type(module).__name__}: no eager_attention_forward to fall back on"
        )
    return fn(module, *args, **kwargs)


def _mask(own: str, **kwargs: Any) -> Any:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # an implementation without one gets no mask
    if _IN_STEP.get() or own not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[own](**kwargs)
