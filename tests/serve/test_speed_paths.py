"""``kvlab serve`` turns each speed path on where it runs and says in one line which are on
(``speed_paths``)."""

import copy

import pytest
import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.engine.speed import SpeedPaths
from kvlab.engine.speed.packed_linear import packed_linear_available
from kvlab.serve.__main__ import build_parser, speed_paths


def test_each_speed_path_is_on_where_it_runs_and_off_with_a_reason(lm):
    model, _ = lm  # the bundled model: a float32 Qwen2 on the CPU
    speed = speed_paths(model)
    assert set(speed.on) == {"packed_linear", "paged_kernel", "fused_layers"}
    whys = dict(speed.off)
    assert speed.fused_layers is False and "LlamaForCausalLM only" in whys["fused_layers"]
    assert speed.packed_linear is (
        packed_linear_available(torch.device("cpu"), torch.float32) is None
    )
    assert all(on is (name not in whys) for name, on in speed.on.items())
    # turned off by hand: off, and said so
    speed = speed_paths(model, {"packed_linear", "fused_layers"})
    assert not speed.packed_linear and not speed.fused_layers
    assert dict(speed.off)["packed_linear"] == "turned off"
    wide = copy.deepcopy(model).to(torch.float64)
    speed = speed_paths(wide)
    assert not any(speed.on.values())
    assert all("float32" in dict(speed.off)[k] for k in ("packed_linear", "paged_kernel"))


def test_the_state_of_every_path_is_one_line():
    speed = SpeedPaths(
        packed_linear=True,
        off=(
            ("paged_kernel", "no C++ build (no C++ compiler found)"),
            ("fused_layers", "turned off"),
        ),
    )
    line = speed.describe()
    assert "\n" not in line
    assert line == (
        "speed paths: packed_linear on, paged_kernel off (no C++ build (no C++ compiler "
        "found)), fused_layers off (turned off)"
    )


def test_the_flags_turn_them_off():
    args = build_parser().parse_args(
        ["--no-packed-linear", "--no-paged-kernel", "--no-fused-layers"]
    )
    assert args.no_packed_linear and args.no_paged_kernel and args.no_fused_layers


def test_the_old_engine_flags_point_at_the_accelerator(lm):
    model, tok = lm
    with pytest.raises(
        TypeError, match=r"accelerator=kvlab\.engine\.speed\.SpeedPaths\(paged_kernel=True\)"
    ):
        Engine(model, tok, num_blocks=16, paged_kernel=True)
    with pytest.raises(TypeError, match="accelerator must have bind"):
        EngineConfig(accelerator="fast")
    with pytest.raises(ValueError, match="unknown speed path"):
        SpeedPaths.auto(model, {"turbo"})


def test_the_teaching_path_imports_no_speed_module():
    """``import kvlab.engine`` and a default engine's modules load nothing of ``kvlab.engine.speed``
    (a fresh interpreter, so the other tests' imports do not count)."""
    import subprocess
    import sys

    code = (
        "import sys, kvlab.engine, kvlab.engine.engine, kvlab.engine.runner\n"
        "import kvlab.engine.paged_attention\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvlab.engine.speed')"
        " or 'smollm2' in m or m.startswith('torch.utils.cpp_extension')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
