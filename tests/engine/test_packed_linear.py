"""EngineConfig.packed_linear: oneDNN's prepacked GEMM for the linear layers (kvlab.engine.packed_linear).

Greedy tokens under it are HF's on every test architecture (tests/engine/test_architectures.py) and on
the passphrase workload here; the model is the caller's own again when the engine is idle; a weight
changed in place is packed again; where it cannot run, the engine refuses at construction."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.packed_linear import PackedLinears, packed_linear_available

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
        return F.linear(torch.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)

    packed = PackedLinears(model)
    assert packed.weights == [model[0].weight, model[2].weight]
    with torch.no_grad():
        want = eager()
        with packed.active():
            got = model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert packed.packed(model[0].weight) is not None and packed.packed(torch.randn(96, 64)) is None
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
    engine = Engine(model, tok, num_blocks=256, block_size=16, packed_linear=True)
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
        Engine(other, tok, num_blocks=16, **{option: True})


def test_packed_linear_must_be_a_bool():
    with pytest.raises(TypeError, match="packed_linear must be a bool"):
        from kvlab.engine.config import EngineConfig

        EngineConfig(packed_linear="yes")
