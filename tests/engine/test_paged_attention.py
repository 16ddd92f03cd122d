"""Paged attention against plain causal attention: cached offsets, packed mixed batches, GQA,
windows."""

import math
from types import SimpleNamespace

import pytest
import torch

from kvlab.engine.kv_store import PagedKVStore
from kvlab.engine.paged_attention import build_batch, paged_attention_forward, paged_step, register

BS, KVH, H, D = 4, 2, 4, 8


def _write(store, slots, k, v):
    """Store layer 0's K/V, two (T, kv_heads, D), at ``slots``."""
    store.write_heads(0, slots, k.transpose(0, 1), v.transpose(0, 1))


def _read(store, table, n):
    """Layer 0's first ``n`` K/V entries of one sequence, two (n, kv_heads, D), through its block
    table."""
    return store.k[0, table].reshape(-1, KVH, D)[:n], store.v[0, table].reshape(-1, KVH, D)[:n]


def _reference(q, k, v, positions, window=None):
    """Plain attention of queries at ``positions`` over keys 0..p (GQA by repeating KV heads)."""
    # q (n, H, D); k, v (ctx, KVH, D)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,khd->hk", q[i], k[lo : p + 1]) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[lo : p + 1]))
    return torch.stack(out)  # (n, H, D)


@pytest.mark.parametrize("window", [None, 5])
def test_packed_mixed_batch_matches_reference(window):
    torch.manual_seed(0)
    store = PagedKVStore(1, num_blocks=24, block_size=BS, kv_heads=KVH, head_dim=D)
    free = torch.randperm(24).tolist()  # non-contiguous block tables
    # (cached tokens, new tokens): a decode, a fresh prefill, a prefill after a cached prefix,
    # another decode
    spans = [(9, 1), (0, 7), (8, 5), (3, 1)]
    seqs, full, packed_q, packed_k, packed_v = [], [], [], [], []
    for cached, new in spans:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // BS))]
        k, v = torch.randn(ctx, KVH, D), torch.randn(ctx, KVH, D)
        q = torch.randn(new, H, D)
        slots = torch.tensor(
            [table[p // BS] * BS + p % BS for p in range(cached)], dtype=torch.long
        )
        _write(store, slots, k[:cached], v[:cached])  # what earlier steps left in the store
        seqs.append((cached, ctx, table))
        full.append((q, k, v))
        packed_q.append(q)
        packed_k.append(k[cached:])
        packed_v.append(v[cached:])
    batch = build_batch(store, seqs)
    query = torch.cat(packed_q).transpose(0, 1)[None]  # (1, H, T, D)
    key = torch.cat(packed_k).transpose(0, 1)[None]  # (1, KVH, T, D)
    value = torch.cat(packed_v).transpose(0, 1)[None]
    out, weights = paged_attention_forward(
        SimpleNamespace(layer_idx=0),
        query,
        key,
        value,
        None,
        scaling=D**-0.5,
        kvlab_batch=batch,
        sliding_window=window,
    )
    assert weights is None and out.shape == (1, batch.num_tokens, H, D)
    got = out[0].split([n for _, n in spans])
    for (cached, new), (q, k, v), g in zip(spans, full, got):
        want = _reference(q, k, v, range(cached, cached + new), window)
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    # every new token's K/V is now in the store at its slot
    for (_, ctx, table), (_, k, v) in zip(seqs, full):
        rk, rv = _read(store, table, ctx)
        assert torch.equal(rk, k) and torch.equal(rv, v)


def _shared_prefix_step(spans, window=None, seed=3):
    """Sequences sharing 2 cached prefix blocks, each with its own blocks: (cached, new) per
    sequence."""
    torch.manual_seed(seed)
    store = PagedKVStore(1, num_blocks=40, block_size=BS, kv_heads=KVH, head_dim=D)
    free = torch.randperm(40).tolist()
    prefix = [free.pop(), free.pop()]  # 8 tokens every sequence holds in the same physical blocks
    pk, pv = torch.randn(2 * BS, KVH, D), torch.randn(2 * BS, KVH, D)
    _write(store, torch.tensor([prefix[p // BS] * BS + p % BS for p in range(2 * BS)]), pk, pv)
    seqs, full, qs, ks, vs = [], [], [], [], []
    for cached, new in spans:
        ctx = cached + new
        table = prefix + [free.pop() for _ in range(-(-ctx // BS) - 2)]
        k = torch.cat([pk, torch.randn(ctx - 2 * BS, KVH, D)])
        v = torch.cat([pv, torch.randn(ctx - 2 * BS, KVH, D)])
        own = range(2 * BS, cached)
        _write(
            store,
            torch.tensor([table[p // BS] * BS + p % BS for p in own], dtype=torch.long),
            k[own],
            v[own],
        )
        q = torch.randn(new, H, D)
        seqs.append((cached, ctx, table))
        full.append((q, k, v))
        qs.append(q)
        ks.append(k[cached:])
        vs.append(v[cached:])
    query = torch.cat(qs).transpose(0, 1)[None]
    key, value = torch.cat(ks).transpose(0, 1)[None], torch.cat(vs).transpose(0, 1)[None]
    return store, seqs, full, (query, key, value)


@pytest.mark.parametrize("window", [None, 3, 11])
def test_decodes_sharing_a_prefix_attend_the_union_of_their_blocks(window):
    """Decodes after a shared prefix read each block once (the union path) and still match the
    reference."""
    spans = [(9, 1), (12, 1), (10, 1), (15, 1), (8, 1), (11, 1)]
    store, seqs, full, (query, key, value) = _shared_prefix_step(spans)
    batch = build_batch(store, seqs)
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0),
        query,
        key,
        value,
        None,
        scaling=D**-0.5,
        kvlab_batch=batch,
        sliding_window=window,
    )
    (g,) = batch.groups
    assert g.union and len(g.union_blocks) < g.block_tables.numel()  # shared blocks read once
    for (cached, new), (q, k, v), got in zip(spans, full, out[0].split([n for _, n in spans])):
        torch.testing.assert_close(
            got, _reference(q, k, v, range(cached, cached + new), window), rtol=1e-5, atol=1e-5
        )
    # the new tokens were written where they belong
    for (_, ctx, table), (_, k, v) in zip(seqs, full):
        rk, rv = _read(store, table, ctx)
        assert torch.equal(rk, k) and torch.equal(rv, v)


def test_union_is_left_for_sequences_that_share_nothing_or_many_queries():
    """The cost model keeps the per-sequence gather where the union would add more scores than it
    saves copies."""
    from kvlab.engine.paged_attention import _plan_union

    store = PagedKVStore(1, num_blocks=40, block_size=BS, kv_heads=KVH, head_dim=D)
    # decodes, nothing shared
    alone = build_batch(store, [(8, 9, [0, 1, 2]), (8, 9, [3, 4, 5]), (8, 9, [6, 7, 8])])
    assert not _plan_union(alone.groups[0], H // KVH, 4)
    shared = build_batch(store, [(8, 9, [0, 1, 2 + i]) for i in range(6)])
    assert _plan_union(shared.groups[0], H // KVH, 4)
    twice = build_batch(store, [(8, 9, [0, 1, 0]), (8, 9, [0, 1, 2])])  # a block twice in one table
    assert not _plan_union(twice.groups[0], H // KVH, 4)
    long_queries = build_batch(
        store, [(8, 40, [0, 1] + list(range(2 + 8 * i, 10 + 8 * i))) for i in range(4)]
    )
    # 32 queries each: the extra scores cost more
    assert not _plan_union(long_queries.groups[0], H // KVH, 4)


@pytest.mark.parametrize("window", [None, 3])
def test_shared_prefix_prefills_and_decodes_in_one_step_match_the_reference(window, monkeypatch):
    """A mixed step after a shared prefix (padded suffix prefills beside decodes) is exact on every
    path.

    First the union for every group (a lone sequence in one gather), then per sequence, one gather
    and attention call per sequence (``KV_CHUNK_BYTES``).
    """
    import kvlab.engine.paged_attention as pa

    spans = [(8, 5), (8, 4), (10, 1), (9, 1), (13, 1), (8, 6), (8, 2)]
    store, seqs, full, (query, key, value) = _shared_prefix_step(spans, seed=4)
    for union in (True, False):  # every group (of two or more) on the union path, then none
        # copies dominate / only FLOPs count
        monkeypatch.setattr(pa, "FLOPS_PER_BYTE", 10 ** 6 if union else 0)
        # per sequence: one call each, or all in one
        monkeypatch.setattr(pa, "KV_CHUNK_BYTES", 10 ** 9 if union else 1)
        batch = build_batch(store, seqs)
        out, _ = paged_attention_forward(
            SimpleNamespace(layer_idx=0),
            query,
            key,
            value,
            None,
            scaling=D**-0.5,
            kvlab_batch=batch,
            sliding_window=window,
        )
        assert [g.union for g in batch.groups] == [
            union and len(g.tables) > 1 for g in batch.groups
        ]
        # a padded group
        assert any(not g.query_valid.all() and g.union == union for g in batch.groups)
        for (cached, new), (q, k, v), got in zip(spans, full, out[0].split([n for _, n in spans])):
            want = _reference(q, k, v, range(cached, cached + new), window)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_spans_and_missing_metadata():
    store = PagedKVStore(1, 4, BS, KVH, D)
    with pytest.raises(ValueError, match="bad span"):
        build_batch(store, [(0, 9, [0, 1])])  # 9 tokens do not fit 2 blocks of 4
    with pytest.raises(ValueError, match="bad span"):
        build_batch(store, [(3, 3, [0])])
    q = torch.zeros(1, H, 1, D)
    kv = torch.zeros(1, KVH, 1, D)
    with pytest.raises(RuntimeError, match="kvlab_batch"):
        paged_attention_forward(SimpleNamespace(layer_idx=0), q, kv, kv, None)


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(cfg).eval()


@torch.no_grad()
def test_hf_model_runs_on_paged_cache_in_two_chunks():
    """A prompt prefilled in two chunks (the second on top of the paged K/V of the first) gives HF's
    logits."""
    model = _tiny_qwen2()
    ids = torch.randint(0, 128, (1, 23))
    want = model(input_ids=ids).logits[0]  # (23, vocab), the model's own attention
    store = PagedKVStore.for_model(model, num_blocks=8, block_size=BS)
    table = [6, 2, 7, 0, 3, 5]
    got = []
    own, name = register(model)
    model.set_attn_implementation(name)  # transformers' public switch
    assert model.config._attn_implementation == name == f"kvlab_paged_{own}"
    for start, end in [(0, 10), (10, 23)]:
        batch = build_batch(store, [(start, end, table)])
        with paged_step():
            out = model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end)[None],
                        use_cache=False, kvlab_batch=batch)
        got.append(out.logits[0])
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-5)
    # outside paged_step(): the model's own attention
    assert torch.equal(model(input_ids=ids).logits[0], want)
    # a batch outside a step would never be written
    with pytest.raises(RuntimeError, match="paged_step"):
        model(
            input_ids=ids[:, :3],
            position_ids=torch.arange(3)[None],
            kvlab_batch=build_batch(store, [(0, 3, table)]),
        )
    model.set_attn_implementation(own)
    assert model.config._attn_implementation == own
    assert torch.equal(model(input_ids=ids).logits[0], want)


@torch.no_grad()
def test_hf_model_decodes_after_a_shared_prefix_through_the_union_path():
    """Four sequences on one cached prefix: suffix prefills, then a decode step on the union path,
    give HF's logits."""
    model = _tiny_qwen2()
    prefix, n = torch.randint(0, 128, (8,)), 4
    # 8 shared + 3 suffix + 1 decode
    seqs = [torch.cat([prefix, torch.randint(0, 128, (4,))]) for _ in range(n)]
    store = PagedKVStore.for_model(model, num_blocks=16, block_size=BS)
    tables = [[0, 1, 2 + i] for i in range(n)]  # blocks 0 and 1 hold the prefix for everyone
    own, name = register(model)
    model.set_attn_implementation(name)

    def run(spans):
        batch = build_batch(store, [(a, b, tables[i]) for i, (a, b) in spans])
        ids = torch.cat([seqs[i][a:b] for i, (a, b) in spans])[None]
        pos = torch.cat([torch.arange(a, b) for _, (a, b) in spans])[None]
        with paged_step():
            out = model(input_ids=ids, position_ids=pos, use_cache=False, kvlab_batch=batch).logits[
                0
            ]
        return batch, out

    run([(0, (0, 11))])  # the first sequence computes the prefix
    run([(i, (8, 11)) for i in range(1, n)])  # the others only their suffixes
    batch, out = run([(i, (11, 12)) for i in range(n)])
    assert batch.groups[0].union
    want = torch.stack([model(input_ids=s[None]).logits[0, -1] for s in seqs])
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_grouping_bounds_padding_and_keeps_every_sequence_once():
    from kvlab.engine.paged_attention import group_by_query_length

    lengths = [544] + [32] * 15 + [1] * 7 + [40, 33, 200]
    groups = group_by_query_length(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert longest * len(g) <= 1.5 * sum(lengths[i] for i in g) or len(g) == 1
    home = next(g for g in groups if 0 in g)
    assert not set(home) & set(range(1, 16)), "the long uncached prefill pads the short suffixes"
    assert group_by_query_length([1] * 9) == [list(range(9))]  # decodes together
    # the old behaviour
    assert group_by_query_length([544] + [32] * 15, max_padding=100.0) == [list(range(16))]


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("lengths", [[7, 5, 6], [4, 4, 4], [1]])
def test_prefills_with_nothing_cached_match_the_reference(lengths, window):
    """Groups with nothing cached (padded, dense, or one token) take the causal path: same result as
    the paged read."""
    torch.manual_seed(1)
    store = PagedKVStore(1, num_blocks=16, block_size=BS, kv_heads=KVH, head_dim=D)
    free = torch.randperm(16).tolist()
    seqs = [(0, n, [free.pop() for _ in range(-(-n // BS))]) for n in lengths]
    qs = [torch.randn(n, H, D) for n in lengths]
    ks, vs = [torch.randn(n, KVH, D) for n in lengths], [torch.randn(n, KVH, D) for n in lengths]
    query = torch.cat(qs).transpose(0, 1)[None]  # (1, H, T, D)
    # (1, KVH, T, D)
    key, value = torch.cat(ks).transpose(0, 1)[None], torch.cat(vs).transpose(0, 1)[None]
    outs = []
    for fresh in (True, False):  # the causal path, then the paged read with its mask
        batch = build_batch(store, seqs)
        assert all(g.fresh for g in batch.groups)
        for g in batch.groups:
            g.fresh = fresh
        out, _ = paged_attention_forward(
            SimpleNamespace(layer_idx=0),
            query,
            key,
            value,
            None,
            scaling=D**-0.5,
            kvlab_batch=batch,
            sliding_window=window,
        )
        outs.append(out[0])
        for g, q, k, v, n in zip(out[0].split(lengths), qs, ks, vs, lengths):
            torch.testing.assert_close(
                g, _reference(q, k, v, range(n), window), rtol=1e-5, atol=1e-5
            )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def _one_token_call(module=None, **kwargs):
    """One decode token through ``paged_attention_forward`` with extra attention keywords."""
    torch.manual_seed(2)
    store = PagedKVStore(1, num_blocks=2, block_size=BS, kv_heads=KVH, head_dim=D)
    batch = build_batch(store, [(0, 1, [0])])
    q, kv = torch.randn(1, H, 1, D), torch.randn(1, KVH, 1, D)
    kwargs.setdefault("attention_mask", None)
    return paged_attention_forward(
        module or SimpleNamespace(layer_idx=0),
        q,
        kv,
        kv,
        scaling=D**-0.5,
        kvlab_batch=batch,
        **kwargs,
    )[0]


@pytest.mark.parametrize(
    "kwargs, feature",
    [
        ({"s_aux": torch.zeros(H)}, "sink"),  # gpt_oss
        ({"softcap": 50.0}, "soft-capping"),  # gemma2
        ({"position_bias": torch.zeros(1, H, 1, 1)}, "position bias"),
        ({"attention_mask": torch.zeros(1, 1, 1, 1)}, "own attention mask"),
        ({"is_causal": False}, "non-causal"),
        ({"dropout": 0.1}, "dropout"),
        ({"output_attentions": True}, "attention weights"),
        ({"sliding_window": 0}, "sliding window"),
        (
            {"block_indices": torch.zeros(1)},
            "'block_indices'",
        ),  # any keyword it does not know, when not None
        ({"attention_chunk_size": 8}, "'attention_chunk_size'"),
    ],
)
def test_attention_keywords_outside_the_allow_list_are_refused(kwargs, feature):
    with pytest.raises(NotImplementedError, match=feature):
        _one_token_call(**kwargs)


def test_allowed_keywords_and_unknown_keywords_left_off_change_nothing():
    from kvlab.engine.admission import IMPLEMENTED_KWARGS

    want = _one_token_call()
    same = _one_token_call(
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        use_cache=False,
        output_attentions=False,
        is_causal=True,
        sliding_window=None,
        dropout=0.0,
        s_aux=None,
        softcap=None,
        anything=None,
    )
    assert torch.equal(same, want)
    import inspect

    named = set(inspect.signature(paged_attention_forward).parameters) - {
        "module",
        "query",
        "key",
        "value",
        "attention_mask",
        "kwargs",
    }
    assert named == IMPLEMENTED_KWARGS  # the documented allow-list is what the function handles


def test_non_causal_modules_and_mismatched_kv_shapes_are_refused():
    with pytest.raises(NotImplementedError, match="non-causal"):
        _one_token_call(SimpleNamespace(layer_idx=0, is_causal=False))  # bert-style encoder layers
    with pytest.raises(NotImplementedError, match="layer_idx"):
        _one_token_call(SimpleNamespace(layer_idx=None))
    store = PagedKVStore(1, num_blocks=2, block_size=BS, kv_heads=KVH, head_dim=D)
    q, k, v = torch.randn(1, H, 1, D), torch.randn(1, KVH, 1, D), torch.randn(1, KVH, 1, 2 * D)
    # multi-head latent attention: V wider than K
    with pytest.raises(NotImplementedError, match="different widths"):
        paged_attention_forward(SimpleNamespace(layer_idx=0), q, k, v, None,
                                kvlab_batch=build_batch(store, [(0, 1, [0])]))


@pytest.mark.parametrize(
    "config, windows, feature",
    [
        (
            {"layer_types": ["full_attention", "chunked_attention"]},
            {0: None, 1: None},
            "chunked_attention",
        ),  # llama4
        ({"layer_types": ["linear_attention", "full_attention"]}, {1: None}, "linear_attention"),
        ({"attention_chunk_size": 8192}, {0: None}, "chunked attention"),
        ({"use_bidirectional_attention": True}, {0: None}, "bidirectional"),
        (
            {"sliding_window": 6},
            {0: None},
            "window",
        ),  # moshi: the window lives in the model's own mask only
        (
            {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
            {0: 6, 1: 6},
            "window",
        ),
    ],
)
def test_config_features_outside_the_allow_list_are_refused(config, windows, feature):
    from kvlab.engine.admission import check_config

    with pytest.raises(NotImplementedError, match=feature):
        check_config(SimpleNamespace(**config), windows)


def test_config_features_it_implements_pass():
    from kvlab.engine.admission import check_config

    gemma3 = SimpleNamespace(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    check_config(gemma3, {0: 6, 1: None})
    check_config(SimpleNamespace(sliding_window=6), {0: 6, 1: 6})  # mistral: every layer windowed
    # qwen2 with the window off
    check_config(SimpleNamespace(sliding_window=6, use_sliding_window=False), {0: None})
    check_config(
        SimpleNamespace(attention_chunk_size=None, use_bidirectional_attention=False), {0: None}
    )
