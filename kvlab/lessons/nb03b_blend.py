"""Notebook 03b's experiments: reusing cached chunks in the middle of a prompt (``kvlab.blend``).

1. ``run_group2``: the article's group 2 (a segment after a different preamble), served from the
   segment's K/V as request A computed them, re-rotated, with ``r`` of its tokens recomputed.
2. ``rag_requests`` / ``run_quality``: a RAG-shaped workload, a system prompt, 2-4 passages in an
   order that changes between requests (the passphrase is in one of them) and a question; answers
   against a full prefill for each recompute share ``r``.
3. ``run_ttft``: time to the first token's logits of a full prefill, a prefix cache alone (the
   system prompt) and blending at each ``r`` (prefix cache + chunk cache), interleaved.
4. ``layer_deviation`` / ``fig_picked``: how far each layer's reused K/V are from a full prefill's,
   and which tokens the selection picks.

Every request is greedy; the reference is the same prompt ids prefilled in full (``recompute=1``
through no cache at all). Figures are pure functions of the returned tables; the checker is at the end.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.blend import Blend, ChunkCache, blend_generate, blend_prefill, rerotate_keys
from kvlab.engine.models import encode
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, call_answer, progress_bar, verdict
from kvlab.lessons.nb03_position import token_agreement
from kvlab.prefix import PrefixKV

RATIOS = (0.0, 0.05, 0.15, 0.30, 1.0)  # the recompute shares
MAX_NEW_TOKENS = 12
REAL_MAX_NEW_TOKENS = 16  # "The secret passphrase is: X5DUXP." and the end of turn fit
Pieces = list[tuple[list[int], bool]]


# ----------------------------------------------------------------------------- the RAG-shaped workload

@dataclass(frozen=True)
class RagRequest:
    """One request: ``pieces`` (ids, reuse?) = system prompt, passages, question; the passphrase to answer."""

    docset: int
    pieces: Pieces
    answer: str
    order: tuple[int, ...]  # passage ids in prompt order; passage 0 holds the passphrase
    whole_text_tokens: bool  # the pieces' ids equal the whole prompt text's ids

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's ids: the pieces concatenated."""
        return [t for ids, _ in self.pieces for t in ids]

    @property
    def system_len(self) -> int:
        """Tokens of the first piece (the system prompt every request shares)."""
        return len(self.pieces[0][0])


def passages(seed: int, n_distractors: int = 4, real: bool = False) -> tuple[str, list[str], str, str]:
    """(passphrase, passages, language, question) of one document set; passage 0 states the passphrase.

    Each passage is a few filler lines (English sentences for a chat model) ending with a newline.
    """
    rng = random.Random(f"kvlab-blend:{seed}")
    ex = P.make_example(seed, "heldout", lang="en" if real else None, history="none")
    pool = P.FILLER_EN if real else P.FILLER_ZH + P.FILLER_EN
    state = (f"The secret passphrase is: {ex.passphrase}." if real else
             rng.choice(P.STATE_ZH if ex.lang == "zh" else P.STATE_EN).format(p=ex.passphrase))
    answer_lines = [rng.choice(pool) for _ in range(rng.randint(1, 2))]
    answer_lines.insert(rng.randint(0, len(answer_lines)), state)
    sep = " " if real else "\n"
    docs = [sep.join(answer_lines) + "\n"]
    docs += [sep.join(rng.choice(pool) for _ in range(rng.randint(2, 3))) + "\n" for _ in range(n_distractors)]
    question = P.REAL_QUESTIONS[0] if real else rng.choice(P.ASK_ZH if ex.lang == "zh" else P.ASK_EN)
    return ex.passphrase, docs, ex.lang, question


def _frame(tokenizer: Any, lang: str, question: str, real: bool) -> tuple[str, str]:
    """(text before the passages, text after them) for the bundled model's ChatML or a chat template."""
    if not real:
        zh = lang == "zh"
        head = P.IM_START + "system\n" + (P.FILLER_ZH[1] if zh else P.FILLER_EN[0]) + "\n"
        closing = P.FILLER_ZH[17] if zh else P.FILLER_EN[-1]  # "the system prompt ends here"
        return head, closing + P.IM_END + "\n" + P.chatml("user", question) + P.IM_START + "assistant\n"
    marker = "\x00PASSAGES\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": marker},
                                          {"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)
    at = text.index(marker)
    head = text[:at] + "You are a helpful assistant. Read the documents below.\n"
    tail = "If asked for the passphrase, answer with exactly the passphrase." + text[at + len(marker):]
    return head, tail


def rag_requests(tokenizer: Any, docsets: Sequence[int], per_docset: int = 4, real: bool = False) -> list[RagRequest]:
    """``per_docset`` requests per document set: the passphrase passage and 1-3 others, shuffled per request."""
    out = []
    for seed in docsets:
        passphrase, docs, lang, question = passages(seed, real=real)
        head, tail = _frame(tokenizer, lang, question, real)
        rng = random.Random(f"kvlab-blend-order:{seed}")
        for _ in range(per_docset):
            chosen = [0] + rng.sample(range(1, len(docs)), rng.randint(1, 3))
            rng.shuffle(chosen)
            pieces = [(encode(tokenizer, head), False)] + [(encode(tokenizer, docs[i]), True) for i in chosen]
            pieces.append((encode(tokenizer, tail), False))
            text = head + "".join(docs[i] for i in chosen) + tail
            whole = [t for ids, _ in pieces for t in ids] == encode(tokenizer, text)
            out.append(RagRequest(seed, pieces, passphrase, tuple(chosen), whole))
    return out


# ----------------------------------------------------------------------------- quality against a full prefill

def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) in nats between the softmax of two logit vectors (vocab,); float rounding clipped at 0."""
    p = torch.log_softmax(reference.float(), -1)
    q = torch.log_softmax(other.float(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def full_pieces(pieces: Pieces) -> Pieces:
    """The same prompt with nothing marked for reuse."""
    return [(ids, False) for ids, _ in pieces]


def _recall(real: bool) -> Callable[[str, str], bool]:
    return P.mentions if real else P.recalled


@torch.no_grad()
def run_quality(chunks: ChunkCache, requests: Sequence[RagRequest], ratios: Sequence[float] = RATIOS,
                real: bool = False, tenant: str | None = None, progress: bool = False) -> Any:
    """Each request at each recompute share vs its full prefill: identical, agreement, recall, first-token KL.

    The system prompt comes from an exact prefix cache (built once per distinct system prompt).
    """
    import pandas as pd

    tok, rows, prefixes = chunks.tokenizer, [], {}
    max_new = REAL_MAX_NEW_TOKENS if real else MAX_NEW_TOKENS
    for i, req in enumerate(progress_bar(requests, progress, "requests")):
        ref = blend_generate(chunks, full_pieces(req.pieces), 1.0, max_new_tokens=max_new)
        head = tuple(req.pieces[0][0])
        prefix = prefixes.setdefault(head, PrefixKV.build(chunks.model, tok, list(head)))
        for r in ratios:
            b = blend_generate(chunks, req.pieces, r, tenant=tenant, prefix=prefix, max_new_tokens=max_new)
            text = tok.decode(b.token_ids, skip_special_tokens=True)
            rows.append({"request": i, "docset": req.docset, "passages": len(req.order), "r": r,
                         "prompt tokens": len(b.prompt_ids), "reused tokens": len(b.reused),
                         "recomputed tokens": len(b.recomputed), "identical": b.token_ids == ref.token_ids,
                         "agreement": token_agreement(ref.token_ids, b.token_ids),
                         "recalled": _recall(real)(text, req.answer),
                         "full recalled": _recall(real)(tok.decode(ref.token_ids, skip_special_tokens=True), req.answer),
                         "KL": kl_divergence(ref.logits, b.logits), "answer": P.normalize_answer(text)})
    return pd.DataFrame(rows)


def quality_table(quality: Any) -> Any:
    """Per recompute share: requests, identical, agreement, recall, mean and max KL, tokens recomputed."""
    g = quality.groupby("r")
    out = g[["identical", "agreement", "recalled"]].mean()
    out.insert(0, "requests", g.size())
    out["full recalled"] = g["full recalled"].mean()
    out["mean KL"], out["max KL"] = g["KL"].mean(), g["KL"].max()
    out["recomputed / reused"] = g["recomputed tokens"].sum() / g["reused tokens"].sum()
    return out


# ----------------------------------------------------------------------------- time to first token

def ttft_methods(ratios: Sequence[float]) -> list[str]:
    """The methods ``run_ttft`` times, in order."""
    return ["full prefill", "prefix cache only"] + [f"blend r={r:.0%}" for r in ratios]


@torch.no_grad()
def run_ttft(chunks: ChunkCache, requests: Sequence[RagRequest], ratios: Sequence[float] = RATIOS,
             repeats: int = 3, progress: bool = False) -> Any:
    """Median seconds to the first token's logits per request and method, the methods interleaved.

    Every method runs through ``blend_prefill``: full prefill (nothing cached), the system prompt from a
    prefix cache and the rest computed, and blending (prefix cache + chunk cache, hits only: the chunks
    are computed before timing, as documents indexed ahead of a RAG query).
    """
    import pandas as pd

    rows, names = [], ttft_methods(ratios)
    for i, req in enumerate(progress_bar(requests, progress, "TTFT")):
        prefix = PrefixKV.build(chunks.model, chunks.tokenizer, req.pieces[0][0])
        full = full_pieces(req.pieces)
        runs = {names[0]: (full, 1.0, None), names[1]: (full, 1.0, prefix)}  # (pieces, r, prefix cache)
        runs.update({name: (req.pieces, r, prefix) for name, r in zip(names[2:], ratios)})
        times: dict[str, list[float]] = {n: [] for n in names}
        for pieces, r, pre in runs.values():
            blend_prefill(chunks, pieces, r, prefix=pre)  # warm-up, and every chunk is in the cache from here on
        for _ in range(repeats):
            for name, (pieces, r, pre) in runs.items():
                b = blend_prefill(chunks, pieces, r, prefix=pre)
                times[name].append(b.seconds["ttft"])
                if name.startswith("blend"):
                    times.setdefault(name + " select", []).append(b.seconds["select"])
        for name in names:
            row = {"request": i, "method": name, "prompt tokens": len(req.prompt_ids),
                   "ttft_s": statistics.median(times[name])}
            if name + " select" in times:
                row["select_s"] = statistics.median(times[name + " select"])
            rows.append(row)
    return pd.DataFrame(rows)


def ttft_table(ttft: Any) -> Any:
    """Per method: median TTFT (ms) over requests and its ratio to the full prefill of the same request."""
    full = ttft[ttft["method"] == "full prefill"].set_index("request")["ttft_s"]
    t = ttft.assign(ratio=ttft["ttft_s"] / ttft["request"].map(full))
    g = t.groupby("method", sort=False)
    out = g["ttft_s"].median().mul(1000).rename("median TTFT ms").to_frame()
    out["vs full prefill"] = g["ratio"].median()
    if "select_s" in t:
        out["selection ms"] = g["select_s"].median().mul(1000)
    return out


# ----------------------------------------------------------------------------- the article's group 2

@torch.no_grad()
def run_group2(chunks: ChunkCache, pairs: Sequence[dict], ratios: Sequence[float] = RATIOS, real: bool = False,
               progress: bool = False) -> Any:
    """Group 2 (``nb03_position.overlap_pair``): B reuses the segment's K/V as A computed them, at each ``r``.

    A's request computes its preamble + segment; the chunk cache stores A's segment K/V with the
    position it started at (``ChunkCache.put``). B = its own preamble + segment + question.
    """
    import pandas as pd

    model, tok, rows = chunks.model, chunks.tokenizer, []
    device = next(model.parameters()).device
    max_new = REAL_MAX_NEW_TOKENS if real else MAX_NEW_TOKENS
    for pair in progress_bar(pairs, progress, "group 2 pairs"):
        a_ids = pair["head_a"] + pair["segment"]
        cache = model(input_ids=torch.tensor([a_ids], device=device), use_cache=True, logits_to_keep=1).cache
        ha = len(pair["head_a"])
        chunks.put(pair["segment"], [(lay.keys[:, :, ha:], lay.values[:, :, ha:]) for lay in cache.layers], start=ha)
        pieces = [(pair["head_b"], False), (pair["segment"], True), (pair["tail"], False)]
        ref = blend_generate(chunks, full_pieces(pieces), 1.0, max_new_tokens=max_new)
        for r in ratios:
            b = blend_generate(chunks, pieces, r, max_new_tokens=max_new)
            text = tok.decode(b.token_ids, skip_special_tokens=True)
            rows.append({"seed": pair["example"].seed, "delta": len(pair["head_b"]) - ha, "r": r,
                         "identical": b.token_ids == ref.token_ids,
                         "agreement": token_agreement(ref.token_ids, b.token_ids),
                         "recalled": _recall(real)(text, pair["example"].answer), "KL": kl_divergence(ref.logits, b.logits)})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- per-layer deviation, picked tokens

@torch.no_grad()
def layer_deviation(chunks: ChunkCache, requests: Sequence[RagRequest], ratios: Sequence[float]) -> Any:
    """Relative error of the reused tokens' K and V per layer against a full prefill, per recompute share."""
    import pandas as pd

    rows = []
    for i, req in enumerate(requests):
        ref = blend_prefill(chunks, full_pieces(req.pieces), 1.0).cache
        for r in ratios:
            b = blend_prefill(chunks, req.pieces, r)
            at = torch.tensor(b.reused)
            for layer, (x, y) in enumerate(zip(b.cache.layers, ref.layers)):
                for name, got, want in (("K", x.keys, y.keys), ("V", x.values, y.values)):
                    got, want = got[:, :, at], want[:, :, at]
                    rows.append({"request": i, "r": r, "layer": layer, "tensor": name,
                                 "relative error": float((got - want).norm() / want.norm().clamp(min=1e-12))})
    return pd.DataFrame(rows)


def deviation_table(dev: Any, tensor: str = "K") -> Any:
    """Mean relative error per layer (rows) and recompute share (columns) of one tensor."""
    d = dev[dev["tensor"] == tensor]
    return d.groupby(["layer", "r"])["relative error"].mean().unstack("r")


def picked_share_at_starts(b: Blend, request: RagRequest, first: int = 4) -> float:
    """Share of the picked tokens among the first ``first`` tokens of each reused passage."""
    if not b.recomputed:
        raise ValueError("no token was picked: use 0 < r < 1")
    starts, pos = set(), 0
    for ids, reuse in request.pieces:
        if reuse:
            starts |= set(range(pos, pos + min(first, len(ids))))
        pos += len(ids)
    return sum(p in starts for p in b.recomputed) / len(b.recomputed)


def answer_span(tokenizer: Any, ids: Sequence[int], answer: str, longest: int = 16) -> tuple[int, int]:
    """The shortest run of prompt positions [lo, hi) whose text contains ``answer``; (0, 0) when none does."""
    best = (0, 0)
    for lo in range(len(ids)):
        hi = next((j for j in range(lo + 1, min(len(ids), lo + longest) + 1)
                   if answer in tokenizer.decode(ids[lo:j])), None)
        if hi is not None and (best == (0, 0) or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    return best


def spans(request: RagRequest) -> list[tuple[int, int, bool]]:
    """(start, end, reused) of each piece in prompt positions."""
    out, pos = [], 0
    for ids, reuse in request.pieces:
        out.append((pos, pos + len(ids), reuse))
        pos += len(ids)
    return out


# ----------------------------------------------------------------------------- figures

def fig_quality_ttft(quality_summary: Any, ttft_summary: Any, title: str):
    """Left: agreement with a full prefill vs r; right: median TTFT vs r with the two baselines (a Figure)."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [100 * r for r in quality_summary.index]
    ax0.plot(x, quality_summary["identical"], "o-", label="token-identical to full prefill")
    ax0.plot(x, quality_summary["recalled"], "s--", label="passphrase recalled")
    ax0.plot(x, quality_summary["agreement"], "^:", label="token agreement")
    ax0.set(xlabel="recomputed share r of reused tokens (%)", ylabel="fraction of requests", ylim=(-0.03, 1.03),
            title="answers vs r")
    ax0.legend(fontsize=8, loc="lower right")
    blend = ttft_summary[ttft_summary.index.str.startswith("blend")]
    xr = [float(name.split("=")[1].rstrip("%")) for name in blend.index]
    ax1.plot(xr, blend["median TTFT ms"], "o-", label="blend (prefix + chunk cache)")
    for name, style in (("full prefill", "k--"), ("prefix cache only", "g:")):
        ax1.axhline(ttft_summary.loc[name, "median TTFT ms"], color=style[0], ls=style[1:], label=name)
    ax1.set(xlabel="recomputed share r of reused tokens (%)", ylabel="median time to first token (ms)",
            title="TTFT vs r", ylim=(0, None))
    ax1.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def fig_picked(b: Blend, request: RagRequest, tokenizer: Any, title: str):
    """The K/V deviation of each reused token at the selection layer, picked tokens marked, passages shaded."""
    import matplotlib.pyplot as plt

    if b.deviation is None:
        raise ValueError("this blend measured no deviation: use 0 < r < 1")
    fig, ax = plt.subplots(figsize=(11, 3.4))
    for lo, hi, reuse in spans(request):
        ax.axvspan(lo - 0.5, hi - 0.5, color="tab:blue" if reuse else "lightgrey", alpha=0.12 if reuse else 0.35,
                   lw=0)
        ax.axvline(lo - 0.5, color="grey", lw=0.8)  # where each piece starts
    dev = b.deviation.cpu().numpy()
    ax.bar(b.reused, dev, width=1.0, color="tab:blue", label="reused, kept")
    picked = set(b.recomputed)
    xs = [p for p in b.reused if p in picked]
    ax.bar(xs, [dev[b.reused.index(p)] for p in xs], width=1.0, color="tab:red", label="reused, recomputed")
    ids = b.prompt_ids
    lo, hi = answer_span(tokenizer, ids, request.answer)
    if hi > lo:
        ax.axvspan(lo - 0.5, hi - 0.5, color="gold", alpha=0.6, lw=0, label="the passphrase")
    ax.set(xlabel="prompt position (grey: computed, blue: reused passages, lines: piece starts)", ylabel="K/V deviation (L2)",
           title=title, xlim=(-1, len(ids)))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def fig_layer_deviation(tables: dict[str, Any]):
    """Mean relative K error of the reused tokens per layer, one line per r, one panel per model (a Figure)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 3.6), squeeze=False)
    for ax, (name, table) in zip(axes[0], tables.items()):
        for r in table.columns:
            ax.plot(table.index, table[r].clip(lower=1e-9), "o-", label=f"r = {r:.0%}")
        ax.set_yscale("log")
        ax.set(xlabel="layer", ylabel="relative K error vs full prefill (0 drawn at 1e-9)", title=name)
        ax.set_xticks(list(table.index)[:: max(1, len(table.index) // 10)])
        ax.legend(fontsize=8)
    fig.suptitle("Reused passages: how far each layer's keys are from a full prefill")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- exercise checker

def check_rerotate(fn: Callable[[torch.Tensor, int, float], torch.Tensor] | None) -> Verdict:
    """Exercise 03b.1: ``fn(keys, delta, theta)`` moves RoPE'd keys (batch, heads, seq, head_dim) by ``delta``."""
    hint = ("pair dimension i with i + head_dim/2 and turn each pair by delta * inv_freq[i] "
            "(rope.inverse_frequencies, rope.rotate_half): k * cos + rotate_half(k) * sin")
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 5, 16, generator=g)
    for delta, theta in ((7, 10000.0), (-3, 10000.0), (300, 100000.0), (0, 10000.0)):
        out, failed = call_answer(fn, keys, delta, theta, hint=hint, name="my_rerotate")
        if failed is not None:
            return failed
        out = torch.as_tensor(out)
        if out.shape != keys.shape:
            return verdict(False, hint=f"return keys of the same shape {tuple(keys.shape)}, not {tuple(out.shape)}")
        want = rerotate_keys(keys, delta, theta)
        if not torch.allclose(out.float(), want, atol=1e-4):
            err = float((out.float() - want).abs().max())
            return verdict(False, hint=f"for delta {delta}, theta {theta:g} your keys are off by up to {err:.3g}; {hint}")
    return verdict(True, "rotating by delta moves every key to p + delta (exact up to float rounding)")
