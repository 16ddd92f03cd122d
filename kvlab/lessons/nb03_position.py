"""Notebook 03 (position encoding): the position experiment behind its verdicts, figures and
exercise checkers."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import torch

from kvlab.built import nb03
from kvlab.engine.models import encode, eos_ids, model_device_dtype
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import Verdict, as_number, call_answer, unanswered, verdict

# exercise 03.3's and build 03's references
from kvlab.lessons.solutions import build_03_rope_suffix as solution_rope_suffix  # noqa: F401 (the notebook's fallback)
from kvlab.lessons.solutions import ex03_3_positions_from_mask as positions_from_mask

# ----------------------------------------------------------------------------- the prompts

RIGHT, SHIFTED, ALL_SHIFTED, RESTART = ("cached prefix, right positions",
                                        "prefix at +s, suffix at len(prefix)",
                                        "everything at +s", "suffix restarts at 0")
AS_IS, REROTATED = "group 2: A's segment K/V as is", "group 2: A's segment K/V re-rotated by Δ"
CASES = (RIGHT, SHIFTED, ALL_SHIFTED, RESTART, AS_IS, REROTATED)
PREAMBLES = ("Answer briefly.",
             "The weather today is sunny and mild. The meeting starts at three. Answer briefly.")


def chat_prompt(tokenizer: Any, example: P.PassphraseExample) -> tuple[list[int], int]:
    """``P.real_model_prompt`` in the model's own chat template, and the length of its system turn
    (the prefix)."""
    text = P.real_model_prompt(tokenizer, example)
    # the system turn and its newline: what a server caches
    cut = text.index(P.IM_END) + len(P.IM_END) + 1
    ids, prefix = encode(tokenizer, text), encode(tokenizer, text[:cut])
    if ids[:len(prefix)] != prefix:
        raise ValueError("the system turn does not tokenize to a prefix of the prompt")
    return ids, len(prefix)


def overlap_ids(tokenizer: Any, example: P.PassphraseExample) -> dict[str, list[int]]:
    """Group 2: token ids of ``head_a``/``head_b`` (template header + a short/long preamble),
    ``segment`` (the system text with the passphrase, the same in A and B) and ``tail`` (end of
    system turn, question, assistant header)."""
    text = P.real_model_prompt(tokenizer, example)
    content = P.REAL_SYSTEM.format(p=example.passphrase)
    at = text.index(content)
    return {"head_a": encode(tokenizer, text[:at] + PREAMBLES[0] + " "),
            "head_b": encode(tokenizer, text[:at] + PREAMBLES[1] + " "),
            "segment": encode(tokenizer, content),
            "tail": encode(tokenizer, text[at + len(content):])}


def same_shape_examples(tokenizer: Any, n: int, seed: int = 0) -> list[P.PassphraseExample]:
    """``n`` held-out examples whose prompts have one token layout, so they run as one batch without
    padding."""
    pool = P.make_examples(10 * n, "heldout", start=1000 + 97 * seed, history="none")
    shapes = [(len(chat_prompt(tokenizer, e)[0]), chat_prompt(tokenizer, e)[1],
               *(len(v) for v in overlap_ids(tokenizer, e).values())) for e in pool]
    common = Counter(shapes).most_common(1)[0][0]
    picked = [e for e, s in zip(pool, shapes) if s == common][:n]
    if len(picked) < n:
        raise ValueError(f"only {len(picked)} of {len(pool)} prompts share one layout; ask for "
                         f"fewer than {n}")
    return picked


# ----------------------------------------------------------------------------- the experiment

@torch.no_grad()
def greedy_batch(model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
                 new_tokens: int):
    """Greedy decoding in lockstep on ``cache`` (written into), every row at its own positions: ids,
    positions (batch, T) -> (generated ids (batch, new_tokens), first-token logits (batch,
    vocab))."""
    out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                logits_to_keep=1)
    first, pos, toks = out.logits[:, -1].float(), positions[:, -1:], []
    for _ in range(new_tokens):
        toks.append(out.logits[:, -1].argmax(-1, keepdim=True))  # (batch, 1)
        pos = pos + 1
        if len(toks) < new_tokens:
            out = model(input_ids=toks[-1], position_ids=pos, cache=cache, use_cache=True)
    return torch.cat(toks, 1), first


def _trim(ids: Sequence[int], stop: set[int]) -> list[int]:
    out = []
    for t in ids:
        out.append(int(t))
        if t in stop:
            break
    return out


def _rel(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error per batch row: (batch, ...) -> (batch,)."""
    return (x - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp(min=1e-12)


@torch.no_grad()
def position_experiment(model: Any, tokenizer: Any, n: int = 24, shift: int = 1024,
                        new_tokens: int = 10,
                        seed: int = 0) -> tuple[Any, Any]:
    """Every position case of ``CASES`` on ``n`` prompts, scored against the isolated answer:
    ``(rows, layer_errors)``. Group 2: B's segment K/V replaced by A's (computed after another
    preamble), as is and re-rotated by Δ."""
    import pandas as pd
    from transformers import DynamicCache

    device, _ = model_device_dtype(model)
    theta, stop = nb03.rope_theta(model.config), eos_ids(model, tokenizer)
    examples = same_shape_examples(tokenizer, n, seed)
    ids = torch.tensor([chat_prompt(tokenizer, e)[0] for e in examples], device=device)  # (n, L)
    p, length = chat_prompt(tokenizer, examples[0])[1], ids.shape[1]

    def at(start, count, rows=n):  # positions start .. start+count-1 for every row: (rows, count)
        return (start + torch.arange(count, device=device)).expand(rows, -1)

    ref, ref_first = greedy_batch(model, DynamicCache(config=model.config), ids, at(0, length),
                                  new_tokens)
    # the system turn's K/V at 0.. (rows 0..n-1) and at shift.. (rows n..2n-1); each case picks its
    # rows
    cache = model(input_ids=ids[:, :p].repeat(2, 1),
                  position_ids=torch.cat([at(0, p), at(shift, p)]),
                  use_cache=True, logits_to_keep=1).cache
    # (rows, suffix start)
    layout = {RIGHT: (0, p), SHIFTED: (n, p), ALL_SHIFTED: (n, p + shift), RESTART: (0, 0)}
    cache.reorder_cache(torch.cat([torch.arange(n, device=device) + r for r, _ in layout.values()]))
    gen, first = greedy_batch(model, cache, ids[:, p:].repeat(len(layout), 1),
                              torch.cat([at(s, length - p) for _, s in layout.values()]),
                              new_tokens)
    # group 2: B's cache of head_b + segment, three times: B's own, A's segment as is, A's segment
    # re-rotated
    pairs = [overlap_ids(tokenizer, e) for e in examples]
    ha, hb, c = (len(pairs[0][k]) for k in ("head_a", "head_b", "segment"))
    a = model(input_ids=torch.tensor([x["head_a"] + x["segment"] for x in pairs], device=device),
              use_cache=True, logits_to_keep=1).cache
    b = model(input_ids=torch.tensor([x["head_b"] + x["segment"] for x in pairs], device=device),
              use_cache=True, logits_to_keep=1).cache
    b.reorder_cache(torch.arange(n, device=device).repeat(3))
    errors = []
    for layer, (bl, al) in enumerate(zip(b.layers, a.layers)):
        # (n, kv_heads, c, head_dim), computed at ha..
        seg_k, seg_v = al.keys[:, :, ha:], al.values[:, :, ha:]
        own_k, own_v = bl.keys[:n, :, hb:].clone(), bl.values[:n, :, hb:].clone()
        bl.keys[n:2 * n, :, hb:], bl.keys[2 * n:, :, hb:] = (seg_k,
                                                             nb03.rerotate(seg_k, hb - ha, theta))
        bl.values[n:, :, hb:] = seg_v.repeat(2, 1, 1, 1)
        for case, k in ((AS_IS, seg_k), (REROTATED, bl.keys[2 * n:, :, hb:])):
            errors.append({"treatment": case, "layer": layer, "tensor": "K",
                           "relative error": float(_rel(k, own_k).mean())})
        errors.append({"treatment": AS_IS, "layer": layer, "tensor": "V",
                       "relative error": float(_rel(seg_v, own_v).mean())})
    tail = torch.tensor([x["tail"] for x in pairs], device=device).repeat(3, 1)
    gen2, first2 = greedy_batch(model, b, tail, at(hb + c, tail.shape[1], 3 * n), new_tokens)
    # one row per (prompt, case), scored against the isolated answer (group 2: against B on its own
    # cache)
    refs = {case: (ref, ref_first) for case in layout} | {case: (gen2[:n], first2[:n])
                                                          for case in (AS_IS, REROTATED)}
    outs = {case: (gen[i * n:(i + 1) * n], first[i * n:(i + 1) * n])
            for i, case in enumerate(layout)}
    outs |= {AS_IS: (gen2[n:2 * n], first2[n:2 * n]), REROTATED: (gen2[2 * n:], first2[2 * n:])}
    rows = []
    for case, (g, f) in outs.items():
        r, rf = refs[case]
        for i, e in enumerate(examples):
            want, got = _trim(r[i].tolist(), stop), _trim(g[i].tolist(), stop)
            text = tokenizer.decode(got, skip_special_tokens=True)
            rows.append({"prompt": e.seed, "case": case,
                         "shift": shift if case in (SHIFTED, ALL_SHIFTED) else 0,
                         "identical": got == want, "agreement": nb03.token_agreement(want, got),
                         "recalled": P.mentions(text, e.passphrase),
                         "isolated recalled": P.mentions(tokenizer.decode(
                             want, skip_special_tokens=True), e.passphrase),
                         "logit gap": float((f[i] - rf[i]).abs().max()),
                         "answer": P.normalize_answer(text)})
    return pd.DataFrame(rows), pd.DataFrame(errors)


def position_table(rows: Any) -> Any:
    """Per case: prompts, share token-identical to the isolated answer, agreement, recall, largest
    first-token logit gap."""
    g = rows.groupby("case", sort=False)
    out = g[["identical", "agreement", "recalled"]].mean()
    out.insert(0, "prompts", g.size())
    out["max |Δ logit|, first token"] = g["logit gap"].max()
    return out.reindex([c for c in CASES if c in out.index])


def _share(table: Any, case: str) -> str:
    k, n = (round(table.loc[case, "identical"] * table.loc[case, "prompts"]),
            int(table.loc[case, "prompts"]))
    return f"{k}/{n} identical"


def position_verdicts(table: Any, errors: Any, shift: int) -> list[str]:
    """The verdict lines of the position experiment, each read from ``table`` and ``errors`` (one
    per claim)."""
    ident, n = table["identical"], int(table["prompts"].min())
    # answers between the two shifted cases
    apart = round(abs(ident[ALL_SHIFTED] - ident[SHIFTED]) * n)
    k = errors[(errors["tensor"] == "K") & (errors["treatment"] == REROTATED)].set_index(
        "layer")["relative error"]
    deep = k.drop(index=0)
    return [
        f"control: cached prefix at the right positions → {_share(table, RIGHT)} (first-token "
        f"logits within {table.loc[RIGHT, 'max |Δ logit|, first token']:.0e}) → "
        + ("the cache is the isolated computation" if ident[RIGHT] == 1
           else "even the right positions differ: a tie broke"),
        f"equal starts? prefix at +{shift}, suffix at len(prefix) → {_share(table, SHIFTED)}; "
        f"everything at +{shift} → {_share(table, ALL_SHIFTED)} → "
        + (f"RoPE needs equal distances, not equal starts ({apart} of {n} answers apart)"
           if ident[ALL_SHIFTED] - ident[SHIFTED] >= 2 / n
           else f"no separation on these {n} prompts ({apart} answers apart)"),
        f"suffix restarting at 0 → {_share(table, RESTART)}, recall "
        f"{table.loc[RESTART, 'recalled']:.0%} (isolated {table.loc[RIGHT, 'recalled']:.0%}), "
        f"first-token logits off by up to {table.loc[RESTART, 'max |Δ logit|, first token']:.1f}"
        + (" → positions must continue from len(prefix)" if ident[RESTART] < 1
           else " → no answer changed, the logits did"),
        f"group 2: A's segment as is → {_share(table, AS_IS)}, re-rotated by Δ → "
        f"{_share(table, REROTATED)}; re-rotated keys: layer 0 error {k[0]:.0e}, layers "
        f"1–{k.index.max()} {deep.min():.2f} to {deep.max():.2f} → "
        + (("re-rotation repairs where the keys sit (layer 0 only), not what deeper K/V encode"
            + ("; every re-rotated answer held on these prompts, the K/V did not"
               if ident[REROTATED] == 1 else
               f"; {n - round(ident[REROTATED] * n)} of {n} re-rotated answers changed: isolate or "
               "recompute"))
           if k[0] < 1e-3 and deep.min() > 1e-2
           else "not the expected split between layer 0 and deeper layers"),
    ]


# ----------------------------------------------------------------------------- figures

def fig_position_cases(table: Any, model_name: str, shift: int | None = None):
    """Horizontal bars of token-identical and recall shares per case, ``shift`` the s of the labels
    (a Figure)."""
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.55 * len(table)))
    y = range(len(table))
    for dy, col, name in ((0.2, "identical", "token-identical to the isolated answer"),
                          (-0.2, "recalled", "recall")):
        bars = ax.barh([i + dy for i in y], table[col], height=0.4, label=name)
        # a 0 bar still shows "0%"
        ax.bar_label(bars, labels=[f"{v:.0%}" for v in table[col]], padding=2, fontsize=8)
    ax.set_yticks(list(y), list(table.index))
    ax.invert_yaxis()
    ax.set(xlim=(0, 1.12), xlabel=f"fraction of {int(table['prompts'].min())} prompts")
    ax.set_title(f"{model_name}: cached K/V at the right and at wrong positions"
                 + (f" (s = {shift})" if shift is not None else ""), pad=26)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def fig_layer_errors(errors: Any, model_name: str):
    """Group 2: per-layer relative error of the reused segment's K and V against B's own (a
    Figure)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (case, tensor), style, label in (((AS_IS, "K"), "o-", "K as is"),
                                         ((REROTATED, "K"), "s-", "K re-rotated by Δ"),
                                         ((AS_IS, "V"), "^--", "V (no rotation to undo)")):
        d = errors[(errors["treatment"] == case) & (errors["tensor"] == tensor)]
        ax.plot(d["layer"], d["relative error"].clip(lower=1e-9), style, label=label)
    ax.set_yscale("log")
    ax.set(xlabel="layer", ylabel="relative error vs B's own\n(0 drawn at 1e-9)",
           title=f"{model_name}, group 2: a segment's K/V from a request that started differently")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fig_rope_rotation(key: torch.Tensor, position: int, shift: int, theta: float = 10000.0,
                      pairs: Sequence[int] | None = None) -> Any:
    """A cached key at ``position`` re-rotated to ``position + shift``, one panel per pair (i, i +
    head_dim/2)."""
    key = key.detach().float().cpu().reshape(-1)
    half = key.numel() // 2
    moved = nb03.rerotate(key.reshape(1, 1, 1, -1), shift, theta).reshape(-1)
    inv = nb03.inverse_frequencies(key.numel(), theta)
    pairs = [0, half // 2, half - 1] if pairs is None else list(pairs)
    fig, axes = plt.subplots(1, len(pairs), figsize=(3.2 * len(pairs), 3.6), squeeze=False)
    for ax, i in zip(axes[0], pairs, strict=True):
        before, after = ((float(key[i]), float(key[i + half])),
                         (float(moved[i]), float(moved[i + half])))
        lim = 1.15 * max(math.hypot(*before), 1e-6)
        for (x, y), color, gid in ((before, "C0", "before"), (after, "C3", "after")):
            ax.annotate("", xy=(x, y), xytext=(0, 0),
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2})
            ax.plot([x], [y], "o", color=color, markersize=3, gid=gid)
        ax.set_title(f"pair {i}: turned {math.degrees(shift * float(inv[i])) % 360:.1f}°",
                     fontsize=9)
        ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.set_xlabel(f"dim {i}", fontsize=8)
        ax.set_ylabel(f"dim {i + half}", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"one cached key moved from position {position} (blue) to {position + shift} "
                 "(red): each pair turns by shift x its frequency; the length stays", fontsize=10)
    fig.tight_layout()
    return fig


def hf_cos_sin(model: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin a Hugging Face Llama/Qwen2 model computes for ``positions`` (batch, seq), to
    check 03's RoPE."""
    rotary, p = model.model.rotary_emb, next(model.parameters())
    # each (batch, seq, head_dim)
    return rotary(torch.zeros(1, device=p.device, dtype=p.dtype), positions.to(p.device))


# ----------------------------------------------------------------------------- exercise checkers

def _int_list(answer: Any) -> list[int] | None:
    try:
        return [int(x) for x in answer]
    except (TypeError, ValueError):
        return None


def check_suffix_positions(answer: Sequence[int] | None, prefix_len: int,
                           suffix_len: int) -> Verdict:
    """Exercise 03.1: the position ids of a suffix prefilled after a cached prefix of ``prefix_len``
    tokens."""
    hint = ("the cache holds positions 0 .. prefix_len - 1, so the suffix continues where the "
            "prefix ended, one position per suffix token")
    if answer is None:
        return unanswered(hint)
    got = _int_list(answer)
    if got is None:
        return verdict(False, hint=f"give a list of position ids, not {answer!r}")
    if len(got) != suffix_len:
        return verdict(False,
                       hint=f"one position id per suffix token: {len(got)} ids for {suffix_len} "
                            "tokens")
    return verdict(got == list(range(prefix_len, prefix_len + suffix_len)),
                   f"the suffix continues at position {prefix_len}",
                   hint)


def check_rerotation_delta(answer: int | None, start_in_a: int, start_in_b: int) -> Verdict:
    """Exercise 03.2: by how much must keys cached at ``start_in_a`` .. be rotated to serve at
    ``start_in_b`` ..?"""
    hint = ("rotate from the position the keys were computed at to the position they are needed "
            "at; the sign matters")
    if answer is None:
        return unanswered(hint)
    value = as_number(answer, int)
    if value is None:
        return verdict(False, hint=f"give a whole number of positions, not {answer!r}")
    return verdict(value == start_in_b - start_in_a, f"delta {value}: new start - old start", hint)


def check_positions_from_mask(fn: Callable[[torch.Tensor], torch.Tensor] | None) -> Verdict:
    """Exercise 03.3: ``fn(mask)`` must give each real token its index among the real tokens of its
    row."""
    hint = ("in each row, real tokens (mask 1) count 0, 1, 2, ... and pads (mask 0) are skipped; "
            "try cumsum")
    for m in (torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), torch.tensor([[1, 1, 0, 0, 1, 1]])):
        out, failed = call_answer(fn, m, hint=hint, name="my_positions")
        if failed is not None:
            return failed
        got, want = torch.as_tensor(out), positions_from_mask(m)
        if got.shape != m.shape:
            return verdict(False,
                           hint=f"for a mask of shape {tuple(m.shape)} return the same shape, not "
                                f"{tuple(got.shape)}")
        if not torch.equal(got[m.bool()].long(), want[m.bool()]):
            return verdict(False,
                           hint=f"for mask {m.tolist()} your positions of the real tokens are "
                                       f"{got[m.bool()].tolist()}; {hint}")
    return verdict(True, "positions of real tokens count only real tokens")


def check_exact_layers(answer: Sequence[int] | None, errors: Any, tol: float = 2e-2) -> Verdict:
    """Exercise 03.4: which layers' keys are exact after re-rotation? Exact: relative error below
    ``tol`` (float32 rounding ~1e-6 and 16-bit ~1e-2 pass; a key that encodes another context, ~1e-1
    and more, does not)."""
    hint = ("read the re-rotated K line of the per-layer figure: a layer is exact when its error "
            "is float rounding, orders of magnitude below the other layers' (the checker's "
            f"cut-off, {tol}, also lets 16-bit dtypes through)")
    if answer is None:
        return unanswered(hint)
    got = _int_list(answer)
    if got is None:
        return verdict(False, hint=f"give a list of layer indices, not {answer!r}")
    d = errors[(errors["treatment"] == REROTATED) & (errors["tensor"] == "K")]
    worst = d.groupby("layer")["relative error"].max()
    expected = sorted(int(i) for i in worst.index if worst[i] < tol)
    return verdict(sorted(got) == expected, f"layers {expected}", hint)


# ---------------------------------------------------------------------- build 03: RoPE for a suffix

@torch.no_grad()
def keys_before_rope(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """Layer 0's keys of ``ids`` before RoPE, (1, kv_heads, T, head_dim): at layer 0 a key depends
    on its token only."""
    m, device = model.model, next(model.parameters()).device
    x = m.layers[0].input_layernorm(m.embed_tokens(torch.tensor([list(ids)], device=device)))
    return m.layers[0].self_attn.k_proj(x).view(1, len(ids), -1,
                                                nb03.head_dim_of(model.config)).transpose(1, 2)


def check_rope_suffix(fn: Callable[..., torch.Tensor] | None, model: Any, tokenizer: Any,
                      n: int = 2) -> Verdict:
    """Build 03: ``fn(k, prefix_len, theta)`` must turn a suffix's layer-0 keys into the ones the
    model caches."""
    hint = ("the suffix continues at positions prefix_len, prefix_len + 1, ...; turn pair (i, i + "
            "head_dim/2) of a key at position p by p * theta ** (-2i / head_dim): (a, b) -> (a cos "
            "- b sin, b cos + a sin)")
    if fn is None:
        return unanswered(hint)
    theta = nb03.rope_theta(model.config)
    for ex in P.make_examples(n, "heldout", start=300, history="none"):
        ids, p = chat_prompt(tokenizer, ex)
        k = keys_before_rope(model, ids[p:])
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids], device=k.device),
                         use_cache=True).cache.layers[0].keys[:, :, p:]
        got, failed = call_answer(fn, k.clone(), p, theta, hint=hint, name="my_rope_suffix")
        if failed is not None:
            return failed
        got = torch.as_tensor(got)
        if got.shape != want.shape:
            return verdict(False,
                           hint=f"return the keys' shape {tuple(want.shape)}, not "
                                f"{tuple(got.shape)}")
        if not torch.allclose(got.to(want.dtype), want, atol=1e-4, rtol=1e-4):
            at0 = torch.allclose(got.to(want.dtype),
                                 nb03.apply_rope(k, torch.arange(len(ids) - p, device=k.device),
                                                 theta),
                                 atol=1e-4, rtol=1e-4)
            return verdict(False,
                           hint=("your keys sit at positions 0, 1, ...: the prefix already holds "
                                 "those; " if at0
                                 else f"on example {ex.seed} your keys differ from the model's by "
                                      f"up to {(got - want).abs().max():.2e}; ") + hint)
    return verdict(True,
                   f"{n} suffixes: your keys equal the ones the model caches at positions "
                   "prefix_len, prefix_len + 1, ...")


# ------------------------------------------------------------------- 03b's group-2 pairs (per seed)

def overlap_pair(tokenizer: Any, seed: int, split: str = "heldout", lang: str | None = None,
                 preamble_lines: tuple[int, int] = (1, 4)) -> dict:
    """Notebook 03b's group 2 on the bundled model's ChatML: A's and B's system turns share a
    segment after different random preambles. Token ids ``head_a``, ``head_b``, ``segment``,
    ``tail``, and the ``example``."""
    ex = P.make_example(seed, split, lang=lang, history="none", n_filler=3)
    rng = random.Random(f"kvlab-overlap:{split}:{seed}")
    pool = P.FILLER_ZH + P.FILLER_EN
    pre_a = [rng.choice(pool) for _ in range(preamble_lines[0])]
    pre_b = [rng.choice(pool) for _ in range(preamble_lines[1])]
    head = P.IM_START + "system\n"
    return {"head_a": encode(tokenizer, head + "\n".join(pre_a) + "\n"),
            "head_b": encode(tokenizer, head + "\n".join(pre_b) + "\n"),
            "segment": encode(tokenizer, ex.system),
            "tail": encode(tokenizer, P.IM_END + "\n" + ex.suffix_text),
            "example": ex}


def real_overlap_pair(tokenizer: Any, seed: int, split: str = "heldout",
                      question: str = P.REAL_QUESTIONS[0],
                      preamble_lines: tuple[int, int] = (1, 4)) -> dict:
    """``overlap_pair`` in a chat model's own template (``P.REAL_SYSTEM`` after two random English
    preambles)."""
    ex = P.make_example(seed, split, history="none")
    text = P.real_model_prompt(tokenizer, ex, question)
    content = P.REAL_SYSTEM.format(p=ex.passphrase)
    at = text.index(content)
    rng = random.Random(f"kvlab-real-overlap:{split}:{seed}")
    pre_a = [rng.choice(P.FILLER_EN) for _ in range(preamble_lines[0])]
    pre_b = [rng.choice(P.FILLER_EN) for _ in range(preamble_lines[1])]
    return {"head_a": encode(tokenizer, text[:at] + " ".join(pre_a) + " "),
            "head_b": encode(tokenizer, text[:at] + " ".join(pre_b) + " "),
            "segment": encode(tokenizer, content),
            "tail": encode(tokenizer, text[at + len(content):]), "example": ex}
