"""Notebook 00 (the passphrase experiment): first shares, the swapped-prefix mistake, recall, exercise checkers.

Notebook 00 uses these to show, on a real model, that sharing an identical prefix's K/V gives the
same tokens as recomputing it (and saves prefill work), and that serving a request with another
request's prefix K/V gives the other request's passphrase. The decision table it starts (and later
notebooks fill with more evidence) and ``time_prefill`` live in ``kvlab.lessons.common``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.cache import DEFAULT_BLOCK_SIZE
from kvlab.engine.models import encode, eos_ids
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, unanswered, verdict
from kvlab.prefix import PrefixKV, continue_from_cache, generate


@dataclass
class ShareOutcome:
    """One request answered with a recomputed prefix and with the shared prefix K/V."""

    question: str
    isolated: list[int]
    shared: list[int]
    text: str
    expected: str

    @property
    def identical(self) -> bool:
        return self.isolated == self.shared

    @property
    def recalled(self) -> bool:
        return P.recalled(self.text, self.expected)


def share_one_prefix(model: Any, tokenizer: Any, example: P.PassphraseExample, questions: Sequence[str],
                     max_new_tokens: int = 16) -> tuple[PrefixKV, list[ShareOutcome]]:
    """Compute ``example``'s prefix K/V once; answer each question with it and without it."""
    cache = PrefixKV.build(model, tokenizer, example.prefix_text)
    out = []
    for q in questions:
        ex = P.with_question(example, q)
        iso = generate(model, tokenizer, ex.prompt_text, max_new_tokens=max_new_tokens)
        sh = generate(model, tokenizer, ex.prompt_text, prefix_kv=cache, max_new_tokens=max_new_tokens)
        out.append(ShareOutcome(q, iso.token_ids, sh.token_ids, sh.text, ex.answer))
    return cache, out


def check_ideal_fraction(answer: float | None, prompt_tokens: int, cached_tokens: int) -> Verdict:
    """Exercise 00.1: the share of prefill tokens still computed when ``cached_tokens`` are reused."""
    hint = "count the prompt tokens that still go through the model (the uncached ones) and divide by all of them"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer)
    if value is None:
        return verdict(False, hint=f"give a number (a fraction between 0 and 1), not {answer!r}")
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    return verdict(abs(value - expected) < 1e-6, f"{expected:.4f} of the prompt is still prefilled", hint)


def check_reusable(answer: bool | None, prefix_ids: Sequence[int], prompt_ids: Sequence[int]) -> Verdict:
    """Exercise 00.2: may a cache of ``prefix_ids`` serve ``prompt_ids`` (same model)? Answer True or False."""
    hint = "a cache serves a prompt only if the prompt's first len(prefix_ids) ids are the prefix ids, in order"
    if answer is None:
        return unanswered(hint)
    expected = len(prefix_ids) <= len(prompt_ids) and list(prompt_ids[: len(prefix_ids)]) == list(prefix_ids)
    why = "the prompt's ids start with the prefix ids" if expected else "the prompt's ids do not start with the prefix ids"
    return verdict(bool(answer) == expected, why, hint)


@dataclass
class RecallReport:
    """Recall figures on a set of held-out examples."""

    n: int
    recall: float  # greedy answer == expected passphrase, all examples
    n_swapped: int  # examples whose answer comes from the system prompt (no passphrase update)
    swapped_recall: float  # with another request's prefix K/V: still answers its own passphrase
    swapped_answers_other: float  # with another request's prefix K/V: answers the other's passphrase
    by_history: dict[str, float]  # recall per kind of conversation history

    def line(self) -> str:
        """The one-line summary the evaluation script ends with."""
        return (f"recall={self.recall:.3f} swapped_recall={self.swapped_recall:.3f} "
                f"swapped_answers_other={self.swapped_answers_other:.3f}")


def answer_with_swapped_prefix(model: Any, tokenizer: Any, example: P.PassphraseExample,
                               donor: P.PassphraseExample, max_new_tokens: int = 16) -> str:
    """Serve ``example`` with ``donor``'s system-prompt K/V in place of its own (the mistake, run for real)."""
    donor_cache = PrefixKV.build(model, tokenizer, donor.prefix_text)
    suffix = encode(tokenizer, example.suffix_text)
    gen, *_ = continue_from_cache(model, donor_cache.cache, suffix, len(donor_cache),
                                  max_new_tokens=max_new_tokens, stop_ids=eos_ids(model, tokenizer))
    return tokenizer.decode(gen, skip_special_tokens=True)


def evaluate(model: Any, tokenizer: Any, examples: list[P.PassphraseExample], max_new_tokens: int = 16,
             progress: bool = False) -> RecallReport:
    """Greedy recall on ``examples``, and recall with the next example's prefix swapped in."""
    if len(examples) < 2:
        raise ValueError("need at least two examples (each one's prefix is swapped with the next's)")
    rng = range(len(examples))
    if progress:
        from tqdm.auto import tqdm

        rng = tqdm(rng, desc="evaluating")
    hits, by_hist, sw_own, sw_other, n_sw = 0, {}, 0, 0, 0
    for i in rng:
        ex = examples[i]
        out = generate(model, tokenizer, ex.prompt_text, max_new_tokens=max_new_tokens)
        ok = P.recalled(out.text, ex.answer)
        hits += ok
        kind = ex.extra.get("history", "none")
        by_hist.setdefault(kind, []).append(ok)
        if ex.answer != ex.passphrase:
            continue  # the answer is in the conversation, not in the system prompt
        donor = examples[(i + 1) % len(examples)]
        if donor.passphrase == ex.passphrase:
            continue
        swapped = answer_with_swapped_prefix(model, tokenizer, ex, donor, max_new_tokens)
        n_sw += 1
        sw_own += P.recalled(swapped, ex.answer)
        sw_other += P.recalled(swapped, donor.passphrase)
    n = len(examples)
    return RecallReport(n, hits / n, n_sw, sw_own / max(1, n_sw), sw_other / max(1, n_sw),
                        {k: sum(v) / len(v) for k, v in sorted(by_hist.items())})


# ----------------------------------------------------------------------------- the real chat model (SmolLM2)

def system_turn(tokenizer: Any, example: P.PassphraseExample) -> str:
    """The system turn of ``P.real_model_prompt`` alone, rendered by the chat template (the shared prefix)."""
    return tokenizer.apply_chat_template(P.real_model_messages(example)[:1], tokenize=False)


def real_share_demo(model: Any, tokenizer: Any, example: P.PassphraseExample, donor: P.PassphraseExample,
                    questions: Sequence[str], max_new_tokens: int = 24) -> list[dict[str, Any]]:
    """One system prompt, several questions: isolated, with its own prefix K/V shared, and with ``donor``'s.

    Isolated and shared use ``kvlab.prefix.generate`` (the shared run forks a ``PrefixKV`` of the
    system turn); the wrong share runs the question's tokens on top of a fork of the donor's system-turn
    K/V (``continue_from_cache``): what a cache keyed on the wrong thing would serve.
    """
    own = PrefixKV.build(model, tokenizer, system_turn(tokenizer, example))
    other = PrefixKV.build(model, tokenizer, system_turn(tokenizer, donor))
    stops = eos_ids(model, tokenizer)
    rows = []
    for q in questions:
        prompt_ids = encode(tokenizer, P.real_model_prompt(tokenizer, example, q))
        iso = generate(model, tokenizer, prompt_ids, max_new_tokens=max_new_tokens)
        sh = generate(model, tokenizer, prompt_ids, prefix_kv=own, max_new_tokens=max_new_tokens)
        suffix = prompt_ids[len(own):]
        wrong, *_ = continue_from_cache(model, other.fork().cache, suffix, len(other),
                                        max_new_tokens=max_new_tokens, stop_ids=stops)
        rows.append({"question": q, "isolated": iso.text.strip(), "shared prefix": sh.text.strip(),
                     "cached tokens": sh.num_cached_tokens, "identical tokens": iso.token_ids == sh.token_ids,
                     "another request's prefix": tokenizer.decode(wrong, skip_special_tokens=True).strip()})
    return rows


@dataclass
class RealRecall:
    """SmolLM2's recall on held-out passphrases, through kvlab's Engine (see ``real_recall``)."""

    rows: list[dict[str, Any]]  # one per request
    seconds: dict[str, float]  # wall time of each pass
    passes: tuple[str, ...] = ("isolated", "shared", "swapped")

    def summary(self) -> list[dict[str, Any]]:
        """One row per pass: requests, mean cached prompt tokens, recall of its own / the donor's passphrase."""
        n = len(self.rows)
        out = []
        for p in self.passes:
            out.append({"pass": p, "requests": n,
                        "mean cached prompt tokens": sum(r[f"{p} cached"] for r in self.rows) / n,
                        "own passphrase in the answer": sum(r[f"{p} own"] for r in self.rows) / n,
                        "donor passphrase in the answer": sum(r[f"{p} donor"] for r in self.rows) / n,
                        "tokens identical to isolated": sum(r[f"{p} identical"] for r in self.rows) / n,
                        "seconds": self.seconds[p]})
        return out


def real_recall(model: Any, tokenizer: Any, examples: Sequence[P.PassphraseExample], questions: Sequence[str],
                max_tokens: int = 24, block_size: int = DEFAULT_BLOCK_SIZE) -> RealRecall:
    """Three passes of one prefix-caching Engine over the same requests (request i asks questions[i % len]).

    1. *isolated*: every request for the first time -- nothing of its system prompt is in the cache yet
       (its ``num_cached_tokens`` is reported, so a hit would show);
    2. *shared*: the same requests again -- each one's system-prompt blocks now come from the cache;
    3. *swapped*: request i's own user turn after request (i+1)'s system turn -- its prefix blocks are
       the donor's cached K/V, what a cache keyed on the question instead of the full prefix would serve.
    Recall is ``P.mentions`` (the passphrase appears in the answer's first line).
    """
    import time

    from kvlab.engine import Engine, SamplingParams

    if len(examples) < 2:
        raise ValueError("need at least two examples (each one's prefix is swapped with the next's)")
    n = len(examples)
    ids = [encode(tokenizer, P.real_model_prompt(tokenizer, e, questions[i % len(questions)]))
           for i, e in enumerate(examples)]
    sys_ids = [encode(tokenizer, system_turn(tokenizer, e)) for e in examples]
    for i, s in zip(ids, sys_ids):
        if i[: len(s)] != s:
            raise ValueError("the system turn does not tokenize as a prefix of the prompt")
    donors = [(i + 1) % n for i in range(n)]
    swapped = [sys_ids[d] + ids[i][len(sys_ids[i]):] for i, d in enumerate(donors)]
    engine = Engine(model, tokenizer, block_size=block_size, enable_prefix_caching=True,
                    num_blocks=max(64, 3 * n * (len(ids[0]) + max_tokens) // block_size + 8))
    sp = SamplingParams(max_tokens=max_tokens)
    outs, seconds = {}, {}
    for name, prompts in (("isolated", ids), ("shared", ids), ("swapped", swapped)):
        t0 = time.perf_counter()
        outs[name] = engine.generate(prompts, sp)
        seconds[name] = time.perf_counter() - t0
    rows = []
    for i, (e, d) in enumerate(zip(examples, donors)):
        row = {"passphrase": e.passphrase, "donor": examples[d].passphrase,
               "question": questions[i % len(questions)]}
        for name in ("isolated", "shared", "swapped"):
            o = outs[name][i]
            row.update({name: o.text.strip(), f"{name} cached": o.num_cached_tokens,
                        f"{name} own": P.mentions(o.text, e.passphrase),
                        f"{name} donor": P.mentions(o.text, examples[d].passphrase),
                        f"{name} identical": o.output_ids == outs["isolated"][i].output_ids})
        rows.append(row)
    return RealRecall(rows, seconds)


def translation_prompts(tokenizer: Any) -> dict[str, str]:
    """The article's translation example (its 2.2 / 3.3) as chat prompts: its Chinese wording and an English one."""
    pairs = {"article (zh)": ("你是一个专业的翻译助手，请将以下内容翻译成英文：", "今天天气很好。"),
             "English version": ("You are a professional translation assistant. Translate the following text "
                                 "into English.", "今天天气很好。"),
             "English, to Chinese": ("You are a professional translation assistant. Translate the following text "
                                     "into Chinese.", "The weather is nice today.")}
    return {name: tokenizer.apply_chat_template([{"role": "system", "content": s}, {"role": "user", "content": u}],
                                                add_generation_prompt=True, tokenize=False)
            for name, (s, u) in pairs.items()}


def looks_translated(name: str, answer: str) -> bool:
    """A rough, printed test: did the answer switch language the way the prompt asked?"""
    first = answer.strip().split("\n")[0]
    if name.endswith("to Chinese"):
        return "天气" in first  # "the weather", in the answer's first line
    return not any("\u4e00" <= ch <= "\u9fff" for ch in first) and "weather" in first.lower()


RECORD = "build/bench/nb00_real_recall.json"  # written by ``python -m kvlab.lessons.nb00_passphrase``


def record_real_recall(n: int = 100, seed: int = 0, model_name: str = "smollm2", path: str = RECORD,
                       threads: int | None = None) -> dict[str, Any]:
    """Run ``real_recall`` on ``n`` held-out passphrases (the notebook's seeds) and write the summary as JSON."""
    import json
    import platform
    import time
    from pathlib import Path

    import torch

    import kvlab

    if threads:
        torch.set_num_threads(threads)
    model, tok = kvlab.load_model(model_name, device="cpu")
    t0 = time.perf_counter()
    rr = real_recall(model, tok, P.make_examples(n, "heldout", start=5000 + seed), P.REAL_QUESTIONS)
    out = {"model": model_name, "n": n, "seed": seed, "summary": rr.summary(), "rows": rr.rows,
           "seconds": time.perf_counter() - t0, "torch_threads": torch.get_num_threads(),
           "machine": platform.machine(), "recorded": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, ensure_ascii=False))
    return out


def load_real_recall(path: str = RECORD, n_min: int = 100, seed: int = 0) -> dict[str, Any] | None:
    """The recorded run of ``record_real_recall`` if one with >= ``n_min`` passphrases and this seed exists."""
    import json
    from pathlib import Path

    for base in (Path(path), Path("..") / path):  # notebooks run from notebooks/
        if base.exists():
            data = json.loads(base.read_text())
            if data.get("n", 0) >= n_min and data.get("seed") == seed:
                return data
    return None


if __name__ == "__main__":  # python -m kvlab.lessons.nb00_passphrase [N] [SEED]
    import sys

    result = record_real_recall(*(int(a) for a in sys.argv[1:3]), threads=2)
    for row in result["summary"]:
        print(row)
    print(f"{result['seconds']:.1f} s -> {RECORD}")


def shared_blocks(manager: Any, seq_ids: Sequence[Any]) -> list[int]:
    """Physical blocks that two or more of ``seq_ids`` hold, in the order of the first one's table."""
    tables = [manager.block_table(s) for s in seq_ids]
    held = [b for t in tables for b in set(t)]
    return [b for b in dict.fromkeys(x for t in tables for x in t) if held.count(b) > 1]


def fig_shared_prefix(manager: Any, seq_ids: Sequence[Any] | None = None, labels: Sequence[str] | None = None) -> Any:
    """One prefix fanned out to requests: the blocks they share drawn once (shaded), each one's own blocks after."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    seq_ids = list(manager.seqs) if seq_ids is None else list(seq_ids)
    labels = [str(s) for s in seq_ids] if labels is None else list(labels)
    shared = shared_blocks(manager, seq_ids)
    own = [[b for b in manager.block_table(s) if b not in shared] for s in seq_ids]
    n, width = len(seq_ids), len(shared) + 1.5 + max([len(o) for o in own] + [1])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * width + 1.5), 0.8 * n + 1.8))
    mid = (n - 1) / 2
    for j, b in enumerate(shared):
        ax.add_patch(Rectangle((j, mid - 0.35), 0.9, 0.7, facecolor="#9ecae1", edgecolor="black", gid="shared"))
        ax.text(j + 0.45, mid, str(b), ha="center", va="center", fontsize=9)
    x0 = len(shared) + 1.5
    for row, (label, blocks) in enumerate(zip(labels, own, strict=True)):
        y = n - 1 - row
        ax.annotate("", xy=(x0 - 0.05, y), xytext=(len(shared) - 0.05, mid),
                    arrowprops={"arrowstyle": "->", "color": "grey"})
        for j, b in enumerate(blocks):
            ax.add_patch(Rectangle((x0 + j, y - 0.35), 0.9, 0.7, facecolor="white", edgecolor="black", gid="own"))
            ax.text(x0 + j + 0.45, y, str(b), ha="center", va="center", fontsize=9)
        ax.text(x0 + len(blocks) + 0.2, y, label, ha="left", va="center", fontsize=9)
    ax.set_xlim(-0.3, width + 2.5)
    ax.set_ylim(-0.7, n - 0.3)
    ax.axis("off")
    ax.set_title(f"{n} requests, one prefix: {len(shared)} shared blocks held once (shaded), "
                 f"{sum(map(len, own))} blocks of their own\n(numbers = physical block ids in the BlockManager)",
                 fontsize=10)
    fig.tight_layout()
    return fig
