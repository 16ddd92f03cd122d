"""Fields (kvlab.doctor.culprits.fields): a line whose value changes is named, scoped and labelled;
the fix moves it."""

from kvlab.doctor.culprits.fields import (
    FieldPattern,
    common_suffix,
    field_culprits,
    label_values,
    move_fields,
    token_span_culprits,
)
from kvlab.doctor.culprits.textdiff import Finding, scan_pairs
from kvlab.doctor.logio import Record

RULES = "Rules: be kind, be brief, never invent a policy, and always cite the documents you used."
USERS = ["Alice Zhang", "Bruno Silva", "Chen Okafor"]


def support_log(n: int = 9, same_time: bool = False) -> list[dict]:
    """Per request a time line, per user a customer line, then the shared rules."""
    rows = []
    for i in range(n):
        ts = "2024-05-01 10:00" if same_time else f"2024-05-{1 + i:02d} {10 + i}:{(7 * i) % 60:02d}"
        user = USERS[i % 3]
        rows.append(
            {
                "messages": [
                    {
                        "role": "system",
                        "content": f"You help.\nCurrent time: {ts}\nCustomer: {user}\n{RULES}",
                    },
                    {"role": "user", "content": f"Question {i} about my order?"},
                ],
                "user": user,
            }
        )
    return rows


def slot(a: int, key: str, pos: int) -> Finding:
    return Finding(
        "slot", a, a - 1, pos, role="system", index=0, key=key, anchor="prefix", level="line"
    )


def test_labels_and_common_suffix():
    assert label_values(["2024-05-01 10:00", "2024-06-11 09:30"]) == "timestamp/date"
    assert (
        label_values(
            ["3f2b8a9c-1d2e-4f5a-8b9c-0d1e2f3a4b5c", "9a8b7c6d-5e4f-4a3b-8c1d-0e9f8a7b6c5d"]
        )
        == "UUID"
    )
    assert label_values(["17", "18", "19"]) == "number/counter"
    assert label_values(["req_a81x9", "req_b77q2"]) == "id"
    assert label_values(["Alice", "Bruno"]) == "text"
    assert common_suffix(["10:00 UTC", "11:30 UTC"]) == " UTC" and common_suffix(["a1", "b2"]) == ""


def test_field_pattern_finds_the_line_by_its_key_or_the_line_before():
    content = "You help.\nCurrent time: 10:00 UTC\nRules."
    pat = FieldPattern("system", 0, "Current time: ", "prefix", "line", " UTC")
    assert pat.value(content) == "10:00" and pat.matches("system", 0) and not pat.matches("user", 0)
    after = FieldPattern("system", 0, "You help.", "after", "line", "")
    assert after.value(content) == "Current time: 10:00 UTC"
    assert pat.value("no such line") is None


def test_move_fields_puts_the_line_at_the_start_of_the_last_user_message():
    rec = Record(1, "messages", messages=support_log(1)[0]["messages"])
    (moved,) = move_fields(
        [rec], [FieldPattern("system", 0, "Current time: ", "prefix", "line", "")]
    )
    assert (
        "Current time" not in moved.messages[0]["content"]
        and "Customer: Alice" in moved.messages[0]["content"]
    )
    assert (
        moved.messages[1]["content"]
        == "Current time: 2024-05-01 10:00\n\nQuestion 0 about my order?"
    )
    other = Record(2, "messages", messages=[{"role": "user", "content": "hi"}])
    assert (
        move_fields([other], [FieldPattern("system", 0, "Current time: ", "prefix", "line", "")])[0]
        is other
    )


def test_a_timestamp_is_per_request_and_a_name_per_user_at_their_positions(chat_log):
    prep, _, _ = chat_log(support_log())
    findings = [slot(a, "Current time: ", 40 + a % 2) for a in range(1, 9)] + [
        slot(a, "Customer: ", 70) for a in (3, 4)
    ]
    culprits = {c.kind: c for c in field_culprits(prep, findings)}
    ts, name = culprits["volatile"], culprits["per-user"]
    assert (
        "timestamp/date" in ts.title
        and "Current time:" in ts.title
        and ts.position == 40
        and ts.affected == 9
    )
    assert "user name/id" in name.title and name.position == 70
    fixed = ts.fix(prep.records)
    assert all(r.messages[1]["content"].startswith("Current time: ") for r in fixed)


def test_near_misses_are_not_named(chat_log):
    prep, _, _ = chat_log(support_log(same_time=True))
    # every request the same time: no field
    one_value = [slot(a, "Current time: ", 40) for a in range(1, 9)]
    assert field_culprits(prep, one_value) == []
    prep, _, _ = chat_log(support_log())
    assert field_culprits(prep, [slot(1, "Current time: ", 40)]) == []  # one pair is not a pattern
    tenants = [u[0] for u in (USERS * 3)[:9]]  # one customer a tenant: the tenant's own content
    assert [
        c.kind
        for c in field_culprits(prep, [slot(a, "Customer: ", 70) for a in (3, 4)], tenants=tenants)
    ] == []


def test_a_token_span_is_named_and_moved_to_the_end(chat_log):
    head, rest = list(range(100, 120)), list(range(200, 240))
    prep, div, _ = chat_log(
        [{"token_ids": head + [600 + i, 700] + rest, "user": f"u{i}"} for i in range(4)]
    )
    (c,) = token_span_culprits(prep, scan_pairs(prep, div, None)[0])
    assert c.kind == "volatile" and c.position == 20 and c.affected == 4
    fixed = c.fix(prep.records)
    assert [r.token_ids for r in fixed] == [head + [700] + rest + [600 + i] for i in range(4)]
    # one pair: not named
    assert token_span_culprits(prep, scan_pairs(prep, div, None)[0][:1]) == []
