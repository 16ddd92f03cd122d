"""Notebook 03's experiments: what wrong positions (and wrong sharing around them) do to a cached prefix.

Every experiment serves passphrase requests with some cached K/V and compares the greedy answer with
the *isolated* one (the same prompt computed from scratch, ``kvlab.prefix.generate``):

1. ``run_position_sweep``: the prefix's K/V computed at positions shifted by ``s`` while the suffix
   continues at ``len(prefix)`` (a wrong offset), against shifting *every* position by ``s``.
2. the same function's "restart" row: the suffix restarts at position 0 after the cached prefix.
3. ``run_overlap`` / ``layer_errors``: the article's group 2, a middle segment whose K/V come from a
   request that started differently, used as is and with its keys re-rotated (``kvlab.lessons.rope.rerotate``).
4. ``run_group3``: the article's group 3, one system prompt followed by different conversations;
   sharing the prefix only, sharing beyond it, and sharing a cache that a request wrote into.
5. ``run_left_padding``: a batch of requests on one cached prefix, suffixes left-padded; positions
   and the attention mask taken from the padding, or not.

Figures are pure functions of the returned DataFrames. Exercise checkers are at the end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlab.engine.models import encode, eos_ids, model_device_dtype
from kvlab.lessons import passphrase as P
from kvlab.lessons import rope
from kvlab.lessons.common import Verdict, as_number, call_answer, progress_bar, unanswered, verdict
from kvlab.prefix import PrefixKV, continue_from_cache, generate

MAX_NEW_TOKENS = 12  # a passphrase is at most ~10 tokens of this tokenizer, then <|im_end|>


# ----------------------------------------------------------------------------- scoring and a batched loop

def trim_at_stop(ids: Sequence[int], stop_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first stop id."""
    out = []
    for t in ids:
        out.append(int(t))
        if t in stop_ids:
            break
    return out


def token_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Fraction of the reference's generated tokens that ``other`` reproduces at the same step."""
    if not reference:
        raise ValueError("the reference generated no tokens")
    return sum(a == b for a, b in zip(reference, other)) / len(reference)


def prompt_ids(tokenizer: Any, example: P.PassphraseExample) -> tuple[list[int], int]:
    """The prompt's ids and the number of them that belong to the prefix (the system turn)."""
    ids = encode(tokenizer, example.prompt_text)
    n = len(encode(tokenizer, example.prefix_text))
    if ids[:n] != encode(tokenizer, example.prefix_text):
        raise ValueError("the prefix does not tokenize to a prefix of the prompt")
    return ids, n


def isolated(model: Any, tokenizer: Any, prompt: str | Sequence[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """The reference: greedy tokens for a prompt (text or ids) computed from scratch, nothing shared."""
    return generate(model, tokenizer, encode(tokenizer, prompt), max_new_tokens=max_new_tokens).token_ids


def cache_from_layers(model: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A transformers DynamicCache holding the given per-layer (keys, values), each (batch, kv_heads, seq, head_dim)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer (keys, values) of a transformers cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids from a padding mask (batch, seq): each row counts only its real tokens; pads get 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0) * mask.long()


@torch.no_grad()
def greedy_rows(model: Any, cache: Any, input_ids: torch.Tensor, positions: torch.Tensor, stop_ids: set[int],
                max_new_tokens: int = MAX_NEW_TOKENS, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Greedy decoding of a batch in lockstep, every row at its own positions, on top of ``cache``.

    input_ids, positions: (batch, T), prefilled after what ``cache`` holds; ``attention_mask`` covers
    cache + input (batch, past + T), 0 on pads, or None for no padding. ``cache`` is written into.
    """
    out = model(input_ids=input_ids, position_ids=positions, cache=cache, attention_mask=attention_mask,
                use_cache=True, logits_to_keep=1)
    next_pos = positions[:, -1] + 1  # (batch,)
    rows: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    for step in range(max_new_tokens):
        tok = out.logits[:, -1].argmax(-1)  # (batch,)
        for row, t in zip(rows, tok.tolist()):
            row.append(t)
        if all(any(t in stop_ids for t in row) for row in rows) or step == max_new_tokens - 1:
            break
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
        out = model(input_ids=tok[:, None], position_ids=next_pos[:, None], cache=cache,
                    attention_mask=attention_mask, use_cache=True)
        next_pos = next_pos + 1
    return [trim_at_stop(r, stop_ids) for r in rows]


def _score(tokenizer: Any, reference: list[int], gen: list[int], expected: str,
           recall: Callable[[str, str], bool] = P.recalled) -> dict:
    text = tokenizer.decode(gen, skip_special_tokens=True)
    return {"identical": gen == reference, "agreement": token_agreement(reference, gen),
            "recalled": recall(text, expected), "answer": P.normalize_answer(text),
            "isolated recalled": recall(tokenizer.decode(reference, skip_special_tokens=True), expected)}


# ----------------------------------------------------------------------------- experiments 1 and 2

@torch.no_grad()
def last_logits_gap(model: Any, tokenizer: Any, prefix: str, suffix: str, suffix_start: int | None = None) -> float:
    """Max |logit difference| at the last token: full prompt vs cached prefix + suffix at ``suffix_start`` (None = len(prefix))."""
    device, _ = model_device_dtype(model)
    ids = encode(tokenizer, prefix + suffix)
    n = len(encode(tokenizer, prefix))
    start = n if suffix_start is None else suffix_start
    full = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1]  # (vocab,)
    cache = PrefixKV.build(model, tokenizer, ids[:n]).cache
    pos = torch.arange(start, start + len(ids) - n, device=device)[None]
    part = model(input_ids=torch.tensor([ids[n:]], device=device), position_ids=pos, cache=cache,
                 logits_to_keep=1).logits[0, -1]
    return float((full - part).abs().max())


@torch.no_grad()
def answer_with_starts(model: Any, tokenizer: Any, example: P.PassphraseExample, prefix_start: int,
                       suffix_start: int, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The answer when the prefix's K/V are computed at ``prefix_start`` .. and the suffix is prefilled at ``suffix_start`` .."""
    device, _ = model_device_dtype(model)
    ids, n = prompt_ids(tokenizer, example)
    pos = torch.arange(prefix_start, prefix_start + n, device=device)[None]  # (1, P)
    cache = model(input_ids=torch.tensor([ids[:n]], device=device), position_ids=pos, use_cache=True,
                  logits_to_keep=1).cache
    gen, *_ = continue_from_cache(model, cache, ids[n:], suffix_start, max_new_tokens=max_new_tokens,
                                  stop_ids=eos_ids(model, tokenizer))
    return P.normalize_answer(tokenizer.decode(gen, skip_special_tokens=True))


SWEEP_KINDS = ("prefix shifted, suffix at len(prefix)", "suffix after a gap", "everything shifted",
               "suffix restarts at 0")


def variant_starts(kind: str, shift: int, prefix_len: int) -> tuple[int, int]:
    """(first position of the prefix, first position of the suffix) for one kind of the sweep."""
    if kind == SWEEP_KINDS[0]:
        return shift, prefix_len  # every suffix-to-prefix distance is `shift` too short
    if kind == SWEEP_KINDS[1]:
        return 0, prefix_len + shift  # every suffix-to-prefix distance is `shift` too long
    if kind == SWEEP_KINDS[2]:
        return shift, prefix_len + shift  # all distances kept
    if kind == SWEEP_KINDS[3]:
        return 0, 0  # the suffix sits on top of the prefix's first positions
    raise ValueError(f"unknown kind {kind!r}; one of {SWEEP_KINDS}")


def position_variants(shifts: Sequence[int]) -> list[tuple[str, int]]:
    """Rows of the sweep: (kind, shift) for the three shifted kinds and every shift, then the restart."""
    return [(k, s) for k in SWEEP_KINDS[:3] for s in shifts] + [(SWEEP_KINDS[3], 0)]


@torch.no_grad()
def run_position_sweep(model: Any, tokenizer: Any, examples: Sequence[P.PassphraseExample], shifts: Sequence[int],
                       max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False,
                       prompt: Callable[[Any, P.PassphraseExample], tuple[list[int], int]] = None,
                       recall: Callable[[str, str], bool] = P.recalled):
    """Experiments 1 and 2: serve each example with its prefix K/V computed at shifted positions.

    Kinds: "prefix shifted, suffix at len(prefix)" (prefix at s .. s+P-1, suffix at P ..: every
    distance between them is s too short), "suffix after a gap" (prefix at 0 .., suffix at P+s ..:
    s too long), "everything shifted" (prefix at s .., suffix at P+s ..: distances kept),
    "suffix restarts at 0" (prefix at 0 .., suffix at 0 ..). All variants of one example run as one
    batch. Returns a DataFrame, one row per (example, variant).

    ``prompt(tokenizer, example) -> (ids, prefix_len)`` builds the prompt (default ``prompt_ids``, the
    bundled model's ChatML; ``real_prompt_ids`` for a chat model's own template) and ``recall(text,
    expected)`` scores an answer (default exact ``P.recalled``; ``P.mentions`` for a chat model).
    """
    import pandas as pd

    device, _ = model_device_dtype(model)
    stop = eos_ids(model, tokenizer)
    variants = position_variants(shifts)
    prompt = prompt or prompt_ids
    rows = []
    for ex in progress_bar(examples, progress, "shift sweep"):
        ids, n = prompt(tokenizer, ex)
        reference = isolated(model, tokenizer, ids, max_new_tokens)
        pre = torch.tensor([ids[:n]] * len(variants), device=device)  # (R, P)
        suf = torch.tensor([ids[n:]] * len(variants), device=device)  # (R, T)
        starts = [variant_starts(kind, s, n) for kind, s in variants]
        pre_start = torch.tensor([a for a, _ in starts], device=device)
        suf_start = torch.tensor([b for _, b in starts], device=device)
        pre_pos = pre_start[:, None] + torch.arange(n, device=device)  # (R, P)
        suf_pos = suf_start[:, None] + torch.arange(suf.shape[1], device=device)  # (R, T)
        cache = model(input_ids=pre, position_ids=pre_pos, use_cache=True, logits_to_keep=1).cache
        gens = greedy_rows(model, cache, suf, suf_pos, stop, max_new_tokens)
        for (kind, s), st, gen in zip(variants, suf_start.tolist(), gens):
            rows.append({"seed": ex.seed, "lang": ex.lang, "kind": kind, "shift": s, "prefix tokens": n,
                         "suffix start": st, **_score(tokenizer, reference, gen, ex.answer, recall)})
    return pd.DataFrame(rows)


@torch.no_grad()
def shift_key_errors(model: Any, tokenizer: Any, example: P.PassphraseExample, shifts: Sequence[int]) -> dict:
    """Per layer and prefix token, how far the keys of a prefix computed at s .. differ from those at 0 ..

    Returns {shift: {"as is": (layers, P) array, "re-rotated": (layers, P) array}}: the relative
    error of each key vector, before and after ``rope.rerotate(keys, -s)``.
    """
    device, _ = model_device_dtype(model)
    theta = rope.rope_theta(model.config)
    ids = encode(tokenizer, example.prefix_text)
    starts = [0] + list(shifts)
    pos = torch.tensor(starts, device=device)[:, None] + torch.arange(len(ids), device=device)  # (S+1, P)
    cache = model(input_ids=torch.tensor([ids] * len(starts), device=device), position_ids=pos, use_cache=True,
                  logits_to_keep=1).cache
    out = {}
    for i, s in enumerate(starts[1:], start=1):
        as_is, back = [], []
        for k, _ in cache_layers(cache):  # k: (S+1, kv_heads, P, head_dim)
            ref = k[0]
            as_is.append(_rel_per_token(k[i], ref))
            back.append(_rel_per_token(rope.rerotate(k[i:i + 1], -s, theta)[0], ref))
        out[s] = {"as is": torch.stack(as_is).cpu().numpy(), "re-rotated": torch.stack(back).cpu().numpy()}
    return out


def _rel_per_token(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error per token of (kv_heads, P, head_dim) tensors -> (P,)."""
    return (x - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2)).clamp(min=1e-12)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp(min=1e-12))


# ----------------------------------------------------------------------------- experiment 3: group 2

def overlap_pair(tokenizer: Any, seed: int, split: str = "heldout", lang: str | None = None,
                 preamble_lines: tuple[int, int] = (1, 4)) -> dict:
    """Two requests whose system turns share a middle segment but start differently (the article's group 2).

    A's system turn is preamble A + segment, B's is preamble B + segment; the segment is the
    passphrase example's own system text, so both expect the same answer. Returns the token ids:
    ``head_a``, ``head_b`` (ChatML header + preamble), ``segment``, ``tail`` (end of system turn +
    B's question), and ``example``.
    """
    ex = P.make_example(seed, split, lang=lang, history="none", n_filler=3)
    rng = random.Random(f"kvlab-overlap:{split}:{seed}")
    pool = P.FILLER_ZH + P.FILLER_EN
    pre_a = [rng.choice(pool) for _ in range(preamble_lines[0])]
    pre_b = [rng.choice(pool) for _ in range(preamble_lines[1])]
    head = P.IM_START + "system\n"
    parts = {
        "head_a": encode(tokenizer, head + "\n".join(pre_a) + "\n"),
        "head_b": encode(tokenizer, head + "\n".join(pre_b) + "\n"),
        "segment": encode(tokenizer, ex.system),
        "tail": encode(tokenizer, P.IM_END + "\n" + ex.suffix_text),
    }
    return {**parts, "example": ex}


@torch.no_grad()
def overlap_caches(model: Any, pair: dict) -> dict:
    """K/V of the shared segment: as B computes it, as A computed it, and A's re-rotated by Δ = start_b - start_a.

    Returns per-layer lists of (keys, values) for B's full system turn under the three treatments
    ("recomputed", "A's K/V as is", "A's K/V re-rotated"), plus ``delta`` and the segment's span in B.
    """
    device, _ = model_device_dtype(model)
    theta = rope.rope_theta(model.config)
    a_ids, b_ids = pair["head_a"] + pair["segment"], pair["head_b"] + pair["segment"]
    ca = model(input_ids=torch.tensor([a_ids], device=device), use_cache=True, logits_to_keep=1).cache
    cb = model(input_ids=torch.tensor([b_ids], device=device), use_cache=True, logits_to_keep=1).cache
    ha, hb = len(pair["head_a"]), len(pair["head_b"])
    delta = hb - ha
    treatments: dict[str, list] = {"recomputed": [], "A's K/V as is": [], "A's K/V re-rotated": []}
    for (ka, va), (kb, vb) in zip(cache_layers(ca), cache_layers(cb)):
        seg_k, seg_v = ka[:, :, ha:], va[:, :, ha:]  # (1, kv_heads, C, head_dim), computed at ha ..
        head_k, head_v = kb[:, :, :hb], vb[:, :, :hb]  # B's own preamble, computed by B
        treatments["recomputed"].append((kb, vb))
        treatments["A's K/V as is"].append((torch.cat([head_k, seg_k], 2), torch.cat([head_v, seg_v], 2)))
        moved = rope.rerotate(seg_k, delta, theta)
        treatments["A's K/V re-rotated"].append((torch.cat([head_k, moved], 2), torch.cat([head_v, seg_v], 2)))
    return {"treatments": treatments, "delta": delta, "span": (hb, hb + len(pair["segment"]))}


def layer_errors(caches: dict) -> Any:
    """Per-layer relative error of the segment's K and V against B's own, for each treatment (a DataFrame)."""
    import pandas as pd

    lo, hi = caches["span"]
    ref = caches["treatments"]["recomputed"]
    rows = []
    for name in ("A's K/V as is", "A's K/V re-rotated"):
        for layer, ((k, v), (rk, rv)) in enumerate(zip(caches["treatments"][name], ref)):
            for which, x, r in (("K", k, rk), ("V", v, rv)):
                x, r = x[:, :, lo:hi], r[:, :, lo:hi]
                rows.append({"treatment": name, "layer": layer, "tensor": which, "relative error": _rel(x, r),
                             "max abs diff": float((x - r).abs().max())})
    return pd.DataFrame(rows)


@torch.no_grad()
def run_overlap(model: Any, tokenizer: Any, seeds: Sequence[int], split: str = "heldout",
                max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False,
                pair: Callable[[Any, int, str], dict] = None, recall: Callable[[str, str], bool] = P.recalled):
    """Experiment 3: serve request B with the segment K/V recomputed, taken from A as is, and re-rotated.

    Returns ``(outcomes, errors)``: one row per (pair, treatment) scored against B's isolated answer,
    and the per-layer K/V errors of every pair. ``pair(tokenizer, seed, split)`` builds the two
    requests (default ``overlap_pair``; ``real_overlap_pair`` for a chat model), ``recall`` scores.
    """
    make_pair = pair or overlap_pair
    import pandas as pd

    device, _ = model_device_dtype(model)
    stop = eos_ids(model, tokenizer)
    rows, errs = [], []
    for seed in progress_bar(seeds, progress, "group 2 pairs"):
        pair = make_pair(tokenizer, seed, split)
        caches = overlap_caches(model, pair)
        b_ids = pair["head_b"] + pair["segment"] + pair["tail"]
        reference = isolated(model, tokenizer, b_ids, max_new_tokens)
        names = list(caches["treatments"])
        layers = [(torch.cat([caches["treatments"][n][i][0] for n in names]),
                   torch.cat([caches["treatments"][n][i][1] for n in names]))
                  for i in range(len(caches["treatments"]["recomputed"]))]  # batch the 3 treatments
        start = caches["span"][1]
        tail = torch.tensor([pair["tail"]] * len(names), device=device)
        pos = start + torch.arange(tail.shape[1], device=device)[None].expand(len(names), -1)
        gens = greedy_rows(model, cache_from_layers(model, layers), tail, pos, stop, max_new_tokens)
        for name, gen in zip(names, gens):
            rows.append({"seed": seed, "delta": caches["delta"], "treatment": name,
                         **_score(tokenizer, reference, gen, pair["example"].answer, recall)})
        e = layer_errors(caches)
        e.insert(0, "seed", seed)
        errs.append(e)
    return pd.DataFrame(rows), pd.concat(errs, ignore_index=True)


def random_deep_model(tokenizer: Any, num_layers: int = 8, hidden_size: int = 64, seed: int = 0,
                      device: str | torch.device | None = None) -> Any:
    """A random-initialised Qwen2 with more layers than the bundled model, same tokenizer and RoPE base."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device or "cpu").eval()


# ----------------------------------------------------------------------------- experiment 4: group 3

def group3_pair(seed: int, split: str = "heldout", lang: str | None = None) -> tuple[P.PassphraseExample, P.PassphraseExample]:
    """Two requests with the same system prompt and different conversations (the article's group 3).

    A's history changes the passphrase ("update"); B's does not ("none" or "chat", by seed).
    """
    lang = lang or ("zh" if seed % 2 else "en")
    a = P.make_example(seed, split, lang=lang, history="update")
    b = P.make_example(seed, split, lang=lang, history="chat" if seed % 3 == 0 else "none")
    assert a.system == b.system and a.answer != b.answer
    return a, b


def _history_text(example: P.PassphraseExample) -> str:
    """The turns before the final question, in ChatML."""
    return "".join(P.chatml("user", t.user) + P.chatml("assistant", t.assistant) for t in example.turns[:-1])


def _question_text(example: P.PassphraseExample) -> str:
    return P.chatml("user", example.turns[-1].user) + P.IM_START + "assistant\n"


@torch.no_grad()
def run_group3(model: Any, tokenizer: Any, seeds: Sequence[int], split: str = "heldout",
               max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False):
    """Experiment 4: share the identical prefix (right), share beyond it, share a cache A wrote into.

    Scored for request B against its isolated answer; "answers A's" says whether B answered A's
    updated passphrase. The right way is also run for A. One row per (pair, way).
    """
    import pandas as pd

    stop = eos_ids(model, tokenizer)
    rows = []
    for seed in progress_bar(seeds, progress, "group 3 pairs"):
        a, b = group3_pair(seed, split)
        shared = PrefixKV.build(model, tokenizer, b.prefix_text)
        n = len(shared)
        ref_b = isolated(model, tokenizer, b.prompt_text, max_new_tokens)
        ref_a = isolated(model, tokenizer, a.prompt_text, max_new_tokens)
        ways = {}
        ways["A: shared prefix (fork)"] = (a, ref_a, generate(model, tokenizer, a.prompt_text, prefix_kv=shared,
                                                              max_new_tokens=max_new_tokens).token_ids)
        ways["B: shared prefix (fork)"] = (b, ref_b, generate(model, tokenizer, b.prompt_text, prefix_kv=shared,
                                                              max_new_tokens=max_new_tokens).token_ids)
        # Wrong 1: the cache entry holds A's system turn *and* A's history; B reuses all of it.
        a_ctx = encode(tokenizer, a.prefix_text + _history_text(a))
        beyond = PrefixKV.build(model, tokenizer, a_ctx).cache
        gen, *_ = continue_from_cache(model, beyond, encode(tokenizer, _question_text(b)), len(a_ctx),
                                      max_new_tokens=max_new_tokens, stop_ids=stop)
        ways["B: shared beyond the prefix (A's history)"] = (b, ref_b, gen)
        # Wrong 2: A runs on the shared cache without forking it; B is then served from the same object.
        polluted = shared.fork().cache  # a stand-in for the shared object, so `shared` stays clean here
        continue_from_cache(model, polluted, encode(tokenizer, a.suffix_text), n, max_new_tokens=max_new_tokens,
                            stop_ids=stop)
        gen, *_ = continue_from_cache(model, polluted, encode(tokenizer, b.suffix_text), n,
                                      max_new_tokens=max_new_tokens, stop_ids=stop)
        ways["B: shared cache that A wrote into"] = (b, ref_b, gen)
        for way, (ex, ref, gen) in ways.items():
            text = tokenizer.decode(gen, skip_special_tokens=True)
            rows.append({"seed": seed, "way": way, "history": ex.extra["history"],
                         **_score(tokenizer, ref, gen, ex.answer),
                         "answers A's": ex is b and P.recalled(text, a.answer)})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- experiment 5: left padding

def padding_batch(seed: int, split: str = "heldout", size: int = 4) -> list[P.PassphraseExample]:
    """``size`` requests on one system prompt whose suffixes differ in length (histories and questions)."""
    lang = "zh" if seed % 2 else "en"
    histories = ("none", "update", "chat", "none")
    asks = P.ASK_ZH if lang == "zh" else P.ASK_EN
    out = [P.with_question(P.make_example(seed, split, lang=lang, history=histories[i % len(histories)]),
                           asks[i % len(asks)]) for i in range(size)]
    assert len({e.system for e in out}) == 1, "the batch must share one system prompt"
    return out


PADDING_WAYS = (
    ("mask + positions from the mask", True, True),
    ("mask, positions count the pads", True, False),
    ("no mask, positions from the mask", False, True),
    ("no mask, positions count the pads", False, False),
)


@torch.no_grad()
def run_left_padding(model: Any, tokenizer: Any, seeds: Sequence[int], split: str = "heldout", size: int = 4,
                     extra_pads: int = 0, max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False):
    """Experiment 5: a batch of requests on one cached prefix, suffixes left-padded to one length.

    Layout of each row: [prefix K/V (cached once)] [pads] [suffix]. Four ways: with or without the
    padding mask, positions from the mask or counted over the pads. ``extra_pads`` pads every row
    further, as when the batch also holds a request that much longer. One row per (request, way).
    """
    import pandas as pd

    device, _ = model_device_dtype(model)
    stop = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    rows = []
    for seed in progress_bar(seeds, progress, f"padded batches, {extra_pads} extra pads"):
        reqs = padding_batch(seed, split, size)
        prefix = PrefixKV.build(model, tokenizer, reqs[0].prefix_text)
        n = len(prefix)
        suffixes = [encode(tokenizer, r.suffix_text) for r in reqs]
        width = max(map(len, suffixes)) + extra_pads
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in suffixes], device=device)  # (B, width)
        mask = torch.tensor([[1] * n + [0] * (width - len(s)) + [1] * len(s) for s in suffixes], device=device)
        refs = [isolated(model, tokenizer, encode(tokenizer, r.prompt_text), max_new_tokens) for r in reqs]
        for way, use_mask, from_mask in PADDING_WAYS:
            cache = cache_from_layers(model, [(k.expand(len(reqs), -1, -1, -1).contiguous(),
                                               v.expand(len(reqs), -1, -1, -1).contiguous())
                                              for k, v in cache_layers(prefix.fork().cache)])
            if from_mask:
                pos = positions_from_mask(mask)[:, n:]  # (B, width): pads get 0, real tokens n, n+1, ...
            else:
                pos = (n + torch.arange(width, device=device))[None].expand(len(reqs), -1)
            gens = greedy_rows(model, cache, ids, pos, stop, max_new_tokens, attention_mask=mask if use_mask else None)
            for r, s, ref, gen in zip(reqs, suffixes, refs, gens):
                rows.append({"seed": seed, "extra pads": extra_pads, "way": way, "pads": width - len(s),
                             "history": r.extra["history"],
                             **_score(tokenizer, ref, gen, r.answer)})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- a real chat model (SmolLM2)

REAL_MAX_NEW_TOKENS = 20  # "The passphrase is: X5DUXP." and the end of turn fit


def real_prompt_ids(tokenizer: Any, example: P.PassphraseExample,
                    question: str = P.REAL_QUESTIONS[0]) -> tuple[list[int], int]:
    """A chat model's prompt (``P.real_model_prompt``: its own chat template) and the length of its system turn.

    The prefix is the system turn up to and including its end-of-turn line, as a serving system would
    cache it for every user question after it.
    """
    text = P.real_model_prompt(tokenizer, example, question)
    cut = text.index(P.IM_END) + len(P.IM_END)
    if text[cut:cut + 1] == "\n":
        cut += 1
    ids, prefix = encode(tokenizer, text), encode(tokenizer, text[:cut])
    if ids[:len(prefix)] != prefix:
        raise ValueError("the system turn does not tokenize to a prefix of the prompt")
    return ids, len(prefix)


def real_overlap_pair(tokenizer: Any, seed: int, split: str = "heldout", question: str = P.REAL_QUESTIONS[0],
                      preamble_lines: tuple[int, int] = (1, 4)) -> dict:
    """The article's group 2 in a chat model's template: one plain system text after two different preambles.

    Same keys as ``overlap_pair``: ``head_a``/``head_b`` (template header + English preamble sentences),
    ``segment`` (``P.REAL_SYSTEM`` with the passphrase), ``tail`` (end of system turn, the question,
    the assistant header), ``example``.
    """
    ex = P.make_example(seed, split, history="none")
    text = P.real_model_prompt(tokenizer, ex, question)
    content = P.REAL_SYSTEM.format(p=ex.passphrase)
    at = text.index(content)
    rng = random.Random(f"kvlab-real-overlap:{split}:{seed}")
    pre_a = [rng.choice(P.FILLER_EN) for _ in range(preamble_lines[0])]
    pre_b = [rng.choice(P.FILLER_EN) for _ in range(preamble_lines[1])]
    parts = {
        "head_a": encode(tokenizer, text[:at] + " ".join(pre_a) + " "),
        "head_b": encode(tokenizer, text[:at] + " ".join(pre_b) + " "),
        "segment": encode(tokenizer, content),
        "tail": encode(tokenizer, text[at + len(content):]),
    }
    return {**parts, "example": ex}


def bug_rows(sweep: Any, overlap: Any, shifts: Sequence[int]) -> Any:
    """One row per position bug (and the references) from a model's sweep and group-2 outcomes.

    Columns: requests, identical (token-identical to isolated), agreement, recall. The first row is the
    isolated run itself (recall only), the second the cached prefix at the right positions.
    """
    import pandas as pd

    def row(name, d):
        return {"case": name, "requests": len(d), "identical": d["identical"].mean(),
                "agreement": d["agreement"].mean(), "recall": d["recalled"].mean()}

    def kind(k, s):
        return sweep[(sweep["kind"] == k) & (sweep["shift"] == s)]

    first = kind(SWEEP_KINDS[0], 0)
    rows = [{"case": "isolated (no cache): the reference", "requests": len(first), "identical": 1.0,
             "agreement": 1.0, "recall": first["isolated recalled"].mean()},
            row("cached prefix, right positions", first)]
    rows += [row(f"shifted offset: prefix at +{s}, suffix at len(prefix)", kind(SWEEP_KINDS[0], s)) for s in shifts]
    rows += [row(f"control: everything shifted by {max(shifts)}", kind(SWEEP_KINDS[2], max(shifts)))]
    rows += [row("restarted positions: suffix at 0", sweep[sweep["kind"] == SWEEP_KINDS[3]])]
    for t, name in (("A's K/V as is", "overlap segment from A, as is"),
                    ("A's K/V re-rotated", "overlap segment from A, re-rotated by Δ")):
        rows.append(row(name, overlap[overlap["treatment"] == t]))
    return pd.DataFrame(rows).set_index("case")


def run_position_checks(model: Any, tokenizer: Any, n: int, shift: int, seed: int = 0, chat: bool = False) -> tuple:
    """Small versions of experiments 1-3 for a decision table: ``(sweep, overlap outcomes)`` on ``n`` prompts.

    The sweep runs every kind at ``shift`` (plus the restart at 0); ``chat=True`` uses a chat model's own
    template and loose recall (``real_prompt_ids``, ``real_overlap_pair``, ``P.mentions``), as for SmolLM2.
    """
    examples = P.make_examples(n, "heldout", start=700 + seed, history="none")
    seeds = range(900 + seed, 900 + seed + n)
    if not chat:
        return run_position_sweep(model, tokenizer, examples, [shift]), run_overlap(model, tokenizer, seeds)[0]
    sweep = run_position_sweep(model, tokenizer, examples, [shift], REAL_MAX_NEW_TOKENS, prompt=real_prompt_ids,
                               recall=P.mentions)
    overlap, _ = run_overlap(model, tokenizer, seeds, "heldout", REAL_MAX_NEW_TOKENS, pair=real_overlap_pair,
                             recall=P.mentions)
    return sweep, overlap


def sensitivity_line(bug: str, identical: dict[str, tuple[float, int]]) -> str:
    """One printed line comparing how often a position bug kept each model's answers token-identical.

    ``identical`` maps a model's name to (share of answers token-identical to its isolated answer,
    number of requests); the verdict names the model whose answers the bug changed most often.
    """
    if not identical:
        raise ValueError("no model to compare")
    parts = ", ".join(f"{name} {share:.0%} of {n}" for name, (share, n) in identical.items())
    lowest = min(share for share, _ in identical.values())
    if all(share == 1 for share, _ in identical.values()):
        verdict = "no answer changed on these prompts (the logits still moved: the computation is wrong)"
    elif sum(share == lowest for share, _ in identical.values()) > 1:
        verdict = "it changes these models' answers equally often"
    else:
        who = next(name for name, (share, _) in identical.items() if share == lowest)
        verdict = f"it changes {who}'s answers most often" if len(identical) > 2 else \
            f"it changes {who}'s answers more often"
    return f"{bug}: token-identical to the isolated answer: {parts} -> {verdict}"


# ----------------------------------------------------------------------------- summaries and figures

def sweep_mean(sweep: Any, kind: str, shift: int, metric: str = "recalled") -> float:
    """Mean of ``metric`` over the sweep's rows of one kind and shift."""
    d = sweep[(sweep["kind"] == kind) & (sweep["shift"] == shift)]
    if d.empty:
        raise KeyError(f"no rows for kind {kind!r} and shift {shift}")
    return float(d[metric].mean())


def mean_layer_error(errors: Any, treatment: str, tensor: str, layer: int) -> float:
    """Mean relative error of one treatment, tensor ("K"/"V") and layer in a ``layer_errors`` table."""
    d = errors[(errors["treatment"] == treatment) & (errors["tensor"] == tensor) & (errors["layer"] == layer)]
    return float(d["relative error"].mean())


def summarize(df: Any, by: str | list[str]) -> Any:
    """Mean identical / agreement / recall per group, with the number of requests."""
    g = df.groupby(by, sort=False)
    out = g[["identical", "agreement", "recalled"]].mean()
    out.insert(0, "requests", g.size())
    return out


def fig_shift_sweep(sweep: Any):
    """Recall and token agreement vs shift, for a shifted prefix and for everything shifted (a Figure)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    restart = sweep[sweep["kind"] == SWEEP_KINDS[3]]
    for ax, metric, label in ((axes[0], "agreement", "token agreement with isolated"),
                              (axes[1], "recalled", "passphrase recall")):
        for kind, style in zip(SWEEP_KINDS[:3], ("o-", "^-", "s--")):
            d = sweep[sweep["kind"] == kind].groupby("shift")[metric].mean()
            ax.plot([max(s, 0.5) for s in d.index], d.values, style, label=kind)
        ax.axhline(restart[metric].mean(), color="grey", ls=":", label="suffix restarts at 0")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position error s (tokens; 0 drawn at 0.5)")
        ax.set_ylabel(label)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(label)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("A cached prefix and its suffix at wrong distances (s) or all moved by s")
    fig.tight_layout()
    return fig


def fig_shift_explorer(sweep: Any, key_errors: dict, shift: int, layer: int):
    """The widget's view: the sweep with ``shift`` marked, and per-token key error at ``layer`` (a Figure)."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6))
    d = sweep[sweep["kind"] == "prefix shifted, suffix at len(prefix)"].groupby("shift")[["agreement", "recalled"]].mean()
    ax0.plot([max(s, 0.5) for s in d.index], d["agreement"], "o-", label="token agreement")
    ax0.plot([max(s, 0.5) for s in d.index], d["recalled"], "s--", label="recall")
    ax0.axvline(max(shift, 0.5), color="red", lw=1)
    ax0.set_xscale("log", base=2)
    ax0.set(xlabel="shift s (tokens)", ylabel="fraction", ylim=(-0.03, 1.03),
            title="prefix at s.., suffix at len(prefix)")
    ax0.legend(fontsize=8)
    err = key_errors[shift]
    ax1.plot(err["as is"][layer], label=f"keys computed at s={shift}, as is")
    ax1.plot(err["re-rotated"][layer], label=f"re-rotated by -{shift}")
    ax1.set_yscale("symlog", linthresh=1e-7)
    ax1.set(xlabel="prefix token", ylabel="relative error of the key", title=f"layer {layer}: keys vs positions 0..")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_layer_errors(errors: dict[str, Any]):
    """Per-layer relative error of the reused segment's K and V, one panel per model (a Figure)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(errors), figsize=(5 * len(errors), 3.6), squeeze=False)
    for ax, (name, df) in zip(axes[0], errors.items()):
        m = df.groupby(["treatment", "tensor", "layer"])["relative error"].mean()
        for (treatment, tensor), style, label in (
                (("A's K/V as is", "K"), "o-", "K as is"), (("A's K/V re-rotated", "K"), "s-", "K re-rotated by Δ"),
                (("A's K/V as is", "V"), "^--", "V (no rotation to undo)")):
            d = m.loc[(treatment, tensor)]
            ax.plot(d.index, d.values.clip(1e-9), style, label=label)
        ax.set_yscale("log")
        ax.set(xlabel="layer", ylabel="relative error vs recomputed\n(0 drawn at 1e-9)", title=name)
        layers = sorted(df["layer"].unique())
        ax.set_xticks(layers[::-(-len(layers) // 15)])  # at most 15 ticks: 30 layers would overlap
        ax.legend(fontsize=8)
    fig.suptitle("Group 2: a segment's K/V taken from a request that started differently")
    fig.tight_layout()
    return fig


def fig_outcomes(summary: Any, title: str):
    """Horizontal bars of token-identical and recall fractions per way (a Figure)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.6 * len(summary)))
    y = range(len(summary))
    for dy, col, name in ((0.2, "identical", "token-identical to isolated"), (-0.2, "recalled", "recall")):
        bars = ax.barh([i + dy for i in y], summary[col], height=0.4, label=name)
        ax.bar_label(bars, labels=[f"{v:.0%}" for v in summary[col]], padding=2, fontsize=8)  # a 0 bar still shows "0%"
    labels = [" | ".join(map(str, i)) if isinstance(i, tuple) else str(i) for i in summary.index]
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1.12), xlabel="fraction of requests")
    ax.set_title(title, pad=26)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)  # above the bars
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- exercise checkers

def _int_list(answer: Any) -> list[int] | None:
    try:
        return [int(x) for x in answer]
    except (TypeError, ValueError):
        return None


def check_suffix_positions(answer: Sequence[int] | None, prefix_len: int, suffix_len: int) -> Verdict:
    """Exercise 03.1: the position ids of a suffix prefilled after a cached prefix of ``prefix_len`` tokens."""
    hint = ("the cache holds positions 0 .. prefix_len - 1, so the suffix continues where the prefix ended, "
            "one position per suffix token")
    if answer is None:
        return unanswered(hint)
    got = _int_list(answer)
    if got is None:
        return verdict(False, hint=f"give a list of position ids, not {answer!r}")
    if len(got) != suffix_len:
        return verdict(False, hint=f"one position id per suffix token: {len(got)} ids for {suffix_len} tokens")
    expected = list(range(prefix_len, prefix_len + suffix_len))
    return verdict(got == expected, f"the suffix continues at position {prefix_len}", hint)


def check_rerotation_delta(answer: int | None, start_in_a: int, start_in_b: int) -> Verdict:
    """Exercise 03.2: by how much must keys cached at ``start_in_a`` .. be rotated to serve at ``start_in_b`` ..?"""
    hint = "rotate from the position the keys were computed at to the position they are needed at; the sign matters"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of positions, not {answer!r}")
    return verdict(value == start_in_b - start_in_a, f"delta {value}: new start - old start", hint)


def check_positions_from_mask(fn: Callable[[torch.Tensor], torch.Tensor] | None) -> Verdict:
    """Exercise 03.3: ``fn(mask)`` must give each real token its index among the real tokens of its row."""
    hint = "in each row, real tokens (mask 1) count 0, 1, 2, ... and pads (mask 0) are skipped; try cumsum"
    masks = [torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), torch.tensor([[1, 1, 0, 0, 1, 1]])]
    for m in masks:
        out, failed = call_answer(fn, m, hint=hint, name="my_positions")
        if failed is not None:
            return failed
        got = torch.as_tensor(out)
        want = positions_from_mask(m)
        if got.shape != m.shape:
            return verdict(False, hint=f"for a mask of shape {tuple(m.shape)} return the same shape, "
                                       f"not {tuple(got.shape)}")
        if not torch.equal(got[m.bool()].long(), want[m.bool()]):
            return verdict(False, hint=f"for mask {m.tolist()} your positions of the real tokens are "
                                       f"{got[m.bool()].tolist()}; {hint}")
    return verdict(True, "positions of real tokens count only real tokens")


def check_exact_layers(answer: Sequence[int] | None, errors: Any, tol: float = 2e-2) -> Verdict:
    """Exercise 03.4: which layers' keys are exact after re-rotation (per ``layer_errors`` output)?

    "Exact" means a relative error below ``tol``: float rounding in float32 (~1e-6) and in 16-bit
    dtypes (~1e-2) passes, a key that encodes another context (~1e-1 and more) does not.
    """
    hint = ("read the re-rotated K rows of the error table: a layer is exact when its relative error is float "
            f"rounding, orders of magnitude below the other layers' (the checker's cut-off, {tol}, also lets "
            "16-bit dtypes through)")
    if answer is None:
        return unanswered(hint)
    got = _int_list(answer)
    if got is None:
        return verdict(False, hint=f"give a list of layer indices, not {answer!r}")
    d = errors[(errors["treatment"] == "A's K/V re-rotated") & (errors["tensor"] == "K")]
    worst = d.groupby("layer")["relative error"].max()
    expected = sorted(int(i) for i in worst.index if worst[i] < tol)
    return verdict(sorted(got) == expected, f"layers {expected}", hint)


def rotation_pairs(key: torch.Tensor, shift: int, theta: float = 10000.0,
                   pairs: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """For some (i, i + head_dim/2) pairs of a RoPE'd ``key`` (head_dim,): its 2-D point before and after
    moving it ``shift`` positions with ``rope.rerotate``, and the angle RoPE turns that pair by."""
    key = key.detach().float().cpu().reshape(-1)
    half = key.numel() // 2
    moved = rope.rerotate(key.reshape(1, 1, 1, -1), shift, theta).reshape(-1)
    inv = rope.inverse_frequencies(key.numel(), theta)
    pairs = [0, half // 2, half - 1] if pairs is None else list(pairs)
    return [{"pair": i, "before": (float(key[i]), float(key[i + half])),
             "after": (float(moved[i]), float(moved[i + half])), "angle": float(shift * inv[i])} for i in pairs]


def fig_rope_rotation(key: torch.Tensor, position: int, shift: int, theta: float = 10000.0,
                      pairs: Sequence[int] | None = None) -> Any:
    """RoPE as a rotation: a cached key at ``position`` and the same key moved to ``position + shift``,
    one panel per dimension pair (fast pairs turn far, slow pairs barely move)."""
    import math

    import matplotlib.pyplot as plt

    rows = rotation_pairs(key, shift, theta, pairs)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.6), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        lim = 1.15 * max(math.hypot(*r["before"]), 1e-6)
        for (x, y), color, gid in ((r["before"], "C0", "before"), (r["after"], "C3", "after")):
            ax.annotate("", xy=(x, y), xytext=(0, 0), arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2})
            ax.plot([x], [y], "o", color=color, markersize=3, gid=gid)
        turned = math.degrees(r["angle"]) % 360
        ax.set_title(f"pair {r['pair']}: turned {turned:.1f}°", fontsize=9)
        ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.set_xlabel(f"dim {r['pair']}", fontsize=8)
        ax.set_ylabel(f"dim {r['pair'] + key.numel() // 2}", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"one cached key moved from position {position} (blue) to {position + shift} (red): "
                 "each pair turns by shift x its frequency; the length stays", fontsize=10)
    fig.tight_layout()
    return fig
