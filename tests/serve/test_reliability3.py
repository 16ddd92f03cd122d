"""Reliability III (issue 53): streams equal their text, every input bounded, no request stalls another."""

import random

from kvlab.serve.text import TextStream


# --- N3: the streamed text equals the non-streamed text, for every stop string -------------------------------
class ByteTokenizer:
    """A byte-level tokenizer stand-in: each id is a run of UTF-8 bytes; ``decode`` replaces what is incomplete."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


ALPHABET = "ab #\n实中文🙂é😀"  # 1-, 2-, 3- and 4-byte characters


def _case(rng: random.Random) -> tuple[ByteTokenizer, list[int], list[str], list[int]]:
    """Random text cut into byte tokens anywhere (inside characters too), random stops, random push sizes."""
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))
    data = text.encode("utf-8")
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, len(data)))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    stops = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.7:  # a piece of the text (it may match), else random characters (it may not)
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        else:
            stops.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))))
    sizes, left = [], len(pieces)
    while left:
        sizes.append(min(left, rng.randint(1, 3)))
        left -= sizes[-1]
    return ByteTokenizer(pieces), list(range(len(pieces))), stops, sizes


def test_streamed_text_equals_the_text_for_random_stops_and_multibyte_text():
    """>= 500 random cases: the pieces a stream sends join to exactly the answer's text (and that text is the
    full decode, cut where a stop string begins)."""
    rng = random.Random(53)
    differences = []
    for n in range(800):
        tok, ids, stops, sizes = _case(rng)
        ts, sent, at = TextStream(tok, stops), [], 0
        for k, size in enumerate(sizes):
            sent.append(ts.push(ids[at:at + size], final=k == len(sizes) - 1))
            at += size
        full, text = tok.decode(ids), ts.text
        # the answer is the full decode, cut where a stop string begins once one appeared (the first to be complete)
        ok = full.startswith(text) and (any(full.startswith(s, len(text)) for s in stops) if ts.stopped
                                        else text == full and not any(s in full for s in stops))
        if "".join(sent) != text or not ok:
            differences.append((n, full, stops, "".join(sent), ts.text))
    assert differences == []


def test_the_smollm2_case_a_stop_string_completed_by_a_multibyte_character():
    """'\\n\\n## ' then the first bytes of 实: the '# ' before U+FFFD may start the stop '# 实' (was sent early)."""
    data = "\n\n## 实".encode()
    pieces = [b"\n\n", b"##", b" ", data[-3:-1], data[-1:]]
    tok = ByteTokenizer(pieces)
    ts = TextStream(tok, ["# 实"])
    sent = "".join(ts.push([i]) for i in range(len(pieces)))
    assert ts.text == "\n\n#"
    assert sent == "\n\n#"
