"""Notebook 00 (the passphrase experiment): its exercise checkers, the build exercise, workloads and a figure.

The mechanisms notebook 00 runs (the client's ``ask``, the suffix-only prefill and its timing, answering on a
cached prefix) are written in its ``#| export`` cells (``kvlab.built.nb00``); a few are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.built.nb00 import ask, cache_counters, full_prefill, positions_restart  # noqa: F401 (notebook 00's cells)
from kvlab.built.nb00 import suffix_prefill as build_00_suffix_prefill  # noqa: F401 (the worked solution: the notebook's)
from kvlab.engine.models import encode, model_device_dtype
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict


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

def check_suffix_prefill(fn: Any, model: Any, tokenizer: Any) -> Verdict:
    """Build exercise 00.B: ``fn(model, cache, prefix_len, suffix_ids)`` gives the whole prompt's last logits."""
    hint = ("run only suffix_ids through model(input_ids=..., position_ids=..., cache=cache, use_cache=True), "
            "positions prefix_len, prefix_len + 1, ...; return the last position's logits")
    ex = P.make_example(7, "heldout", n_filler=4, history="none")
    prefix, suffix = encode(tokenizer, ex.prefix_text), encode(tokenizer, ex.suffix_text)
    device, _ = model_device_dtype(model)
    with torch.no_grad():
        want = full_prefill(model, prefix + suffix).float()  # (vocab,)
        cache = model(input_ids=torch.tensor([prefix], device=device), use_cache=True).cache
        got, failed = call_answer(fn, model, cache, len(prefix), suffix, hint=hint, name="my_suffix_prefill")
    if failed is not None:
        return failed
    if not isinstance(got, torch.Tensor) or got.shape[-1] != want.shape[-1]:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return verdict(False, hint=f"return the last position's logits, a ({want.shape[-1]},) tensor; got {shape}")
    seen = cache.get_seq_length()
    if seen != len(prefix) + len(suffix):
        return verdict(False, hint=f"after your call the cache holds {seen} positions, not the prefix's {len(prefix)} "
                                   f"and the suffix's {len(suffix)}: feed the suffix alone, on the cache you were given")
    diff = float((got.detach().float().reshape(-1, want.shape[-1])[-1] - want).abs().max())
    if diff <= 1e-4:
        return verdict(True, f"the suffix's {len(suffix)} tokens on the {len(prefix)}-token cached prefix give the "
                             f"whole prompt's logits to {diff:.1e}")
    return verdict(False, hint=f"the logits differ from the whole prompt's by up to {diff:.3g}: do the suffix's "
                               "positions continue after the prefix (prefix_len, prefix_len + 1, ...)?")


def system_turn(tokenizer: Any, example: P.PassphraseExample) -> str:
    """The system turn of ``P.real_model_prompt`` alone, rendered by the chat template (the shared prefix)."""
    return tokenizer.apply_chat_template(P.real_model_messages(example)[:1], tokenize=False)


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


# The article's section 3.5 request: one translation system prompt, two texts after it.
ARTICLE_TRANSLATION = ("你是一个专业的翻译助手，请将以下内容翻译成英文：", ("今天天气很好。", "明天会下雨吗？"))
