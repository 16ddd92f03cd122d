"""EngineConfig.paged_kernel: the C++ paged-attention kernel (kvlab.engine.speed.paged_kernel).

Its output is the SDPA path's on random stores (GQA, windows, padded groups, shared blocks, several
query lengths, both softmax modes) to float32 rounding; greedy tokens with it on are HF's on the
passphrase workload here and on every test architecture (tests/engine/test_architectures.py); where
it cannot run, the engine refuses at construction naming why. The first test on a fresh machine pays
the kernel's one-time build (about 30 s on the project's 2-core machine)."""

import random
from types import SimpleNamespace

import pytest
import torch

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.kv_store import PagedKVStore
from kvlab.engine.paged_attention import build_batch, paged_attention_forward
from kvlab.engine.speed import SpeedPaths
from kvlab.engine.speed.paged_kernel import PagedKernel, paged_kernel_available

MAX_NEW = 10  # the length of the shared `workload` fixture's references (conftest.ENGINE_MAX_NEW)

# None, or why not (it builds the kernel on a fresh machine)
WHY_NOT = paged_kernel_available(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(
    WHY_NOT is not None, reason=f"the paged kernel cannot run here: {WHY_NOT}"
)


def _step(spans, heads, kv_heads, dim, block_size, shared_blocks=0, seed=0):
    """A random one-layer store and one step's tensors: (cached, new) tokens per sequence.

    Sequences whose cached tokens cover ``shared_blocks`` blocks hold those in the same physical
    blocks."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = 4 + shared_blocks + sum(-(-(c + n) // block_size) for c, n in spans)
    store = PagedKVStore(1, num_blocks, block_size, kv_heads, dim)
    store.k_pages.normal_()
    store.v_pages.normal_()
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous block tables
    prefix = [free.pop() for _ in range(shared_blocks)]
    seqs = []
    for cached, new in spans:
        need = -(-(cached + new) // block_size)
        table = prefix[: min(need, cached // block_size)]
        seqs.append((cached, cached + new, table + [free.pop() for _ in range(need - len(table))]))
    t = sum(n for _, n in spans)
    qkv = (
        torch.randn(1, heads, t, dim),
        torch.randn(1, kv_heads, t, dim),
        torch.randn(1, kv_heads, t, dim),
    )
    return store, seqs, qkv


def _attend(store, seqs, qkv, window, kernel=None):
    batch = build_batch(store, seqs)
    if kernel is not None:
        batch.kernel = kernel.plan(batch)
        # every group to the kernel (the engine's choice of groups is tested through the engine)
        assert len(batch.kernel.meta) == len(batch.groups)
        batch.kernel.takes = lambda g, group: True
    dim = qkv[0].shape[-1]
    out, _ = paged_attention_forward(SimpleNamespace(layer_idx=0), *qkv, None, scaling=dim**-0.5,
                                     kvlab_batch=batch, sliding_window=window)
    return out


# (heads, kv heads, head dim): GQA, MQA, MHA, D % 16; 8 query heads a KV head (the decode path takes
# them 4 at a time) and D = 128 (3 at a time)
SHAPES = [(4, 2, 8), (9, 3, 64), (4, 1, 20), (2, 2, 16), (8, 1, 32), (6, 2, 128)]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("window", [None, 3, 17])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_sdpa_path_on_random_stores(shape, block_size, window, mode):
    heads, kv_heads, dim = shape
    kernel_args = dict(max_query=10**6, mode=mode)
    # decodes, a fresh prefill, prefills after a cached prefix (padded groups), a long context
    spans = [(40, 1), (0, 7), (8, 5), (3, 1), (100, 1), (33, 3), (1, 2)]
    store, seqs, qkv = _step(spans, heads, kv_heads, dim, block_size, seed=1)
    want = _attend(store, seqs, qkv, window)
    got = _attend(store, seqs, qkv, window, PagedKernel(store, **kernel_args))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    # decodes sharing their first blocks (one physical copy)
    spans = [(40 + i, 1) for i in range(8)]
    store, seqs, qkv = _step(spans, heads, kv_heads, dim, block_size, shared_blocks=2, seed=2)
    assert len({s[2][0] for s in seqs}) == 1
    want = _attend(store, seqs, qkv, window)
    got = _attend(store, seqs, qkv, window, PagedKernel(store, **kernel_args))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mode", [0, 1])
def test_a_nan_query_gives_nan_where_the_sdpa_path_does(mode):
    # decodes (the register path in mode 0) and a short prefill; one query value NaN, one key value
    # inf (in the sequence alone in its SDPA group: where the SDPA path attends a union of blocks,
    # an inf key's NaN reaches the other sequences' rows, masked or not)
    store, seqs, qkv = _step([(40, 1), (70, 1), (8, 3)], 9, 3, 64, 16, seed=3)
    qkv[0][0, 4, 0, 7] = float("nan")
    store.k_pages[0, 1, seqs[1][2][1], 3, 0] = float("inf")
    want = _attend(store, seqs, qkv, None)
    got = _attend(store, seqs, qkv, None, PagedKernel(store, max_query=10**6, mode=mode))
    assert want.isnan().any() and torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dim", [8, 20, 16, 64, 128])
def test_decodes_take_the_register_path_where_it_is_built(dim):
    store = PagedKVStore(1, 4, 16, 1, dim)
    built = torch.backends.cpu.get_cpu_capability() == "AVX512" and dim in (16, 32, 64, 128)
    assert PagedKernel(store).decode_path is built
    assert PagedKernel(store, mode=1).decode_path is False


def test_the_kernels_kv_write_is_the_stores():
    torch.manual_seed(0)
    stores = [PagedKVStore(2, 6, 4, 3, 16) for _ in range(2)]
    slots = torch.tensor([5, 0, 23, 9, 10])
    # (kv_heads, T, D) views with strided heads and tokens, as the attention receives them
    key, value = (torch.randn(5, 3, 16).transpose(0, 1) for _ in range(2))
    stores[0].write_heads(1, slots, key, value)
    batch = build_batch(stores[1], [(0, 5, [0, 1])])
    PagedKernel(stores[1]).plan(batch).write_heads(1, slots, key, value)
    assert torch.equal(stores[0].k_pages, stores[1].k_pages) and torch.equal(
        stores[0].v_pages, stores[1].v_pages
    )
    assert stores[1].k_pages[1].view(3, -1, 16)[:, 23].eq(key[:, 2]).all()
    # a slot outside the pages is refused by name, and nothing is written
    before = stores[1].k_pages.clone()
    with pytest.raises(RuntimeError, match="slot 24 is outside the pages' 24 slots"):
        PagedKernel(stores[1]).plan(batch).write_heads(
            0, torch.tensor([1, 2, 3, 4, 24]), key, value
        )
    assert torch.equal(stores[1].k_pages, before)


def test_the_engine_gives_decodes_to_the_kernel_and_longer_queries_to_sdpa():
    store, seqs, _ = _step([(40, 1), (7, 1), (0, 30), (8, 5)], 4, 2, 8, 4)
    batch = build_batch(store, seqs)
    plan = PagedKernel(store).plan(batch)
    taken = [plan.takes(g, 2) for g in batch.groups]
    assert [g.query_index.shape[1] for g in batch.groups] == [30, 5, 1]
    assert taken == [False, False, True]
    # with the register path (D = 64 here, where it is built), every group: prefills too
    store, seqs, _ = _step([(40, 1), (7, 1), (0, 30), (8, 5)], 4, 2, 64, 4)
    batch = build_batch(store, seqs)
    kernel = PagedKernel(store)
    assert [kernel.plan(batch).takes(g, 2) for g in batch.groups] == [kernel.decode_path] * 2 + [
        True
    ]
    # decodes that share a prefix, on one thread: the SDPA path's union of blocks (measured faster
    # there) unless the kernel has its decode path (mode 1 has none)
    store, seqs, _ = _step([(40 + i, 1) for i in range(8)], 9, 3, 64, 16, shared_blocks=2)
    threads = torch.get_num_threads()
    try:
        for mode in (0, 1):
            kernel = PagedKernel(store, mode=mode)
            for n, want in ((1, kernel.decode_path), (2, True)):
                torch.set_num_threads(n)
                batch = build_batch(store, seqs)
                assert kernel.plan(batch).takes(batch.groups[0], 3) is want
                assert batch.groups[0].union is (None if want else True)
    finally:
        torch.set_num_threads(threads)


def test_kernel_engine_gives_hf_greedy_tokens_on_the_passphrase_workload(lm, workload):
    model, tok = lm
    ids, ref = workload
    for packed in (False, True):
        speed = SpeedPaths(paged_kernel=True, packed_linear=packed)
        engine = Engine(model, tok, num_blocks=256, block_size=16, accelerator=speed)
        outs = engine.generate(ids[:48], SamplingParams(max_tokens=MAX_NEW))
        mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.output_ids != r]
        assert not mismatches, (
            f"{len(mismatches)} of 48 differ from HF generate (packed_linear={packed})"
        )


# another dtype: refused like packed_linear (tests/engine/test_packed_linear.py checks both)


def test_a_failed_build_is_refused_naming_why(lm, monkeypatch):
    import kvlab.engine.speed.paged_kernel as pk

    def broken():
        raise RuntimeError("Error building extension 'kvlab_paged_kernel': no compiler")

    # the module's own loader, not the model: a machine without a compiler
    monkeypatch.setattr(pk, "load", broken)
    model, tok = lm
    with pytest.raises(ValueError, match="paged_kernel: no C\\+\\+ build .*no compiler"):
        Engine(model, tok, num_blocks=16, accelerator=SpeedPaths(paged_kernel=True))


def test_paged_kernel_must_be_a_bool():

    with pytest.raises(TypeError, match="paged_kernel must be a bool"):
        SpeedPaths(paged_kernel="yes")
