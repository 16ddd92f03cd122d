"""``TextStream``: incremental detokenization gives exactly a full ``decode``'s text, at linear
cost.

On the bundled model's tokenizer and SmolLM2's (both byte-level BPE, where a Chinese character's
UTF-8 bytes are often split across tokens): random token ids, Chinese text, random push sizes and
stop strings. The stream's pieces, its text after each push and where it stops equal those of a
reference stream that decodes every id on every push (the previous implementation, kept below as the
oracle); a counting tokenizer shows the ids decoded grow linearly with the answer, not
quadratically.
"""

import importlib.util
import random

import pytest

from kvlab.serve.text import TextStream

CHINESE = (
    "我们今天去公园散步，天气很好。机器学习和深度学习是人工智能的重要分支。键值缓存让推理更快！"
    "🙂👍🏽 naïve café — «quotes» 日本語のテキスト。"
    "你是一个专业的翻译助手，请把用户的中文翻译成英文。"
)


class FullDecodeStream:
    """The oracle: decode every id on every push (what ``TextStream`` did before it was
    incremental)."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids, self.text, self.sent = [], "", 0
        self.stopped, self.num_tokens_at_stop = False, None

    def push(self, new_ids, final=False):
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.num_tokens_at_stop, text, final = (
                True,
                len(self.ids),
                text[:cut],
                True,
            )
        self.text = text
        # trailing U+FFFDs may still become characters (issue 53, N3)
        complete = text.rstrip("\ufffd")
        starts = [k for s in self.stop for k in range(1, min(len(s) - 1, len(complete)) + 1)
                  if complete.endswith(s[:k])]
        hold = len(text) - len(complete) + max(starts, default=0)
        end = len(text) if final else len(text) - hold
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


class Counting:
    """A tokenizer wrapper that counts ``decode`` calls and the ids they decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.ids = tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _smollm2_installed() -> bool:
    from kvlab.engine import smollm2

    return importlib.util.find_spec(smollm2.MODULE) is not None


@pytest.fixture(scope="module", params=["bundled", "smollm2"])
def tok(request, bundled):
    """The bundled model's tokenizer, then SmolLM2's (skipped where its package is not
    installed)."""
    if request.param == "bundled":
        return bundled[1]
    if not _smollm2_installed():
        pytest.skip("SmolLM2's package is not installed (scripts/setup.sh installs it)")
    from kvlab.engine.models import load_model

    return load_model("smollm2", device="cpu")[1]


def _run(cls, tok, ids, stop, sizes, final):
    ts, pieces, texts, i = cls(tok, stop), [], [], 0
    for k, n in enumerate(sizes):
        pieces.append(ts.push(ids[i:i + n], final=final and k == len(sizes) - 1))
        texts.append(ts.text)
        i += n
    return pieces, texts, ts.stopped, ts.num_tokens_at_stop


def _cases(tok, rng, n):
    """(ids, stop strings, push sizes, final): random ids, Chinese slices, both mixed with special
    tokens."""
    vocab, zh = len(tok), tok.encode(CHINESE)
    for trial in range(n):
        kind = trial % 4
        if kind == 0:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        elif kind == 1:
            start = rng.randrange(len(zh))
            ids = zh[start:start + rng.randint(1, 60)]
        elif kind == 2:
            ids = [
                rng.choice(zh) if rng.random() < 0.5 else rng.randrange(vocab)
                for _ in range(rng.randint(1, 80))
            ]
            ids += [tok.all_special_ids[0]] * rng.randint(0, 2)
            rng.shuffle(ids)
        else:
            ids = tok.encode("".join(rng.choice(CHINESE) for _ in range(rng.randint(1, 40))))
        full = tok.decode(ids, skip_special_tokens=True)
        stop = []
        if rng.random() < 0.6 and full:
            start = rng.randrange(len(full))
            stop.append(full[start:start + rng.randint(1, 4)])
        if rng.random() < 0.3:
            stop.append(rng.choice(["。", "的", "XY", "\ufffd", "e ", "学习"]))
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.choice([1, 1, 1, 2, 3, 7])))
            left -= sizes[-1]
        yield ids, stop, sizes, rng.random() < 0.8


def test_random_ids_and_chinese_text_decode_as_a_full_decode(tok):
    rng = random.Random(0)
    for ids, stop, sizes, final in _cases(tok, rng, 200):
        got = _run(TextStream, tok, ids, stop, sizes, final)
        assert got == _run(FullDecodeStream, tok, ids, stop, sizes, final), (ids, stop, sizes)
        if not stop and final:  # the pieces concatenate to the full decode
            assert "".join(got[0]) == got[1][-1] == tok.decode(ids, skip_special_tokens=True)


def test_chinese_split_across_tokens_waits_for_its_last_byte(tok):
    """Pushed one id at a time, no piece ever carries an incomplete character, and the pieces make
    the text."""
    ids = tok.encode(CHINESE)
    ts = TextStream(tok)
    pieces = [ts.push([i]) for i in ids] + [ts.push([], final=True)]
    assert "".join(pieces) == CHINESE and not any("\ufffd" in p for p in pieces)
    # some ids end inside a character: nothing sent for them yet
    assert sum(1 for p in pieces if not p) > 0


def test_decoding_cost_is_linear_in_the_answer(tok):
    """One id per push: a full decode each time costs about n²/2 ids; the stream's windows cost
    O(n)."""
    ids = (tok.encode(CHINESE) * 200)[:3000]
    costs = {}
    for cls in (FullDecodeStream, TextStream):
        counting = Counting(tok)
        ts = cls(counting, ["never-in-this-text"])
        text = "".join(ts.push([i]) for i in ids) + ts.push([], final=True)
        assert text == tok.decode(ids)
        costs[cls.__name__] = (counting.calls, counting.ids)
    n = len(ids)
    # the final push decodes all n once more
    assert costs["FullDecodeStream"] == (n + 1, n * (n + 1) // 2 + n)
    calls, decoded = costs["TextStream"]
    # about 4.5 ids a push here, against 1,500 on average
    assert calls <= 2 * n and decoded <= 8 * n, costs


class _CleanupTokenizer:
    """Id i is character i of the alphabet; decode then removes a space before a period (HF's
    clean-up)."""

    alphabet = "_ab .X"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids if i).replace(" .", ".")


def test_a_tokenizer_whose_window_text_disagrees_falls_back_to_full_decodes():
    """``"a "`` then ``"."``: the window's text no longer starts with the settled text; the stream
    decodes all."""
    tok = _CleanupTokenizer()
    ids = [1, 3, 4, 2, 4]  # "a .b." -> "a.b."
    for stop in ([], ["b."], ["X"]):
        for sizes in ([1, 1, 1, 1, 1], [2, 3], [5]):
            assert _run(TextStream, tok, ids, stop, sizes, True) == _run(
                FullDecodeStream, tok, ids, stop, sizes, True
            )
    ts = TextStream(tok)
    ts.push(ids[:2])
    ts.push(ids[2:], final=True)
    assert ts.text == "a.b." and not ts._incremental
