"""Exercise checkers of every lesson: one return type (Verdict), blank answers get a hint, no
checker leaks the expected value in a "not yet"; and the decision table keyed by row name."""

import pandas as pd
import pytest

from kvlab.lessons import nb00_passphrase as E
from kvlab.lessons import nb01_attention as A
from kvlab.lessons import nb02_prefix as R
from kvlab.lessons import nb03_position as X
from kvlab.lessons import nb04_blocks as L
from kvlab.lessons import nb05_table36 as T
from kvlab.lessons import nb06_vllm as V
from kvlab.lessons import nb07_security as S
from kvlab.lessons.common import (
    DECISION_ROWS,
    ROW_NAMES,
    Verdict,
    call_answer,
    decision_table,
    unanswered,
    verdict,
)


def test_verdict_is_truthy_when_correct_and_shows_its_message():
    good, bad = verdict(True, "42 tokens"), verdict(False, hint="count whole blocks")
    assert good and not bad
    assert str(good) == repr(good) == "correct: 42 tokens"
    assert str(bad) == repr(bad) == "not yet: count whole blocks"
    assert f"1. {bad}" == "1. not yet: count whole blocks"
    assert str(unanswered("a hint")).startswith("not yet: no answer yet") and "a hint" in str(
        unanswered("a hint")
    )


def test_call_answer_reports_blank_and_failing_functions():
    def todo(x):
        raise NotImplementedError

    assert call_answer(lambda x: x + 1, 1, hint="h") == (2, None)
    for fn in (None, todo):
        value, failed = call_answer(fn, 1, hint="h")
        assert (
            value is None
            and isinstance(failed, Verdict)
            and str(failed).startswith("not yet: no answer")
        )
    _, failed = call_answer(lambda x: 1 / 0, 1, hint="h", name="f")
    assert str(failed) == "not yet: f raised ZeroDivisionError: division by zero"


def _layer_errors() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"treatment": X.REROTATED, "tensor": "K", "layer": layer, "relative error": e}
            for layer, e in ((0, 1e-7), (1, 0.3), (2, 0.5))
        ]
    )


# (checker called with a blank answer, with a wrong answer, texts of the expected answer that must
# not show)
BLANK_AND_WRONG = {
    "00.1": (
        lambda: E.check_ideal_fraction(None, 300, 256),
        lambda: E.check_ideal_fraction(0.5, 300, 256),
        ["0.1467", "44"],
    ),
    "00.2": (
        lambda: E.check_reusable(None, [1, 2], [1, 2, 3]),
        lambda: E.check_reusable(False, [1, 2], [1, 2, 3]),
        ["True", " do start", "do start"],
    ),
    "01.1": (lambda: A.check_gqa_attention(None), None, []),
    "01.2": (
        lambda: A.check_kv_bytes("Qwen2.5-7B-Instruct", "bfloat16", None),
        lambda: A.check_kv_bytes("Qwen2.5-7B-Instruct", "bfloat16", 2 * 28 * 28 * 128 * 2),
        ["57,344", "57344", "factor"],
    ),
    "02.2": (lambda: R.check_boundary_case(None, None, None), None, []),
    "03.1": (
        lambda: X.check_suffix_positions(None, 37, 5),
        lambda: X.check_suffix_positions([0, 1, 2, 3, 4], 37, 5),
        ["37", "41"],
    ),
    "03.2": (
        lambda: X.check_rerotation_delta(None, 12, 9),
        lambda: X.check_rerotation_delta(3, 12, 9),
        ["-3"],
    ),
    "03.3": (lambda: X.check_positions_from_mask(None), None, []),
    "03.4": (
        lambda: X.check_exact_layers(None, _layer_errors()),
        lambda: X.check_exact_layers([0, 1], _layer_errors()),
        ["[0]"],
    ),
    "04.1": (
        lambda: L.check_cached_tokens(None),
        lambda: L.check_cached_tokens(lambda n, bs: n),
        [],
    ),
    "04.2": (lambda: L.check_find_leaks(None), None, []),
    "04.3": (lambda: L.check_timestamp_prompt(None), None, []),
    "05.1": (
        lambda: T.check_bug_for_group(None),
        lambda: T.check_bug_for_group(
            {1: "same-start", 2: "identical-prefix", 3: "full-isolation"}
        ),
        ["positions-agree", "overlap-different-start", "independent-context"],
    ),
    "05.2": (
        lambda: T.check_kv_ratio(None, 16, 512, 63),
        lambda: T.check_kv_ratio(0.5, 16, 512, 63),
        ["0.53"],
    ),
    "05.3": (lambda: T.check_position_fix(None, None, None, None), None, []),
    "06.1": (
        lambda: V.check_cached_tokens(None, 250, 200),
        lambda: V.check_cached_tokens(200, 250, 200),
        ["192"],
    ),
    "06.2": (
        lambda: V.check_ttft_ideal(None, 160, 128),
        lambda: V.check_ttft_ideal(0.5, 160, 128),
        ["0.2"],
    ),
    "06.3": (
        lambda: V.check_batch_counts(None, None, None, [], {}),
        None,
        [],
    ),  # blank: runs nothing
    "07.1": (
        lambda: S.check_salt_split(None, None, 40, 16),
        lambda: S.check_salt_split(3, 40, 40, 16),
        ["32", "block 2"],
    ),
    "07.2": (
        lambda: S.check_prefill_tokens(None, None, 8, 120, 10, 16),
        lambda: S.check_prefill_tokens(1040, 130, 8, 120, 10, 16),
        ["1040", "1,040", "256"],
    ),
    "07.3": (lambda: S.check_auc_fn(None), lambda: S.check_auc_fn(lambda p, n: 0.5), []),
}


@pytest.mark.parametrize("exercise", sorted(BLANK_AND_WRONG))
def test_blank_answers_get_a_hint_and_wrong_answers_never_see_the_answer(exercise):
    blank, wrong, secrets = BLANK_AND_WRONG[exercise]
    v = blank()
    assert (
        isinstance(v, Verdict) and not v and str(v).startswith("not yet: no answer yet. Hint: ")
    ), v
    if wrong is not None:
        v = wrong()
        assert isinstance(v, Verdict) and not v and str(v).startswith("not yet: "), v
        leaked = [s for s in secrets if s in str(v)]
        assert not leaked, f"{exercise}'s 'not yet' shows the answer ({leaked}): {v}"


def test_right_answers_are_correct():
    assert E.check_ideal_fraction(44 / 300, 300, 256) and E.check_reusable(True, [1, 2], [1, 2, 3])
    assert A.check_kv_bytes("Qwen2.5-7B-Instruct", "bfloat16", 2 * 28 * 4 * 128 * 2)
    assert X.check_suffix_positions(list(range(37, 42)), 37, 5) and X.check_rerotation_delta(
        -3, 12, 9
    )
    assert X.check_exact_layers([0], _layer_errors())
    assert V.check_cached_tokens(192, 250, 200) and V.check_ttft_ideal(0.2, 160, 128)
    assert S.check_salt_split(2, 32, 40, 16)
    assert str(T.check_kv_ratio(0.5, 16, 512, 63)).startswith("not yet: not 0.5000")


def test_decision_rows_are_named_and_keep_the_article_text():
    assert len(DECISION_ROWS) == 8 and len(set(ROW_NAMES)) == 8
    assert ROW_NAMES[0] == "identical-prefix" and DECISION_ROWS[0].zh == "前缀token序列完全一致"
    assert [r.share for r in DECISION_ROWS] == ["yes"] * 5 + ["no"] * 3
    table = decision_table({"same-start": "measured"})
    assert list(table.index) == list(ROW_NAMES)
    assert table.loc["same-start", "evidence (measured here)"] == "measured"
    assert list(table.columns) == [
        "condition",
        "article (zh)",
        "share?",
        "isolate?",
        "evidence (measured here)",
    ]
    with pytest.raises(KeyError, match="no decision-table row named"):
        decision_table({1: "a row index is not a name"})
    assert all(set(rows) <= set(ROW_NAMES) for rows in T.BUG_ROWS.values())


def test_decision_table_verdict_column_names_the_cell_and_refuses_other_words():
    from kvlab.lessons.common import Evidence

    t = decision_table(
        {
            "same-start": Evidence(
                "refined", "equal distances, not equal starts: 100% of 24", "03 §4, cell 31"
            ),
            "identical-prefix": "a string row has no verdict",
        }
    )
    assert list(t.columns) == [
        "condition",
        "article (zh)",
        "share?",
        "isolate?",
        "verdict",
        "evidence (measured here)",
        "measured in",
    ]
    assert (t.loc["same-start", "verdict"], t.loc["same-start", "measured in"]) == (
        "refined",
        "03 §4, cell 31",
    )
    assert (
        t.loc["identical-prefix", "verdict"] == "" and t.loc["full-isolation", "measured in"] == ""
    )
    with pytest.raises(ValueError, match="confirmed"):
        decision_table({"same-start": Evidence("yes", "x", "07")})


def test_every_lesson_figure_is_named_fig():
    import inspect

    from kvlab.bench import peers as B

    for module in (E, A, R, X, L, T, V, S, B):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != module.__name__:
                continue
            returns = inspect.signature(fn).return_annotation
            draws = "plt.subplots" in inspect.getsource(fn) or "Figure" in str(returns)
            assert name.startswith("fig_") == draws, (
                f"{module.__name__}.{name}: figure functions are named fig_*"
            )


# ----------------------------------------------------------------------------- 07 isolation and
# security
def test_solutions_07_pass_the_checkers():
    from kvlab.lessons import solutions as SOL

    assert S.check_salt_split(*SOL.ex07_1_salt_split(), public_tokens=40, block_size=16)
    assert S.check_prefill_tokens(*SOL.ex07_2_prefill_tokens(), 8, 120, 10, 16)
    assert S.check_auc_fn(SOL.ex07_3_auc)


def test_notebook_07_exercises_start_blank():
    import json
    from pathlib import Path

    nb = json.loads(
        (
            Path(__file__).resolve().parents[2] / "notebooks" / "07_isolation_and_security.ipynb"
        ).read_text()
    )
    start = next(
        i for i, c in enumerate(nb["cells"]) if "".join(c["source"]).startswith("## Exercises")
    )
    checks = [
        "".join(c["source"])
        for c in nb["cells"][start:]
        if c["cell_type"] == "code" and "S.check_" in "".join(c["source"])
    ]
    assert len(checks) == 3 and all("= None" in c for c in checks)
    assert not any("lambda" in c or "def my_auc" in c for c in checks)


# ----------------------------------------------------------------------------- 03 and 04: worked
# solutions


def test_nb03_solutions_pass_their_checkers():
    import torch

    from kvlab.lessons import solutions as so

    assert X.check_suffix_positions(so.ex03_1_suffix_positions(37, 5), 37, 5)
    assert X.check_rerotation_delta(so.ex03_2_rerotation_delta(12, 9), 12, 9)
    assert X.check_positions_from_mask(so.ex03_3_positions_from_mask)
    assert X.check_exact_layers(so.ex03_4_exact_layers(_layer_errors()), _layer_errors())
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert torch.equal(so.ex03_3_positions_from_mask(mask), X.positions_from_mask(mask))


def test_nb04_solutions_pass_their_checkers():
    from kvlab.lessons import solutions as so

    assert L.check_cached_tokens(so.ex04_1_predict)
    assert L.check_find_leaks(so.ex04_2_find_leaks)
    assert L.check_timestamp_prompt(so.ex04_3_build)


# --- notebooks 05 and 06: the solutions pass their checkers ---------------------------------------

def test_solutions_05_06_pass_their_checkers(lm):
    from kvlab.lessons import solutions as SOL
    from kvlab.lessons import workloads as W

    model, tok = lm
    assert T.check_bug_for_group(SOL.ex05_1_bug_rows())
    assert T.check_kv_ratio(SOL.ex05_2_kv_ratio(16, 512, 63), 16, 512, 63)
    group1 = W.seed_groups(tok, n=2, block_size=16, max_tokens=4)[1]
    assert T.check_position_fix(SOL.ex05_3_position_fix(), model, tok, group1)
    assert V.check_cached_tokens(SOL.ex06_1_cached_tokens(250, 200, 32), 250, 200, 32)
    assert V.check_ttft_ideal(SOL.ex06_2_ttft_ideal(160, 128), 160, 128)
    from kvlab.vllm.bridge import run_kvlab

    prompts = group1.prompts
    ours = run_kvlab(model, tok, prompts, 32, 4, repeat=False)
    assert V.check_batch_counts(SOL.ex06_3_batch_counts(), model, tok, prompts, ours)
    assert not V.check_batch_counts(not SOL.ex06_3_batch_counts(), model, tok, prompts, ours)


# ----------------------------------------------------------------------------- 00-02: worked
# solutions pass

def test_solutions_00_to_02_pass_their_checkers():
    from kvlab.lessons import solutions as SOL

    assert E.check_ideal_fraction(SOL.solution_00_1(300, 256), 300, 256)
    assert E.check_reusable(SOL.solution_00_2([1, 2], [1, 2, 3]), [1, 2], [1, 2, 3])
    assert E.check_reusable(SOL.solution_00_2([1, 2], [1, 3, 3]), [1, 2], [1, 3, 3])
    assert A.check_gqa_attention(SOL.solution_01_1)
    assert A.check_kv_bytes(
        "Qwen2.5-7B-Instruct", "bfloat16", SOL.solution_01_2("Qwen2.5-7B-Instruct", 2)
    )


def test_solutions_02_pass_their_checkers_on_the_bundled_model():
    import kvlab
    from kvlab.lessons import solutions as SOL

    model, tok = kvlab.load_model(device="cpu")
    assert R.check_boundary_case(tok, *SOL.solution_02_2(tok))


def test_notebooks_00_to_02_start_every_exercise_blank():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "notebooks"
    for name in ("00_passphrase_experiment", "01_qkv_and_kv_cache", "02_manual_prefix_reuse"):
        cells = json.loads((root / f"{name}.ipynb").read_text())["cells"]
        checks = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "code" and "check_" in "".join(c["source"])
        ]
        assert checks, name
        for src in checks:
            for line in src.splitlines():
                if line.lstrip().startswith(("my_", "your_")) and "=" in line and "==" not in line:
                    assert line.split("=", 1)[1].split("#")[0].strip() in ("None", "None, None"), (
                        name,
                        line,
                    )


def test_notebooks_00_to_02_show_no_build_solution_outside_details():
    """A build stub is blank; the step it asks for is written nowhere else in a code cell (only in a
    <details>)."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "notebooks"
    stubs = {
        "00_passphrase_experiment": "my_suffix_prefill",
        "01_qkv_and_kv_cache": "my_decode_step",
        "02_manual_prefix_reuse": "my_continue",
    }
    for name, stub in stubs.items():
        cells = json.loads((root / f"{name}.ipynb").read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        defined = [src for src in code if re.search(rf"^def {stub}\(", src, re.M)]
        assert len(defined) == 1 and "raise NotImplementedError" in defined[0], (name, stub)
        # the step itself (suffix on the cache at the positions after it / append and attend / the
        # loop) is not written in another code cell of the notebook
        steps = [
            src
            for src in code
            if re.search(r"^def (suffix_prefill|continue_from_cache|decode_step)\(", src, re.M)
        ]
        assert not steps, (name, steps)
        md = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "markdown" and f"def {stub}(" in "".join(c["source"])
        ]
        assert all(m.lstrip().startswith("<details>") for m in md), name


def test_nb09_policy_exercise():
    from kvlab.lessons import nb09_routing as R
    from kvlab.lessons import solutions as SOL

    assert R.check_policy(SOL.ex09_1_policy)
    assert not R.check_policy(None)
    # all on one replica: imbalance 4
    assert not R.check_policy(lambda router, request: router.replicas[0])


def test_nb11_worth_pulling_exercise():
    from kvlab.lessons import nb11_tiers as T
    from kvlab.lessons import solutions as SOL

    assert T.check_worth_pulling(SOL.ex11_1_worth_pulling)
    assert not T.check_worth_pulling(None)
    # forgets the fixed cost
    assert not T.check_worth_pulling(lambda n, rec, copy, fixed: copy < rec)
    v = T.check_worth_pulling(lambda n, rec, copy, fixed: copy < rec)
    assert "fixed" in str(v) and "<" not in str(v)  # a hint, not the formula
