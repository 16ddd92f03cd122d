"""Notebook 00's runners (the real model's three passes, the prefill timing), checkers and
shared-prefix figure; its cells write ``ask`` and the swapped prefix (``kvlab.built.nb00``), the
reader the suffix-only prefill."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pandas as pd
import torch
from transformers import DynamicCache

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import encode, model_device_dtype, synchronize
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict
from kvlab.lessons.solutions import build_00_suffix_prefill
from kvlab.lessons.timing import ratio_verdict, time_interleaved


def show_answers(frame: pd.DataFrame, **formats: Any) -> Any:
    """A table of model answers as a Styler: every text cell HTML-escaped (a model may answer ``<img
    ...>``), long text wrapped; ``formats`` as ``Styler.format``'s per-column formats."""
    return frame.style.format(formats or None,
                              escape="html").set_properties(**{"white-space": "pre-wrap"})


# -------------------------------------------------------------------- what the shared prefill saves

@torch.no_grad()
def full_prefill(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """Isolated: the whole prompt from scratch, on an empty cache. The last position's logits,
    (vocab,)."""
    device, _ = model_device_dtype(model)
    return model(input_ids=torch.tensor([list(ids)], device=device),
                 cache=DynamicCache(config=model.config),
                 use_cache=True, logits_to_keep=1).logits[0, -1]


@torch.no_grad()
def time_prefill(model: Any, prefix_ids: Sequence[int], suffix_ids: Sequence[int], repeats: int = 5,
                 step: Callable[..., torch.Tensor] = build_00_suffix_prefill) -> dict[str, Any]:
    """Time to the first token's logits, full prefill against ``step`` (the suffix on a copy of the
    cached prefix), interleaved: ``ratio`` (min–max) judged against ``ideal`` = the suffix's share,
    and the ``sentence``."""
    prefix_ids, suffix_ids = list(prefix_ids), list(suffix_ids)
    device, _ = model_device_dtype(model)
    prefix_cache = model(input_ids=torch.tensor([prefix_ids], device=device), use_cache=True,
                         logits_to_keep=1).cache
    t = time_interleaved({"full": lambda: full_prefill(model, prefix_ids + suffix_ids),
                          "cached": (lambda: copy.deepcopy(prefix_cache),
                                     lambda cache: step(model, cache, len(prefix_ids),
                                                        suffix_ids))},
                         repeats=repeats, sync=lambda: synchronize(device))
    ideal = len(suffix_ids) / (len(prefix_ids) + len(suffix_ids))
    v = ratio_verdict(t["cached"], t["full"], ideal=ideal,
                      at=f"with a {len(prefix_ids)}-token prefix",
                      ideal_is="the suffix's share of the tokens")
    if v and v.value >= 1:
        sentence = (f"NO saving: the suffix-only prefill took x{v.value:.2f} the full one "
                    f"({v.lo:.2f}–{v.hi:.2f})")
    else:
        sentence = v.says(f"the suffix-only prefill took {v.value:.3f} of the full one "
                          f"({v.lo:.3f}–{v.hi:.3f} over {repeats} interleaved repeats), saving "
                          f"{1 - v.value:.0%} of the prefill time; the ideal (only the suffix's "
                          f"tokens computed) saves {1 - ideal:.0%}")
    last = t["cached"].result.float().reshape(-1, t["full"].result.shape[-1])[-1]
    return {"prefix_tokens": len(prefix_ids), "suffix_tokens": len(suffix_ids),
            "full_s": t["full"].median,
            "cached_s": t["cached"].median, "ratio": v.value, "ratio_min": v.lo, "ratio_max": v.hi,
            "ideal": ideal,
            "saving_shown": bool(v) and v.value < 1, "verdict": v.text, "sentence": sentence,
            "max_abs_logit_diff": float((t["full"].result.float() - last).abs().max())}


def prefill_saving(model: Any, tokenizer: Any, example: P.PassphraseExample, long_prefix: int,
                   repeats: int,
                   step: Callable[..., torch.Tensor] = build_00_suffix_prefill) -> pd.DataFrame:
    """``time_prefill`` on ``example``'s system turn as it is and lengthened with filler lines to
    ``long_prefix`` tokens: one row each."""
    pool, lines, long_ex = P.FILLER_ZH + P.FILLER_EN, [], example
    while len(encode(tokenizer, long_ex.prefix_text)) < long_prefix:
        lines.append(pool[len(lines) % len(pool)])
        long_ex = replace(example, system="\n".join(lines + [example.system]))
    return pd.DataFrame([time_prefill(model, encode(tokenizer, e.prefix_text),
                                      encode(tokenizer, e.suffix_text),
                                      repeats, step) for e in (example, long_ex)])


# ----------------------------------------------------------------------------- the real chat model

def real_model_passes(model: Any, tokenizer: Any, n: int, max_new_tokens: int, start: int = 5000
                      ) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """``n`` held-out passphrases through kvlab's ``Engine`` isolated, shared and swapped (request
    i's user turn after i+1's system turn): (per-pass table, answers, sentences)."""
    examples = P.make_examples(n, "heldout", start=start)
    asked = [P.REAL_QUESTIONS[i % len(P.REAL_QUESTIONS)] for i in range(n)]
    prompts = [encode(tokenizer, P.real_model_prompt(tokenizer, e, q))
               for e, q in zip(examples, asked)]
    systems = [encode(tokenizer, system_turn(tokenizer, e)) for e in examples]
    assert all(p[:len(s)] == s
               for p, s in zip(prompts, systems)), "the system turn is a token prefix of the prompt"
    donor = [(i + 1) % n for i in range(n)]
    swapped = [systems[d] + prompts[i][len(systems[i]):] for i, d in enumerate(donor)]
    sp, blocks = (SamplingParams(max_tokens=max_new_tokens),
                  max(64, 3 * n * (max(map(len, prompts)) + max_new_tokens) // 16 + 8))
    shared = Engine(model, tokenizer, enable_prefix_caching=True, num_blocks=blocks)
    # each system turn computed once, now cached
    shared.generate(systems, SamplingParams(max_tokens=1))
    passes = {"isolated": Engine(model, tokenizer, enable_prefix_caching=False,
                                 num_blocks=blocks).generate(prompts, sp),
              "shared": shared.generate(prompts, sp), "swapped": shared.generate(swapped, sp)}
    summary = pd.DataFrame({name: {
        "mean cached prompt tokens": sum(o.num_cached_tokens for o in outs) / n,
        "own passphrase in the answer": sum(P.mentions(o.text, e.passphrase)
                                            for o, e in zip(outs, examples)) / n,
        "donor passphrase in the answer": sum(P.mentions(o.text, examples[d].passphrase)
                                              for o, d in zip(outs, donor)) / n,
        "tokens identical to isolated": sum(o.output_ids == i.output_ids
                                            for o, i in zip(outs, passes["isolated"])) / n}
        for name, outs in passes.items()}).T
    answers = pd.DataFrame({"question": asked, "passphrase": [e.passphrase for e in examples],
                            **{name: [o.text.strip() for o in outs]
                               for name, outs in passes.items()}})
    s, bs = summary, shared.config.block_size
    lines = [f"shared pass: {s.loc['shared', 'mean cached prompt tokens']:.1f} cached prompt "
             "tokens per request, the system turn's "
             f"{sum(len(x) // bs * bs for x in systems) / n:.1f} tokens in full {bs}-token blocks",
             f"recall on {n} passphrases: isolated "
             f"{s.loc['isolated', 'own passphrase in the answer']:.1%}, shared "
             f"{s.loc['shared', 'own passphrase in the answer']:.1%}; "
             f"{s.loc['shared', 'tokens identical to isolated']:.1%} of shared answers "
             "token-identical to isolated",
             "swapped prefix: own passphrase "
             f"{s.loc['swapped', 'own passphrase in the answer']:.1%}, the donor's "
             f"{s.loc['swapped', 'donor passphrase in the answer']:.1%}"]
    return summary, answers, lines


# ----------------------------------------------------------------------------- checkers

def check_ideal_fraction(answer: float | None, prompt_tokens: int, cached_tokens: int) -> Verdict:
    """Exercise 00.1: the share of prefill tokens still computed when ``cached_tokens`` are
    reused."""
    hint = ("count the prompt tokens that still go through the model (the uncached ones) and "
            "divide by all of them")
    if answer is None:
        return unanswered(hint)
    value = as_number(answer)
    if value is None:
        return verdict(False, hint=f"give a number (a fraction between 0 and 1), not {answer!r}")
    expected = (prompt_tokens - cached_tokens) / prompt_tokens
    return verdict(abs(value - expected) < 1e-6, f"{expected:.4f} of the prompt is still prefilled",
                   hint)


def check_reusable(answer: bool | None, prefix_ids: Sequence[int],
                   prompt_ids: Sequence[int]) -> Verdict:
    """Exercise 00.2: may a cache of ``prefix_ids`` serve ``prompt_ids`` (same model)? Answer True
    or False."""
    hint = ("a cache serves a prompt only if the prompt's first len(prefix_ids) ids are the prefix "
            "ids, in order")
    if answer is None:
        return unanswered(hint)
    expected = (len(prefix_ids) <= len(prompt_ids)
                and list(prompt_ids[: len(prefix_ids)]) == list(prefix_ids))
    why = ("the prompt's ids start with the prefix ids" if expected
           else "the prompt's ids do not start with the prefix ids")
    return verdict(bool(answer) == expected, why, hint)

def check_suffix_prefill(fn: Any, model: Any, tokenizer: Any) -> Verdict:
    """Build exercise 00.B: ``fn(model, cache, prefix_len, suffix_ids)`` gives the whole prompt's
    last logits."""
    hint = ("run only suffix_ids through model(input_ids=..., position_ids=..., cache=cache, "
            "use_cache=True), positions prefix_len, prefix_len + 1, ...; return the last "
            "position's logits")
    ex = P.make_example(7, "heldout", n_filler=4, history="none")
    prefix, suffix = encode(tokenizer, ex.prefix_text), encode(tokenizer, ex.suffix_text)
    device, _ = model_device_dtype(model)
    with torch.no_grad():
        want = full_prefill(model, prefix + suffix).float()  # (vocab,)
        cache = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).cache
        got, failed = call_answer(fn, model, cache, len(prefix), suffix, hint=hint,
                                  name="my_suffix_prefill")
    if failed is not None:
        return failed
    if not isinstance(got, torch.Tensor) or got.shape[-1] != want.shape[-1]:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return verdict(False,
                       hint=f"return the last position's logits, a ({want.shape[-1]},) tensor; got "
                            f"{shape}")
    seen = cache.get_seq_length()
    if seen != len(prefix) + len(suffix):
        return verdict(False,
                       hint=f"after your call the cache holds {seen} positions, not the prefix's "
                            f"{len(prefix)} and the suffix's {len(suffix)}: feed the suffix alone, "
                            "on the cache you were given")
    diff = float((got.detach().float().reshape(-1, want.shape[-1])[-1] - want).abs().max())
    if diff <= 1e-4:
        return verdict(True,
                       f"the suffix's {len(suffix)} tokens on the {len(prefix)}-token cached "
                       f"prefix give the whole prompt's logits to {diff:.1e}")
    return verdict(False,
                   hint=f"the logits differ from the whole prompt's by up to {diff:.3g}: do the "
                        "suffix's positions continue after the prefix (prefix_len, prefix_len + 1, "
                        "...)?")


def system_turn(tokenizer: Any, example: P.PassphraseExample) -> str:
    """The system turn of ``P.real_model_prompt`` alone, rendered by the chat template (the shared
    prefix)."""
    return tokenizer.apply_chat_template(P.real_model_messages(example)[:1], tokenize=False)


def shared_blocks(manager: Any, seq_ids: Sequence[Any]) -> list[int]:
    """Physical blocks that two or more of ``seq_ids`` hold, in the order of the first one's
    table."""
    tables = [manager.block_table(s) for s in seq_ids]
    held = [b for t in tables for b in set(t)]
    return [b for b in dict.fromkeys(x for t in tables for x in t) if held.count(b) > 1]


def fig_shared_prefix(manager: Any, seq_ids: Sequence[Any] | None = None,
                      labels: Sequence[str] | None = None) -> Any:
    """One prefix fanned out to requests: the blocks they share drawn once (shaded), each one's own
    blocks after."""
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
        ax.add_patch(Rectangle((j, mid - 0.35), 0.9, 0.7, facecolor="#9ecae1", edgecolor="black",
                               gid="shared"))
        ax.text(j + 0.45, mid, str(b), ha="center", va="center", fontsize=9)
    x0 = len(shared) + 1.5
    for row, (label, blocks) in enumerate(zip(labels, own, strict=True)):
        y = n - 1 - row
        ax.annotate("", xy=(x0 - 0.05, y), xytext=(len(shared) - 0.05, mid),
                    arrowprops={"arrowstyle": "->", "color": "grey"})
        for j, b in enumerate(blocks):
            ax.add_patch(Rectangle((x0 + j, y - 0.35), 0.9, 0.7, facecolor="white",
                                   edgecolor="black", gid="own"))
            ax.text(x0 + j + 0.45, y, str(b), ha="center", va="center", fontsize=9)
        ax.text(x0 + len(blocks) + 0.2, y, label, ha="left", va="center", fontsize=9)
    ax.set_xlim(-0.3, width + 2.5)
    ax.set_ylim(-0.7, n - 0.3)
    ax.axis("off")
    ax.set_title(f"{n} requests, one prefix: {len(shared)} shared blocks held once (shaded), "
                 f"{sum(map(len, own))} blocks of their own\n(numbers = physical block ids in the "
                 "BlockManager)",
                 fontsize=10)
    fig.tight_layout()
    return fig


# The article's section 3.5 request: one translation system prompt, two texts after it.
ARTICLE_TRANSLATION = ("你是一个专业的翻译助手，请将以下内容翻译成英文：",
                       ("今天天气很好。", "明天会下雨吗？"))
