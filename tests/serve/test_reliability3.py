"""Reliability III (issue 53): streams equal their text, every input bounded, no request stalls another."""

import os
import random

import pytest

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


# --- N13, N9: kvlab serve's arguments and its key file, each refused in one line before the model loads ----------
@pytest.fixture
def serve_main(monkeypatch):
    """``python -m kvlab.serve``'s ``main`` with a model loader that records whether it was called."""
    import kvlab.engine.models
    from kvlab.serve.__main__ import main

    loads = []

    def no_load(*args, **kwargs):
        loads.append(args)
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(kvlab.engine.models, "load_model", no_load)
    monkeypatch.delenv("KVLAB_API_KEYS", raising=False)
    return main, loads


@pytest.mark.parametrize("argv, named", [
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--block-size", "0"], "--block-size"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--port", "99999"], "--port"),
    (["--port", "-1"], "--port"),
    (["--model", "/nonexistent"], "/nonexistent"),
    (["--model", "./no/such/model"], "./no/such/model"),
    (["--api-keys", "/dev/zero"], "character device"),
])
def test_bad_serve_arguments_are_one_line_before_the_model_loads(serve_main, capsys, argv, named):
    main, loads = serve_main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "\n" not in err and "Traceback" not in err, err
    assert loads == []


def test_api_keys_that_are_not_a_regular_file_or_too_big_are_refused(serve_main, capsys, tmp_path):
    main, loads = serve_main
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "keys.json"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse
    for path, words in [(tmp_path, "a folder"), (fifo, "a FIFO"), (big, "bytes")]:
        assert main(["--api-keys", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert str(path) in err and words in err and "\n" not in err, err
    assert loads == []
