"""What notebook 03b_reusing_the_middle.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvlab import blend as B
from kvlab.built.nb03 import token_agreement
from kvlab.engine.models import encode, eos_ids, model_device_dtype, synchronize
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import progress_bar
from kvlab.lessons.timing import Timing, ratio_verdict, time_interleaved
from kvlab.prefix import PrefixKV, continue_from_cache


# --- 03b_reusing_the_middle.ipynb, cell 5 ---
def chunk_key(scope: str, fingerprint: str, ids: Sequence[int]) -> str:
    """A chunk's key: sha256 of the tenant's scope, model fingerprint and the chunk's token ids."""
    h = hashlib.sha256(f"{scope}|{fingerprint}|".encode())
    h.update(",".join(map(str, ids)).encode())
    return h.hexdigest()


# --- 03b_reusing_the_middle.ipynb, cell 11 ---
RATIOS = (0.0, 0.05, 0.15, 0.30, 1.0)  # recompute shares r
MAX_NEW_TOKENS = 12
REAL_MAX_NEW_TOKENS = 16  # "The secret passphrase is: X5DUXP." and the end of turn fit
Pieces = list[tuple[list[int], bool]]


@dataclass(frozen=True)
class RagRequest:
    """One request: ``pieces`` (ids, reuse?) = system prompt, passages, question; the answer."""

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


def passages(seed: int, n_distractors=4, real=False) -> tuple[str, list[str], str, str]:
    """(passphrase, passages, language, question) of a docset; passage 0 states the passphrase."""
    rng = random.Random(f"kvlab-blend:{seed}")
    ex = P.make_example(seed, "heldout", lang="en" if real else None, history="none")
    pool = P.FILLER_EN if real else P.FILLER_ZH + P.FILLER_EN
    state = (f"The secret passphrase is: {ex.passphrase}." if real else
             rng.choice(P.STATE_ZH if ex.lang == "zh" else P.STATE_EN).format(p=ex.passphrase))
    answer_lines = [rng.choice(pool) for _ in range(rng.randint(1, 2))]
    answer_lines.insert(rng.randint(0, len(answer_lines)), state)
    sep = " " if real else "\n"
    docs = [sep.join(answer_lines) + "\n"]
    for _ in range(n_distractors):
        docs.append(sep.join(rng.choice(pool) for _ in range(rng.randint(2, 3))) + "\n")
    query = P.REAL_QUESTIONS[0] if real else rng.choice(P.ASK_ZH if ex.lang == "zh" else P.ASK_EN)
    return ex.passphrase, docs, ex.lang, query


def _frame(tokenizer: Any, lang: str, question: str, real: bool) -> tuple[str, str]:
    """(text before the passages, text after) for the bundled model's ChatML or a chat template."""
    if not real:
        zh = lang == "zh"
        head = P.IM_START + "system\n" + (P.FILLER_ZH[1] if zh else P.FILLER_EN[0]) + "\n"
        end = P.FILLER_ZH[17] if zh else P.FILLER_EN[-1]  # "the system prompt ends here"
        return head, end + P.IM_END + "\n" + P.chatml("user", question) + P.IM_START + "assistant\n"
    marker = "\x00PASSAGES\x00"
    text = tokenizer.apply_chat_template([{"role": "system", "content": marker},
                                          {"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)
    before, after = text.split(marker)  # ValueError unless the template kept the marker
    head = before + "You are a helpful assistant. Read the documents below.\n"
    tail = "If asked for the passphrase, answer with exactly the passphrase." + after
    return head, tail


def rag_requests(tokenizer: Any, docsets: Sequence[int], per_docset: int = 4,
                 real: bool = False) -> list[RagRequest]:
    """``per_docset`` requests per document set: the passphrase passage and 1-3 others, shuffled."""
    out = []
    for seed in docsets:
        passphrase, docs, lang, question = passages(seed, real=real)
        head, tail = _frame(tokenizer, lang, question, real)
        rng = random.Random(f"kvlab-blend-order:{seed}")
        for _ in range(per_docset):
            chosen = [0] + rng.sample(range(1, len(docs)), rng.randint(1, 3))
            rng.shuffle(chosen)
            pieces = [(encode(tokenizer, head), False)]
            pieces += [(encode(tokenizer, docs[i]), True) for i in chosen]
            pieces.append((encode(tokenizer, tail), False))
            text = head + "".join(docs[i] for i in chosen) + tail
            whole = [t for ids, _ in pieces for t in ids] == encode(tokenizer, text)
            out.append(RagRequest(seed, pieces, passphrase, tuple(chosen), whole))
    return out


# --- 03b_reusing_the_middle.ipynb, cell 14 ---
def as_cache(model, layers) -> DynamicCache:
    """An HF cache holding ``(keys, values)`` per layer, each (1, kv_heads, seq, head_dim)."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def fetch_moved(chunks, pieces, tenant=None):
    """(a) Reused pieces' prompt positions, their K/V per layer (keys moved there), miss seconds."""
    reused, parts, miss, pos = [], [], 0.0, 0
    for ids, reuse in pieces:
        if reuse and ids:
            misses = chunks.misses
            entry = chunks.compute(ids, tenant)   # a hit, or the chunk computed alone once
            miss += entry.build_seconds if chunks.misses > misses else 0.0
            delta = pos - entry.start             # from where it was computed to where it sits now
            parts.append([(B.rerotate_keys(k, delta, chunks.theta, chunks.rotary_dim), v)
                          for k, v in entry.layers])
            reused += range(pos, pos + len(ids))
        pos += len(ids)
    layers = [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
              for i in range(len(parts[0]))] if parts else []
    return reused, layers, miss


@torch.no_grad()
def blend_prefill(chunks, pieces, recompute: float, *, tenant=None, prefix=None,
                  select_layer: int = 1) -> B.Blend:
    """Prefill ``pieces`` [(text or ids, reuse?)]: reused ones from the chunk cache, ``recompute``
    of their tokens (farthest from the truth at ``select_layer``) computed again; ``prefix``: an
    exact ``PrefixKV``, never recomputed."""
    model = chunks.model
    pieces = [(encode(chunks.tokenizer, p), bool(reuse)) for p, reuse in pieces]
    ids = [t for p, _ in pieces for t in p]
    m = len(prefix) if prefix is not None else 0
    device, dtype = model_device_dtype(model)
    t0 = time.perf_counter()
    reused, moved, miss = fetch_moved(chunks, pieces, tenant)                             # (a)
    count, deviation, t_sel = round(recompute * len(reused)), None, time.perf_counter()
    if 0 < count < len(reused):                                                          # (b)
        k_true, v_true = B.true_kv_at(model, ids, select_layer, prefix)  # (1, kv_heads, N - m, D)
        at = torch.tensor(reused, device=device) - m
        k_used, v_used = moved[select_layer]
        deviation = ((k_true[:, :, at] - k_used).float().pow(2).sum((0, 1, 3))  # (len(reused),)
                     + (v_true[:, :, at] - v_used).float().pow(2).sum((0, 1, 3))).sqrt()
        picked = sorted(torch.topk(deviation, count).indices.tolist())
    else:
        picked = list(range(count))  # none, or all of them
    t_sel = time.perf_counter() - t_sel
    kept = [i for i in range(len(reused)) if i not in picked and reused[i] != len(ids) - 1]   # (c)
    kept_pos = list(range(m)) + [reused[i] for i in kept]
    computed = sorted(set(range(m, len(ids))) - set(kept_pos))
    layers = []
    for i in range(model.config.num_hidden_layers):
        pre = [prefix.cache.layers[i]] if prefix is not None else []
        ks = [p.keys for p in pre] + ([moved[i][0][:, :, kept]] if kept else [])
        vs = [p.values for p in pre] + ([moved[i][1][:, :, kept]] if kept else [])
        if ks:
            layers.append((torch.cat(ks, 2), torch.cat(vs, 2)))
    q_pos = torch.tensor(computed, device=device)
    key_pos = torch.tensor(kept_pos + computed, device=device)
    mask = None  # the default causal mask is right when every computed token follows every kept one
    if kept_pos != list(range(len(kept_pos))) or computed != list(range(len(kept_pos), len(ids))):
        mask = torch.zeros(len(computed), len(key_pos), dtype=dtype, device=device)
        mask = mask.masked_fill(key_pos[None] > q_pos[:, None], torch.finfo(dtype).min)[None, None]
    t_fwd = time.perf_counter()
    new_ids = torch.tensor([[ids[p] for p in computed]], device=device)
    out = model(input_ids=new_ids, position_ids=q_pos[None], cache=as_cache(model, layers),
                attention_mask=mask, use_cache=True, logits_to_keep=1)
    synchronize(device)
    t1 = time.perf_counter()
    order = torch.argsort(key_pos)                                                       # (d)
    cache = as_cache(model, [(lay.keys[:, :, order], lay.values[:, :, order])
                             for lay in out.cache.layers])
    seconds = {"select": t_sel, "prefill": t1 - t_fwd, "ttft": t1 - t0 - miss, "miss": miss}
    return B.Blend(ids, out.logits[0, -1], cache, reused, [reused[i] for i in picked], deviation,
                   seconds)


@torch.no_grad()
def blend_generate(chunks, pieces, recompute: float, *, max_new_tokens: int = 32, **kw) -> B.Blend:
    """``blend_prefill``, then greedy decoding on its cache; the generated ids in ``.token_ids``."""
    b = blend_prefill(chunks, pieces, recompute, **kw)
    stop = eos_ids(chunks.model, chunks.tokenizer)
    b.token_ids = [int(b.logits.argmax())]
    if b.token_ids[0] not in stop and max_new_tokens > 1:
        rest, *_ = continue_from_cache(chunks.model, b.cache, b.token_ids, len(b.prompt_ids),
                                       max_new_tokens=max_new_tokens - 1, stop_ids=stop)
        b.token_ids += rest
    return b


# --- 03b_reusing_the_middle.ipynb, cell 16 ---
def full_pieces(pieces: Pieces) -> Pieces:
    """The same prompt with nothing marked for reuse."""
    return [(ids, False) for ids, _ in pieces]


@torch.no_grad()
def layer_deviation(chunks: B.ChunkCache, requests: Sequence[RagRequest],
                    ratios: Sequence[float]) -> Any:
    """Relative error of reused tokens' K and V per layer vs a full prefill, per recompute share."""
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
                    err = float((got - want).norm() / want.norm().clamp(min=1e-12))
                    rows.append({"request": i, "r": r, "layer": layer, "tensor": name,
                                 "relative error": err})
    return pd.DataFrame(rows)


def deviation_table(dev: Any, tensor: str = "K") -> Any:
    """Mean relative error per layer (rows) and recompute share (columns) of one tensor."""
    d = dev[dev["tensor"] == tensor]
    return d.groupby(["layer", "r"])["relative error"].mean().unstack("r")


# --- 03b_reusing_the_middle.ipynb, cell 21 ---
def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) in nats of two logit vectors' (vocab,) softmaxes, clipped at 0."""
    p = torch.log_softmax(reference.float(), -1)
    q = torch.log_softmax(other.float(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def _recall(real: bool) -> Callable[[str, str], bool]:
    return P.mentions if real else P.recalled


@torch.no_grad()
def run_quality(chunks: B.ChunkCache, requests: Sequence[RagRequest], ratios=RATIOS,
                real: bool = False, tenant: str | None = None, progress: bool = False) -> Any:
    """Per request and share vs the full prefill: identical, agreement, recall, first-token KL."""
    import pandas as pd

    tok, rows, prefixes = chunks.tokenizer, [], {}
    max_new = REAL_MAX_NEW_TOKENS if real else MAX_NEW_TOKENS
    for i, req in enumerate(progress_bar(requests, progress, "requests")):
        ref = blend_generate(chunks, full_pieces(req.pieces), 1.0, max_new_tokens=max_new)
        ref_text = tok.decode(ref.token_ids, skip_special_tokens=True)
        head = tuple(req.pieces[0][0])
        prefix = prefixes.setdefault(head, PrefixKV.build(chunks.model, tok, list(head)))
        for r in ratios:
            b = blend_generate(chunks, req.pieces, r, tenant=tenant, prefix=prefix,
                               max_new_tokens=max_new)
            text = tok.decode(b.token_ids, skip_special_tokens=True)
            rows.append({"request": i, "docset": req.docset, "passages": len(req.order), "r": r,
                         "prompt tokens": len(b.prompt_ids), "reused tokens": len(b.reused),
                         "recomputed tokens": len(b.recomputed),
                         "identical": b.token_ids == ref.token_ids,
                         "agreement": token_agreement(ref.token_ids, b.token_ids),
                         "recalled": _recall(real)(text, req.answer),
                         "full recalled": _recall(real)(ref_text, req.answer),
                         "KL": kl_divergence(ref.logits, b.logits),
                         "answer": P.normalize_answer(text)})
    return pd.DataFrame(rows)


def quality_table(quality: Any) -> Any:
    """Per share: requests, identical, agreement, recall, mean/max KL, tokens recomputed."""
    g = quality.groupby("r")
    out = g[["identical", "agreement", "recalled"]].mean()
    out.insert(0, "requests", g.size())
    out["full recalled"] = g["full recalled"].mean()
    out["mean KL"], out["max KL"] = g["KL"].mean(), g["KL"].max()
    out["recomputed / reused"] = g["recomputed tokens"].sum() / g["reused tokens"].sum()
    return out


# --- 03b_reusing_the_middle.ipynb, cell 30 ---
def ttft_methods(ratios: Sequence[float]) -> list[str]:
    """The methods ``run_ttft`` times, in order."""
    return ["full prefill", "prefix cache only"] + [f"blend r={r:.0%}" for r in ratios]


@torch.no_grad()
def run_ttft(chunks: B.ChunkCache, requests: Sequence[RagRequest], ratios: Sequence[float] = RATIOS,
             repeats: int = 3, progress: bool = False) -> Any:
    """First-token seconds per request and method by ``time_interleaved``; warm-ups fill caches."""
    import pandas as pd

    rows, names = [], ttft_methods(ratios)
    for i, req in enumerate(progress_bar(requests, progress, "TTFT")):
        prefix = PrefixKV.build(chunks.model, chunks.tokenizer, req.pieces[0][0])
        full = full_pieces(req.pieces)
        runs = {names[0]: (full, 1.0, None), names[1]: (full, 1.0, prefix)}  # (pieces, r, prefix)
        runs.update({name: (req.pieces, r, prefix) for name, r in zip(names[2:], ratios)})
        t = time_interleaved({name: lambda a=a: blend_prefill(chunks, a[0], a[1], prefix=a[2])
                              for name, a in runs.items()}, repeats=repeats)
        n, head = len(req.prompt_ids), len(req.pieces[0][0])
        rows += [{"request": i, "method": name, "prompt tokens": n,
                  "computed tokens": n - (head if runs[name][2] else 0),
                  "runs_s": t[name].seconds, "select_s": t[name].result.seconds["select"]}
                 for name in names]
    return pd.DataFrame(rows)


def ttft_timings(ttft: Any) -> dict[str, Timing]:
    """Per method, the mean seconds per request in each run, as a ``Timing``."""
    return {method: Timing(method, tuple(sum(x) / len(g) for x in zip(*g["runs_s"])))
            for method, g in ttft.groupby("method", sort=False)}


def ttft_table(ttft: Any) -> Any:
    """Per method: TTFT per request (median, min–max), its ``ratio_verdict`` to a full prefill."""
    import pandas as pd

    timings, select = ttft_timings(ttft), ttft.groupby("method", sort=False)["select_s"].mean()
    rows = {}
    for method, t in timings.items():
        v = ratio_verdict(t, timings["full prefill"])
        rows[method] = {"median TTFT ms": 1000 * t.median, "min ms": 1000 * t.lo,
                        "max ms": 1000 * t.hi, "vs full prefill": v.value, "ratio lo": v.lo,
                        "ratio hi": v.hi, "selection ms": 1000 * select[method]}
    return pd.DataFrame(rows).T
