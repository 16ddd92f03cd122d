"""The doctor's reports: text and HTML are rendered from one JSON-able dict and tell the same
numbers."""

import json
import random
import re

import pytest

from kvlab.doctor import diagnose, write_report
from kvlab.doctor.report import render_html, render_text

NUMBER = re.compile(r"\d+(?:\.\d+)?")


def numbers_of(value, out: set[str] | None = None) -> set[str]:
    """Every way the reports may print a number of a JSON value: as is, as a percentage, rounded."""
    out = set() if out is None else out
    if isinstance(value, dict):
        for v in value.values():
            numbers_of(v, out)
    elif isinstance(value, list):
        for v in value:
            numbers_of(v, out)
    elif isinstance(value, str):
        out.update(NUMBER.findall(value))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out.update(
            {str(value), f"{abs(value):.0f}", f"{abs(value):.2f}", f"{abs(100 * value):.1f}"}
        )
    return out


def missing(text: str, data: dict, html: str) -> list[str]:
    """Numbers in the text report that are not in the JSON, or not in the HTML."""
    in_json, in_html = numbers_of(data), set(NUMBER.findall(html))
    return [n for n in NUMBER.findall(text) if n not in in_json or n not in in_html]


def token_log(n: int = 60) -> list[dict]:
    rng = random.Random(5)
    head, rest = [rng.randrange(500) for _ in range(21)], [rng.randrange(500) for _ in range(120)]
    return [{"token_ids": head + [600 + i, 700 + i % 50, 800] + rest, "user": f"u{i % 7}",
             "tenant": ["acme", "globex"][i % 2]} for i in range(n)] + ["not json"]


def test_every_number_of_the_text_report_is_in_the_json_and_the_html(tmp_path):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text('vllm:prefix_cache_queries_total 2000\nvllm:prefix_cache_hits_total 123\n')
    d = diagnose(
        token_log(),
        block_sizes=(16, 32),
        capacity_blocks=40,
        tenant_field="tenant",
        vllm_metrics=metrics,
        alone=True,
    )
    # culprits, a malformed line and the metrics: every section is there
    assert d.kept and d.bad and d.vllm
    data = json.loads(json.dumps(d.data()))
    text, html = render_text(data), render_html(data, {})
    assert len(NUMBER.findall(text)) > 60 and missing(text, data, html) == []
    assert render_text(d.data()) == d.summary() == text  # the dict survives JSON unchanged


def test_a_number_the_json_does_not_hold_is_caught():
    d = diagnose(token_log(20), block_sizes=(16,))
    data = d.data()
    text = render_text(data)
    assert missing(text, data, render_html(data, {})) == []
    assert missing(text + "\n  extra: 98765", data, render_html(data, {})) == ["98765"]
    total = data["prompt_tokens"]["total"]
    # the HTML tells another story
    other = dict(data, prompt_tokens=dict(data["prompt_tokens"], total=total + 1))
    assert missing(text, data, render_html(other, {})) == [str(total)]


@pytest.mark.parametrize("tokens", [False, True])
def test_summary_json_is_what_the_reports_are_rendered_from(tmp_path, tokens):
    log = token_log(30) if tokens else []
    d = diagnose(log, block_sizes=(16,))
    paths = write_report(d, tmp_path / "out")
    saved = json.loads(paths["summary.json"].read_text())
    assert render_text(saved) == d.summary()
    figs = {k: v for k, v in paths.items() if k in ("hit_rates", "divergence", "fixes")}
    assert render_html(saved, figs) == paths["report.html"].read_text()
