"""The committed model must actually do the task the series relies on (a fast, small sample), its
tokenizer must rebuild the training ids, and the notebooks' size switch must judge it small."""

import sys
from pathlib import Path

import torch

from kvlab.engine.models import BUNDLED_MODEL
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import quick_note, quick_sizes


def test_recall_on_heldout_sample_and_swapped_prefix(bundled):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from evaluate_passphrase_model import evaluate

    model, tok = bundled
    report = evaluate(model, tok, P.make_examples(40, "heldout", start=5000))
    assert report.recall >= 0.9, report  # 0.987 on 300 prompts
    assert report.n_swapped >= 20
    assert report.swapped_recall <= 0.1, report
    assert report.swapped_answers_other >= 0.5, report  # 0.76 on 300 prompts


def test_tokenizer_round_trip_matches_training_ids(bundled):
    """AutoTokenizer must rebuild exactly the ids the model was trained on (tokenizer.json)."""
    from tokenizers import Tokenizer

    _, tok = bundled
    raw = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    for ex in P.make_examples(30, "heldout"):
        text = ex.prompt_text + ex.target_text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert (
        tok.convert_ids_to_tokens(tok("<|im_start|>user", add_special_tokens=False)["input_ids"])[0]
        == "<|im_start|>"
    )


def test_chat_template_renders_the_same_prompt(bundled):
    _, tok = bundled
    for ex in P.make_examples(10, "heldout"):
        assert (
            tok.apply_chat_template(ex.messages(), tokenize=False, add_generation_prompt=True)
            == ex.prompt_text
        )


def test_quick_sizes_for_large_models_on_cpu(bundled):
    model, _ = bundled
    assert not quick_sizes(model) and quick_note(model) == "full sizes"
    assert quick_sizes(model, smoke=True)
    big = torch.nn.Linear(4000, 3000)  # 12M parameters, above the threshold
    assert quick_sizes(big) and quick_note(big).startswith("12M parameters on a CPU")
    assert not quick_sizes(torch.nn.Linear(100, 100))
