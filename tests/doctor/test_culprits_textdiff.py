"""The pair diff (kvlab.doctor.culprits.textdiff): each difference is named by kind, key and token
position."""

from kvlab.doctor.culprits.textdiff import (
    common_suffix,
    realign,
    scan_pairs,
    stable_key,
    unit_bounds,
)

RULES = "Rules: be kind, be brief, never invent a policy, and always cite the documents you used."


def system(*lines: str) -> list[dict]:
    return [
        {"role": "system", "content": "\n".join(lines)},
        {"role": "user", "content": "Where is my order?"},
    ]


def test_stable_key_stops_where_the_value_starts():
    assert (
        stable_key("Current time: 2024-05-03 14:2", "Current time: 2024-05-03 14:20")
        == "Current time: "
    )
    # a name cut mid-word goes whole
    assert stable_key("Customer: Ali", "Customer: Alice") == "Customer: "
    assert common_suffix(["14:02:11 UTC", "09:15:40 UTC"], ["14:02:11 UTC"]) == " UTC"
    assert common_suffix(["Alice Zhang", "Bruno Zhang"], ["Alice Zhang"]) == " Zhang"


def test_unit_bounds_is_the_line_or_the_sentence_of_a_long_line():
    text = "first line\nCurrent time: 10:00\nlast"
    s = text.index("10")
    assert unit_bounds(text, s, s + 2) == (11, 30, "line")
    long = "A sentence. " * 30 + "The id is 42. " + "Another one. " * 10
    s, e, level = unit_bounds(long, long.index("42"), long.index("42") + 2)
    assert level == "sentence" and long[s:e] == "The id is 42."


def test_realign_finds_the_first_run_that_matches_again():
    a, b = "abcdefghXYZijklmnopq", "abcdefghWijklmnopq"
    assert realign(a, b, 8, 8) == (3, 1, 9)
    # never lines up again
    assert realign("abcdefgh" + "x" * 30, "abcdefgh" + "y" * 30, 8, 8) is None


def test_a_timestamp_line_is_a_slot_keyed_by_its_label_at_the_value(chat_log):
    prep, div, enc = chat_log(
        [
            {"messages": system("You help.", f"Current time: 2024-05-0{i + 1} 1{i}:00", RULES)}
            for i in range(2)
        ]
    )
    findings, scan = scan_pairs(prep, div, enc)
    assert scan["scanned"] == 1 and len(findings) == 1
    f = findings[0]
    assert (f.kind, f.key, f.anchor, f.role, f.index) == (
        "slot",
        "Current time: ",
        "prefix",
        "system",
        0,
    )
    assert (f.value_a, f.value_b) == ("2024-05-02 11:00", "2024-05-01 10:00")
    # one character a token: the value's first token
    assert f.token_pos == prep.texts[1].index("2024")


def test_extra_whitespace_is_a_whitespace_finding(chat_log):
    prep, div, enc = chat_log(
        [
            {"messages": system("You help.", RULES)},
            {"messages": system("You help.", RULES.replace(" be brief", "  be brief"))},
        ]
    )
    (f,) = scan_pairs(prep, div, enc)[0]
    assert f.kind == "whitespace" and f.role == "system"


def test_swapped_documents_are_an_order_finding(chat_log):
    docs = ["[Doc 1] alpha: refunds take five days", "[Doc 2] beta: shipping is free above 50"]
    prep, div, enc = chat_log(
        [
            {"messages": system("\n\n".join(["Documents:"] + d + ["Answer from them."]))}
            for d in (docs, docs[::-1])
        ]
    )
    (f,) = scan_pairs(prep, div, enc)[0]
    assert f.kind == "order" and f.sep == "\n\n" and f.items_a == docs[::-1] and f.items_b == docs


def test_near_misses_give_no_finding(chat_log):
    # the same prompt twice: nothing diverges; another question from the user: content, not a field
    same = chat_log([{"messages": system("You help.", RULES)}] * 2)
    assert scan_pairs(*same)[0] == []
    other = [
        {"messages": system("You help.", RULES)},
        {
            "messages": system("You help.", RULES)[:1]
            + [{"role": "user", "content": "Where is my refund now?"}]
        },
    ]
    assert scan_pairs(*chat_log(other))[0] == []


def test_token_ids_differ_in_a_span_between_the_same_contexts(chat_log):
    head, rest = list(range(100, 120)), list(range(200, 240))
    prep, div, _ = chat_log([{"token_ids": head + [600 + i, 700] + rest} for i in range(2)])
    (f,) = scan_pairs(prep, div, None)[0]
    assert (f.kind, f.token_pos) == ("span", 20)
    assert [ord(c) for c in f.key] == head[-8:] and [ord(c) for c in f.right] == [700] + rest[:7]
