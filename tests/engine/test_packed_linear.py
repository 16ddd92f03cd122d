"""EngineConfig.packed_linear: oneDNN's prepacked GEMM for the linear layers
(kvlab.engine.speed.packed_linear).

Greedy tokens under it are HF's on every test architecture (tests/engine/test_architectures.py) and
on the passphrase workload here; the model is the caller's own again when the engine is idle; a
weight changed in place is packed again; where it cannot run, the engine refuses at construction."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.speed import SpeedPaths
from kvlab.engine.speed.packed_linear import PackedLinears, packed_linear_available

MAX_NEW = 10  # the length of the shared `workload` fixture's references (conftest.ENGINE_MAX_NEW)

pytestmark = pytest.mark.skipif(
    packed_linear_available(torch.device("cpu"), torch.float32) is not None,
    reason="this torch build has no oneDNN",
)


def test_a_packed_layer_computes_its_linear_with_bias_and_repacks_a_changed_weight():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    torch.nn.init.normal_(model[0].bias)
    torch.nn.init.normal_(model[2].bias)
    x = torch.randn(5, 64)

    def eager():
        return F.linear(
            torch.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias
        )

    packed = PackedLinears(model)
    assert packed.weights == [model[0].weight, model[2].weight]
    with torch.no_grad():
        want = eager()
        with packed.active():
            got = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (
            packed.packed(model[0].weight) is not None
            and packed.packed(torch.randn(96, 64)) is None
        )
        model[2].weight.mul_(2)  # in place: the packed copy is stale and must be made again
        want = eager()
        with packed.active():
            got = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # nothing of the model was replaced
    assert not any("forward" in vars(m) for m in model.modules())


def test_packed_engine_gives_hf_greedy_tokens_on_the_passphrase_workload(lm, workload):
    model, tok = lm
    ids, ref = workload
    engine = Engine(
        model, tok, num_blocks=256, block_size=16, accelerator=SpeedPaths(packed_linear=True)
    )
    outs = engine.generate(ids[:48], SamplingParams(max_tokens=MAX_NEW))
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.output_ids != r]
    assert not mismatches, f"{len(mismatches)} of 48 differ from HF generate under packed_linear"
    # idle again: the caller's model runs its own layers
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)


@pytest.mark.parametrize("option, why", [("packed_linear", "it is wired for float32 only"),
                                         ("paged_kernel", "it is written for float32 only")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_speed_paths_are_refused_where_they_cannot_run_naming_why(lm, dtype, option, why):
    model, tok = lm
    other = copy.deepcopy(model).to(dtype)  # the shared fixture stays float32
    with pytest.raises(ValueError, match=f"{option}: {why}"):
        Engine(other, tok, num_blocks=16, accelerator=SpeedPaths(**{option: True}))


def test_packed_linear_must_be_a_bool():
    with pytest.raises(TypeError, match="packed_linear must be a bool"):

        SpeedPaths(packed_linear="yes")


def _panel_ops():
    from kvlab.engine.speed import packed_linear

    ops = packed_linear._panel_ops()
    if ops is None:
        pytest.skip("the panel GEMM does not run here (no AVX-512 build of the C++ ops)")
    return ops


@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 40])
# (1030, 576): panels of over 2 MiB, which pack_panels puts in memory of its own (huge pages)
@pytest.mark.parametrize("n, k", [(5, 1), (16, 7), (33, 64), (200, 576), (1030, 576)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_panel_gemm_computes_f_linear_for_any_rows_and_widths(rows, n, k, with_bias):
    ops = _panel_ops()
    torch.manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    bias = torch.randn(n) if with_bias else None
    got = ops.panel_gemm(x, ops.pack_panels(w), bias if with_bias else torch.empty(0), n)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_packed_gemm_sends_few_rows_to_the_panels_and_more_to_onednn():
    from kvlab.engine.speed.packed_linear import PANEL_ROWS, PackedWeight, pack, packed_gemm

    ops = _panel_ops()
    torch.manual_seed(0)
    w, bias = torch.randn(48, 32), torch.randn(48)
    packed = pack(w)
    assert packed.panels is not None and packed.out_features == 48
    # panels of 2w: a call that uses them gives twice the product
    marked = PackedWeight(packed.onednn, ops.pack_panels(2 * w), 48)
    for shape in [
        (1, 32),
        (PANEL_ROWS, 32),
        (1, PANEL_ROWS, 32),
        (PANEL_ROWS + 1, 32),
        (2, PANEL_ROWS, 32),
    ]:
        x = torch.randn(shape)
        torch.testing.assert_close(
            packed_gemm(x, packed, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4
        )
        rows = x.numel() // 32
        factor = 2 if rows <= PANEL_ROWS else 1
        torch.testing.assert_close(
            packed_gemm(x, marked, None), factor * F.linear(x, w), rtol=1e-5, atol=1e-4
        )
        assert packed_gemm(x, packed, None).shape == (*shape[:-1], 48)


def test_the_panel_gemm_keeps_a_nan_in_its_row_and_refuses_mismatched_shapes():
    ops = _panel_ops()
    w, x = torch.randn(20, 8), torch.randn(4, 8)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    got = ops.panel_gemm(x, ops.pack_panels(w), torch.empty(0), 20)
    assert got[1].isnan().all() and not got[[0, 3]].isnan().any()
    torch.testing.assert_close(got[[0, 3]], F.linear(x[[0, 3]], w))
    # inf times each weight: inf, -inf (or NaN where a weight is 0)
    assert not got[2].isfinite().any()
    with pytest.raises(RuntimeError, match="panels must be pack_panels of an"):
        ops.panel_gemm(torch.randn(2, 9), ops.pack_panels(w), torch.empty(0), 20)
    with pytest.raises(RuntimeError, match="panels must be pack_panels of an"):
        ops.panel_gemm(x, ops.pack_panels(w), torch.empty(0), 40)
    with pytest.raises(RuntimeError, match="bias must be empty or a contiguous float32"):
        ops.panel_gemm(x, ops.pack_panels(w), torch.randn(19), 20)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ops.panel_gemm(x.double(), ops.pack_panels(w), torch.empty(0), 20)


def test_large_panels_outlive_their_weight_and_free_cleanly():
    ops = _panel_ops()
    torch.manual_seed(1)
    w, x = torch.randn(1030, 576), torch.randn(16, 576)
    want = F.linear(x, w)
    panels = ops.pack_panels(w)
    assert panels.shape == (65, 576, 16) and panels.is_contiguous()
    assert panels[-1, :, 6:].eq(0).all()  # the columns past 1,030 are zero
    del w
    torch.testing.assert_close(
        ops.panel_gemm(x, panels, torch.empty(0), 1030), want, rtol=1e-5, atol=1e-4
    )
    for _ in range(3):  # packed and freed again: its own memory goes back each time
        del panels
        panels = ops.pack_panels(torch.randn(1030, 576))
    assert panels.shape == (65, 576, 16)
