"""Small hand-made inputs for the culprit heuristics: chat logs tokenized one character a token.

``chat_log`` renders records in a ChatML-like markup and makes every character a token, so a test
can say where a culprit must be named (a character index is a token position) without loading a
tokenizer.
"""

import pytest

from kvlab.doctor.divergence import divergence
from kvlab.doctor.logio import Record
from kvlab.doctor.prepare import Prepared, Segment
from kvlab.doctor.tokenization import tokstr


class CharEncoder:
    """The two things the diff needs from a PromptEncoder, one character a token."""

    def encode_with_offsets(self, texts):
        return [(tokstr(map(ord, t)), [(i, i + 1) for i in range(len(t))]) for t in texts]

    def token_id(self, text):
        return ord(text[0])


def render(rec: Record) -> tuple[str, list[Segment], int]:
    """The text of a chat record, the messages' spans in it, and where the system part ends."""
    text, segs, sys_end = "", [], 0
    for i, m in enumerate(rec.messages):
        text += f"<|{m['role']}|>\n"
        segs.append(Segment(m["role"], i, len(text), len(text) + len(m["content"])))
        text += m["content"] + "<|end|>\n"
        if i == 0 and m["role"] == "system":
            sys_end = len(text)
    return text + "<|assistant|>\n", segs, sys_end


def prepared(rows: list[dict]) -> Prepared:
    """A Prepared log of dicts ({"messages": [...], ...meta} or {"token_ids": [...], ...meta})."""
    recs, texts, toks, segs, sys = [], [], [], [], []
    for n, row in enumerate(rows, 1):
        meta = {k: v for k, v in row.items() if k not in ("messages", "token_ids", "tools")}
        if "token_ids" in row:
            recs.append(Record(n, "token_ids", token_ids=list(row["token_ids"]), meta=meta))
            (
                texts.append(None),
                toks.append(tokstr(row["token_ids"])),
                segs.append([]),
                sys.append(0),
            )
            continue
        rec = Record(
            n,
            "messages",
            messages=[dict(m) for m in row["messages"]],
            tools=row.get("tools"),
            meta=meta,
        )
        text, sg, se = render(rec)
        (
            recs.append(rec),
            texts.append(text),
            toks.append(tokstr(map(ord, text))),
            segs.append(sg),
            sys.append(se),
        )
    return Prepared(recs, texts, toks, segs, sys, [], False, list(sys))


@pytest.fixture
def chat_log():
    """(prepared log, its divergence, a one-character-a-token encoder) of a list of dicts."""
    def make(rows):
        prep = prepared(rows)
        return prep, divergence(prep.tokens), CharEncoder()
    return make
