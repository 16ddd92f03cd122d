"""kvlab.doctor.sample_log: the sample log to try the doctor on plants what its ``Truth`` says, and
the doctor finds each planted culprit by diffing prompts alone (it is told only the tenant
field)."""

import json

from kvlab.doctor import diagnose
from kvlab.doctor.sample_log import make_log


def test_the_sample_log_is_json_lines_in_arrival_order_with_the_counts_it_reports():
    log, truth = make_log(support_conversations=12, coding_conversations=4, users=6, seed=3)
    assert [json.loads(json.dumps(r)) for r in log] == log
    stamps = [r["timestamp"] for r in log]
    assert stamps == sorted(stamps)
    assert truth.counts == {
        "requests": len(log),
        "support": sum(r["app"] == "support" for r in log),
        "coding": sum(r["app"] == "coding" for r in log),
        "legacy": sum("prompt" in r for r in log),
    }


def test_the_doctor_finds_every_planted_line_of_the_sample_log():
    log, truth = make_log(
        support_conversations=30,
        coding_conversations=10,
        users=12,
        doc_sentences=1,
        rules=4,
        tools=4,
        seed=0,
    )
    d = diagnose(log, None, block_sizes=(16,), tenant_field="tenant", seed=0)
    titles = {c.kind: [] for c in d.kept}
    for c in d.kept:
        titles[c.kind].append(c.title)
    fields = " | ".join(titles.get("volatile", []) + titles.get("per-user", []))
    for line in (truth.timestamp_line, truth.customer_line, truth.request_id_line):
        assert line.strip() in fields, (line, fields)
    assert any(truth.customer_line.strip() in t for t in titles["per-user"])
    assert {"order", "tools-order", "multi-turn", "tenant-salt"} <= set(titles), sorted(titles)
    assert d.chain[-1]["unbounded_hit_rate"] > d.chain[0]["unbounded_hit_rate"] + 0.2
