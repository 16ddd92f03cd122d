"""Structure (kvlab.doctor.culprits.structure): whitespace, markup, tools order, item order, rebuilt
histories."""

from kvlab.doctor.culprits.structure import (
    append_histories,
    multiturn_culprit,
    normalize_ws,
    order_culprits,
    rerender_chatml,
    sort_items,
    template_culprit,
    tools_culprit,
    whitespace_culprit,
)
from kvlab.doctor.culprits.textdiff import Finding, scan_pairs
from kvlab.doctor.logio import Record

SYSTEM = {
    "role": "system",
    "content": "You are a support bot. Be brief, be kind, never invent a policy.",
}
TOOLS = [
    {"type": "function", "function": {"name": n}} for n in ("read_file", "run_tests", "search")
]


def test_whitespace_is_named_from_its_findings_and_normalised(chat_log):
    two = {
        "role": "system",
        "content": "You are a support bot.\nBe brief, be kind, never invent a policy.",
    }
    prep, div, enc = chat_log(
        [
            {"messages": [two]},
            {"messages": [dict(two, content=two["content"].replace("\n", "  \n"))]},
            {"messages": [dict(two, content=two["content"].replace("\n", "\r\n"))]},
        ]
    )
    c = whitespace_culprit(prep, scan_pairs(prep, div, enc)[0])
    assert c.kind == "whitespace" and c.affected == 2 and c.position == prep.texts[1].index("  \n")
    assert {r.messages[0]["content"] for r in c.fix(prep.records)} == {two["content"]}
    assert normalize_ws("a  \r\n\n\n\nb\n") == "a\n\nb"
    assert whitespace_culprit(prep, []) is None


def test_template_markup_is_named_and_chatml_prompts_are_rerendered(chat_log):
    prep, _, _ = chat_log([{"messages": [SYSTEM]}] * 2)
    f = Finding("template", 1, 0, 5, text_a="<|im_start|>system", text_b="<s>[INST]")
    c = template_culprit(prep, [f, f])
    # no hand-rendered prompt to rewrite
    assert c.kind == "template" and c.position == 5 and c.fix is None
    assert template_culprit(prep, []) is None
    chatml = Record(
        1,
        "prompt",
        prompt="<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    (rec,) = rerender_chatml([chatml])
    assert rec.kind == "messages" and rec.messages == [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}]
    plain = Record(2, "prompt", prompt="Translate: hello")
    assert rerender_chatml([plain])[0] is plain


def test_tools_in_varying_order_are_named_and_sorted(chat_log):
    rows = [{"messages": [SYSTEM], "tools": t} for t in (TOOLS, TOOLS[::-1], TOOLS)]
    prep, _, _ = chat_log(rows)
    c = tools_culprit(prep, [])
    assert (
        c.kind == "tools-order"
        and c.affected == 3
        and "3 tools came in 2 different orders" in c.evidence[0]
    )
    assert all(
        [t["function"]["name"] for t in r.tools] == ["read_file", "run_tests", "search"]
        for r in c.fix(prep.records)
    )
    # one order: fine
    assert tools_culprit(chat_log([{"messages": [SYSTEM], "tools": TOOLS}] * 3)[0], []) is None


def test_documents_in_varying_order_are_named_and_sorted(chat_log):
    docs = [
        "[Doc 1] refunds take five days",
        "[Doc 2] shipping is free above 50",
        "[Doc 3] returns within 30 days",
    ]
    orders = [docs, docs[::-1], [docs[1], docs[0], docs[2]]]
    rows = [
        {
            "messages": [
                {
                    "role": "system",
                    "content": "\n\n".join(["Documents:"] + d + ["Answer from them."]),
                }
            ]
        }
        for d in orders
    ]
    prep, div, enc = chat_log(rows)
    (c,) = order_culprits(prep, scan_pairs(prep, div, enc)[0])
    assert c.kind == "order" and c.details["prefix"] == "[Doc " and c.affected == 3
    assert len({r.messages[0]["content"] for r in c.fix(prep.records)}) == 1
    assert order_culprits(prep, scan_pairs(prep, div, enc)[0][:1]) == []  # one pair: not named
    rec = Record(
        1, "messages", messages=[{"role": "system", "content": "x\n[b]\n[a]\ny\n[d]\n[c]"}]
    )
    assert (
        sort_items([rec], "system", 0, "\n", "[")[0].messages[0]["content"]
        == "x\n[a]\n[b]\ny\n[c]\n[d]"
    )


def turns(window: int | None) -> list[dict]:
    """One conversation of three turns; ``window``: keep only the last messages of the history."""
    hist, rows = [], []
    for t in range(3):
        hist.append({"role": "user", "content": f"question {t} about my order"})
        rows.append(
            {"messages": [SYSTEM] + (hist[-window:] if window else list(hist)), "session": "s1"}
        )
        hist.append({"role": "assistant", "content": f"answer {t}"})
    return rows


def test_a_sliding_window_history_is_named_and_appended(chat_log):
    prep, _, _ = chat_log(turns(window=3))
    c = multiturn_culprit(prep)
    assert c.kind == "multi-turn" and c.details == {"follow_ups": 2, "rebuilt": 1}
    assert "window: dropped the oldest 2 message(s)" in " ".join(c.evidence)
    fixed = append_histories(prep.records)
    for prev, cur in zip(fixed, fixed[1:]):
        assert cur.messages[: len(prev.messages)] == prev.messages
    assert multiturn_culprit(chat_log(turns(window=None))[0]) is None  # append-only: nothing to fix
