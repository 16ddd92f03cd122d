"""kvlab.lessons fig_* diagrams: each draws the object it is given, not a fixed picture (issue 27,
part 3)."""

from __future__ import annotations

import math

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvlab.cache.block_manager import BlockManager, TenantScope  # noqa: E402


def _gid(fig, prefix: str) -> list:
    return [
        a for a in fig.findobj() if (getattr(a, "get_gid", lambda: None)() or "").startswith(prefix)
    ]


def _done(fig) -> None:
    fig.canvas.draw()  # draws without error (CJK font, layout)
    plt.close(fig)


@pytest.fixture(scope="module")
def prefix(bundled):
    from kvlab.prefix import PrefixKV

    return PrefixKV.build(*bundled, "You are a helpful assistant. The passphrase is")


@pytest.mark.parametrize(
    "suffixes", [([1, 2, 3], [4, 5, 6, 7, 8], [9]), ([1], [2]), ([1, 2, 3, 4, 5], [6], [7], [8])]
)
def test_shared_prefix_shades_exactly_the_blocks_the_requests_share(suffixes):
    from kvlab.lessons import nb00_passphrase as N

    bm = BlockManager(24, 4)
    # a prefix of as many full blocks as requests
    common = list(range(100, 100 + 4 * len(suffixes)))
    for i, q in enumerate(suffixes):
        bm.allocate(f"req{i}", common + list(q))
    fig = N.fig_shared_prefix(bm)
    shared = [b for b in range(24) if bm.pool.blocks[b].ref_count > 1]
    assert N.shared_blocks(bm, list(bm.seqs)) == shared == list(range(len(suffixes)))
    assert len(_gid(fig, "shared")) == len(shared)
    assert len(_gid(fig, "own")) == sum(len(bm.block_table(s)) for s in bm.seqs) - len(
        shared
    ) * len(suffixes)
    _done(fig)


def test_kv_cache_figure_draws_every_layer_and_kv_head_of_the_real_cache(bundled, prefix):
    from kvlab.lessons import nb01_attention as N

    fig = N.fig_kv_cache(prefix)
    kv = N.cache_tensors(prefix)
    images = [im for ax in fig.axes for im in ax.get_images()]
    heads, seq, dim = kv[0][0].shape
    assert len(images) == len(kv) * heads * 2 == bundled[0].config.num_hidden_layers * 2 * heads
    assert images[heads].get_array().shape == (len(prefix), dim)
    # layer 0, V of head 0 (after the K panels)
    assert (images[heads].get_array() == kv[0][1][0].numpy()).all()
    _done(fig)


def test_position_ids_figure_continues_after_the_prefix_or_restarts(bundled, prefix):
    from kvlab.engine.models import encode
    from kvlab.lessons import nb02_prefix as N

    suffix = encode(bundled[1], " What is it?")
    fig = N.fig_position_ids(prefix, suffix, bundled[1])
    p = prefix.seq_length()
    for row, want in ((0, list(range(p, p + len(suffix)))), (1, list(range(len(suffix))))):
        drawn = [int(t.get_text()) for t in _gid(fig, f"suffix{row}") if hasattr(t, "get_text")]
        assert drawn == want
    _done(fig)
    zh = N.PrefixKV.build(
        *bundled, "你是一个专业的翻译助手，"
    )  # CJK split across byte-level tokens
    fig = N.fig_position_ids(zh, encode(bundled[1], "今天天气很好。"), bundled[1])
    words = [t.get_text() for t in fig.axes[0].texts if not t.get_text().isdigit()]
    assert "".join(words).replace("…", "").count("翻") >= 1 and not any(
        w.startswith("<") and " " in w for w in words
    )
    _done(fig)


@pytest.mark.parametrize("shift", [1, 16, 300])
def test_rope_rotation_turns_each_pair_by_shift_times_its_frequency(prefix, shift):
    from kvlab.built import nb03
    from kvlab.lessons import nb03_position as N

    key = prefix.cache.layers[0].keys[0, 0, 3]
    fig = N.fig_rope_rotation(key, 3, shift)
    inv = nb03.inverse_frequencies(key.numel())
    before, after = _gid(fig, "before"), _gid(fig, "after")
    assert len(before) == len(after) == 3
    for (b, a), i in zip(zip(before, after), (0, key.numel() // 4, key.numel() // 2 - 1)):
        (bx,), (by,) = b.get_data()
        (ax_,), (ay,) = a.get_data()
        assert (bx, by) == pytest.approx((float(key[i]), float(key[i + key.numel() // 2])))
        # signed angle from before to after
        turned = math.atan2(bx * ay - by * ax_, bx * ax_ + by * ay)
        want = math.remainder(shift * float(inv[i]), 2 * math.pi)
        assert turned == pytest.approx(want, abs=1e-3)
        assert math.hypot(ax_, ay) == pytest.approx(math.hypot(bx, by), rel=1e-4)
    _done(fig)


def _three(salt_c: str | None) -> BlockManager:
    bm = BlockManager(12, 4)
    p = list(range(100, 110))
    bm.allocate("A", p + [1, 2])
    bm.allocate("B", p + [3])
    bm.allocate("C", p + [1, 2], TenantScope(cache_salt=salt_c))
    return bm


@pytest.mark.parametrize("salt", [None, "tenant-c"])
def test_logical_physical_draws_one_line_per_table_entry_to_its_block(salt):
    from kvlab.lessons import nb04_blocks as N

    bm = _three(salt)
    fig = N.fig_logical_physical(bm)
    lines = {g.get_gid() for g in _gid(fig, "map ")}
    assert lines == {
        f"map {s} {j} {pid}" for s in bm.seqs for j, pid in enumerate(bm.block_table(s))
    }
    _done(fig)


@pytest.mark.parametrize("salt", [None, "tenant-c"])
def test_hash_chain_prints_each_blocks_hash_and_shades_the_salted_block(salt):
    from kvlab.lessons import nb04_blocks as N

    bm = _three(salt)
    fig = N.fig_hash_chain(bm)
    texts = {t.get_gid(): t.get_text() for t in _gid(fig, "hash ")}
    for s, seq in bm.seqs.items():
        for j, h in enumerate(seq.block_hashes):
            assert texts[f"hash {s} {j}"] == f"#{h[:3].hex()}"
    assert len(_gid(fig, "salted")) == (0 if salt is None else 1)
    # the salt changes block 0's hash
    assert (texts["hash C 0"] == texts["hash A 0"]) == (salt is None)
    _done(fig)


def test_request_path_draws_the_engines_slot_mapping_and_cached_tokens(bundled):
    from kvlab.engine import Engine, SamplingParams
    from kvlab.lessons import nb05_table36 as N

    engine = Engine(*bundled, num_blocks=32, block_size=8)
    sp = SamplingParams(max_tokens=4)
    engine.add_request(
        "You are a helpful assistant. The passphrase is swordfish. Q: what?", sp, request_id="a"
    )
    engine.step()
    engine.add_request(
        "You are a helpful assistant. The passphrase is swordfish. Q: again?", sp, request_id="b"
    )
    engine.step()
    seq_id, bm = engine.requests["b"].seq_id, engine.block_manager  # as notebook 05 reads it
    path = {
        "block_size": 8,
        "num_tokens": len(bm.seqs[seq_id].token_ids),
        "block_table": bm.block_table(seq_id),
        "slot_mapping": bm.slot_mapping(seq_id),
        "cached_tokens": bm.num_cached_tokens(seq_id),
    }
    assert path["cached_tokens"] > 0
    fig = N.fig_request_path(path)
    assert [int(t.get_text()) for t in _gid(fig, "slot")] == path["slot_mapping"]
    assert len(_gid(fig, "cached")) == path["cached_tokens"]
    assert len(_gid(fig, "block")) == len(path["block_table"])
    _done(fig)
    window = N.fig_request_path(path, max_tokens=16)  # a window around where the cached part ends
    shown = [int(t.get_text()) for t in _gid(window, "position")]
    assert len(shown) == 16 and shown[0] <= path["cached_tokens"] <= shown[-1]
    assert [int(t.get_text()) for t in _gid(window, "slot")] == [
        path["slot_mapping"][p] for p in shown
    ]
    assert len(_gid(window, "cached")) == sum(p < path["cached_tokens"] for p in shown)
    _done(window)
