"""The committed model must actually do the task the series relies on (a fast, small sample)."""

from kvlab.lessons import passphrase as P
from kvlab.lessons.nb00_passphrase import evaluate


def test_recall_on_heldout_sample_and_swapped_prefix(bundled):
    model, tok = bundled
    report = evaluate(model, tok, P.make_examples(40, "heldout", start=5000))
    assert report.recall >= 0.9, report  # 0.987 on 300 prompts
    assert report.n_swapped >= 20
    assert report.swapped_recall <= 0.1, report
    assert report.swapped_answers_other >= 0.5, report  # 0.76 on 300 prompts
