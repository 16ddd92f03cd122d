"""``kvlab serve`` turns each speed path on where it runs and says why one is off (``speed_paths``)."""

import copy

import torch

from kvlab.engine.packed_linear import packed_linear_available
from kvlab.serve.__main__ import build_parser, speed_paths


def test_each_speed_path_is_on_where_it_runs_and_off_with_a_reason(lm):
    model, _ = lm  # the bundled model: a float32 Qwen2 on the CPU
    speed, whys = speed_paths(model)
    assert set(speed) == {"packed_linear", "paged_kernel", "fused_layers"}
    assert speed["fused_layers"] is False and "LlamaForCausalLM only" in whys["fused_layers"]
    assert speed["packed_linear"] is (packed_linear_available(torch.device("cpu"), torch.float32) is None)
    assert all(speed[k] is (k not in whys) for k in speed)
    # turned off by hand: off, with no reason to print
    speed, whys = speed_paths(model, {"packed_linear", "fused_layers"})
    assert not speed["packed_linear"] and not speed["fused_layers"] and "packed_linear" not in whys
    wide = copy.deepcopy(model).to(torch.float64)
    speed, whys = speed_paths(wide)
    assert not any(speed.values()) and all("float32" in whys[k] for k in ("packed_linear", "paged_kernel"))


def test_the_flags_turn_them_off():
    args = build_parser().parse_args(["--no-packed-linear", "--no-paged-kernel", "--no-fused-layers"])
    assert args.no_packed_linear and args.no_paged_kernel and args.no_fused_layers
