"""Every script in the README's Scripts table answers ``--help`` and passes a smoke run (small
sizes).

The table is read from README.md, so a script added there without a smoke run here fails
``test_every_readme_script_has_a_smoke_run``. A script whose smoke run needs what a test machine may
lack (vLLM's venv, a CUDA GPU, Chromium, the network) is skipped with that reason; one that another
test already runs names it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a smoke run: (arguments, a regex its output must match), or a skip reason (str). {tmp} is a fresh
# folder.
SMOKE: dict[str, tuple[list[str], str] | str] = {
    "scripts/export_notebooks.py": "tests/lessons/test_export.py runs its --check",
    "scripts/soak_notebooks.py": "runs Jupyter kernels for minutes (the notebooks' runner is "
    "smoke-tested by tests/lessons/test_notebooks.py)",
    "scripts/run_notebooks.py": "tests/lessons/test_notebooks.py runs it on every notebook",
    "scripts/train_passphrase_model.py": (
        [
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--curriculum",
            "1",
            "--batch",
            "2",
            "--hidden",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--out",
            "{tmp}/model",
        ],
        r"step +2 +validation recall",
    ),
    "scripts/evaluate_passphrase_model.py": (["--n", "2"], r"recall=\d"),
    "scripts/bench_block_manager.py": (
        ["--conversations", "20", "--num-blocks", "200", "--reps", "1", "--out", "{tmp}/bm.json"],
        r"block manager: [\d,]+ blocks/s",
    ),
    # a toy-shaped model, 2 requests of 32 + 8 tokens, 2 new, 1 repetition: every system, the
    # goals, the engine speed and the floor table at 1 and 2 threads (seconds)
    "scripts/bench.py": (
        ["--smoke", "--out", "{tmp}/bench.json"],
        r"(?s)repetition 1/1: HF generate \(one by one\)/isolated .*TTFT ratio no worse than any "
        r"peer's.*its floor \(isolated, 2 threads\).*wrote .*bench\.json",
    ),
    # the bundled model, 2 requests of 32 + 8 tokens: both profiled steps and their tables
    "scripts/profile_step.py": (
        ["--smoke", "--out", "{tmp}"],
        r"(?s)prefill step \(isolated.*decode step \(2 sequences\).*wrote .*profile_decode\.txt",
    ),
    # converted by the set-up: a run finds the folder and prints it
    "kvlab.engine.smollm2": ([], r"smollm2-135m-instruct"),
    "scripts/routing_bench.py": (
        ["--smoke", "--out", "{tmp}/routing.json"],
        r"wrote .*routing\.json",
    ),
    "scripts/stress.py": (["--requests", "6"], r"mismatches=0 cross_tenant_hits=0 leaked_blocks=0"),
    "scripts/make_vllm_env.sh": "builds vLLM's venv from the network (make vllm-env)",
    "scripts/gpu_check.sh": "needs a CUDA GPU",
    "scripts/make_cjk_font.py": (["--check"], r"\d+ wanted characters? missing"),
    "scripts/check_handout_fonts.py": "needs headless Chromium and selenium (and an executed "
    "handout)",
}


def readme_scripts() -> list[str]:
    """The scripts the README's Scripts table lists (``scripts/x.py`` or ``python -m module``), in
    order."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Scripts", 1)[1].split("\n## ", 1)[0]
    found: list[str] = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`(?:python -m )?([\w./-]+)", first):
            if name not in found:
                found.append(name)
    return found


def command(script: str, args: list[str]) -> list[str]:
    """How to run ``script`` (a path under scripts/, or a module) with ``args``."""
    if script.endswith(".sh"):
        return ["bash", str(ROOT / script), *args]
    if script.endswith(".py"):
        return [sys.executable, str(ROOT / script), *args]
    return [sys.executable, "-m", script, *args]


def run(script: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # one thread each: the tests share the machine
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        command(script, args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_every_readme_script_has_a_smoke_run():
    """The README's table and this file name the same scripts (none added there without a smoke run
    here)."""
    listed = readme_scripts()
    assert "scripts/routing_bench.py" in listed and "kvlab.engine.smollm2" in listed
    assert sorted(listed) == sorted(SMOKE), set(listed) ^ set(SMOKE)


@pytest.mark.parametrize("script", [s for s in SMOKE if not s.endswith(".sh")])
def test_script_answers_help(script):
    """``--help`` exits 0 with a usage line."""
    res = run(script, ["--help"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage" in res.stdout.lower()


def test_bench_runs_one_system(tmp_path):
    """``scripts/bench.py --systems kvlab/shared`` (no isolated run, no peer) prints the goals it
    can measure and leaves out the rest (it stopped with KeyError 'system' in the goal table)."""
    out = tmp_path / "one.json"
    args = ["--smoke", "--systems", "kvlab/shared", "--floor-threads", "--out", str(out)]
    res = run("scripts/bench.py", args, timeout=900)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert "KV bytes shared equal to the block-granular ideal" in text, text[-3000:]
    report = json.loads(out.read_text())
    assert [(r["system"], r["mode"]) for r in report["systems"]] == [("kvlab", "shared")]
    assert [g["goal"] for g in report["goals"]] == [
        "KV bytes shared equal to the block-granular ideal"
    ]
    assert report["decode_floor"] is None
    assert report["model"]["smoke"] and report["model"]["vocab_size"] == 1024


@pytest.mark.parametrize("script", list(SMOKE))
def test_script_smoke_run(script, tmp_path):
    """A small run exits 0 and prints what it measured."""
    plan = SMOKE[script]
    if isinstance(plan, str):
        pytest.skip(plan)
    args, expect = plan
    res = run(script, [a.replace("{tmp}", str(tmp_path)) for a in args], timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert re.search(expect, out), out[-3000:]
    if script == "scripts/routing_bench.py":
        rows = json.loads((tmp_path / "routing.json").read_text())["rows"]
        from kvlab.cluster import ALL_POLICIES

        # the chat and sys512 workloads x 1, 2, 4 replicas x every policy
        assert len({r["workload"] for r in rows}) == 2 and "sys512" in {r["workload"] for r in rows}
        assert len(rows) == 2 * 3 * len(ALL_POLICIES)
