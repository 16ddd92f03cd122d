"""Notebook 05's table 3.6: the groups, the run loop over 05's row engines
(``kvlab.built.nb05.make_engine``), scores, figures, verdict lines, checkers, the article's claims.
Timing: ``kvlab.lessons.timing``."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvlab.built.nb05 import make_engine, prompts_for
from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import BUNDLED_MODEL
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import ROW_NAMES, Verdict, as_number, unanswered, verdict
from kvlab.lessons.timing import Timing, ratio_verdict
from kvlab.lessons.workloads import GROUP_CONDITIONS, Workload, seed_groups

MODES = ("isolated", "shared (correct)", "shared (wrong)")
ANSWERED_A = "answered A's passphrase"   # group 3's score: the donor's passphrase instead of B's

# The article's table 3.6, its claims (Qwen1.5-7B-Chat, a GPU): group, policy, TTFT ms, total ms,
# memory GB, consistent
ARTICLE_TABLE_36 = (
    (1, "isolated", 320, 580, 14.2, True),
    (1, "shared (correct)", 185, 410, 13.8, True),
    (2, "isolated", 315, 575, 14.2, True),
    (2, "shared (wrong)", 190, 420, 13.9, False),
    (3, "isolated", 318, 590, 14.3, True),
    (3, "shared (wrong)", 188, 415, 13.8, False),
)

WRONG_MODES = {1: "positions restart after the cached prefix",
               2: "cache key = a block's own tokens (another start's K/V)",
               3: "shared beyond the prefix (A's conversation K/V)"}


def article_table():
    """The article's table 3.6 as a DataFrame (its claims, typed from the article, not measured
    here)."""
    import pandas as pd

    return pd.DataFrame([{"group": g, "mode": m, "condition": GROUP_CONDITIONS[g][0],
                          "article (zh)": GROUP_CONDITIONS[g][1],
                          "TTFT (ms)": t, "total (ms)": tot, "memory (GB)": mem, "consistent": ok}
                         for g, m, t, tot, mem, ok in ARTICLE_TABLE_36])


def score_row(workload: Workload, reference: list[Any], outputs: list[Any]) -> dict[str, float]:
    """One row's scores over the served requests, against the isolated row's outputs
    ``reference``."""
    served, meta = workload.served(), workload.meta
    ref, out = [reference[i].output_ids for i in served], [outputs[i].output_ids for i in served]

    # over the requests with ``key`` (translations have no expected answer)
    def said(key: str) -> float:
        asked = [i for i in served if key in meta[i]]
        return statistics.mean((P.mentions if meta[i].get("lenient")
                                else P.recalled)(outputs[i].text, meta[i][key])
                               for i in asked) if asked else float("nan")

    return {"token agreement": statistics.mean(sum(a == b for a, b in zip(r, o)) / max(len(r), 1)
                                               # the reference's tokens at the same step
                                               for r, o in zip(ref, out)),
            "identical": statistics.mean(r == o for r, o in zip(ref, out)),
            "recall": said("expected"),
            ANSWERED_A: said("other_answer"),
            "cached tokens": statistics.mean(outputs[i].num_cached_tokens for i in served)}


def ttft_verdict(table: Any, group: int, mode: str) -> Any:
    """``mode``'s median TTFT over the isolated row's by ``timing.ratio_verdict`` (None: not timed):
    the one ratio."""
    d = table.set_index(["group", "mode"])
    num, den = d.loc[(group, mode), "TTFT runs (ms)"], d.loc[(group, "isolated"), "TTFT runs (ms)"]
    return ratio_verdict(Timing(mode, tuple(x / 1e3 for x in num)),
                         Timing("isolated", tuple(x / 1e3 for x in den)),
                         ideal=d.loc[(group, mode), "ideal"],
                         ideal_is="the share of prompt tokens it computed",
                         at=f"with {d.loc[(group, mode), 'cached tokens']:.0f} cached tokens per "
                            "request"
                         ) if len(num) and len(den) else None


def ttft_text(table: Any, group: int, mode: str) -> str:
    """``TTFT x0.71 (x0.66-x0.80 over 3 interleaved runs, ideal x0.40)``, the guard's flag instead
    when it has one."""
    v, row = ttft_verdict(table, group, mode), table.set_index(["group", "mode"]).loc[(group, mode)]
    n = len(row["TTFT runs (ms)"])
    return ("TTFT not timed (answers only)" if v is None else
            f"TTFT x{v.value:.2f} ({n} run{'s' if n > 1 else ''}: a timing, not evidence)"
            if n < 3 else
            v.says(f"TTFT x{v.value:.2f} (x{v.lo:.2f}-x{v.hi:.2f} over {n} interleaved runs, ideal "
                   f"x{row['ideal']:.2f})"))


def compare_with_article(table: Any):
    """Per group: shared/isolated ratios of TTFT (``ttft_verdict``), latency and memory, ours beside
    the article's."""
    import pandas as pd

    d, nan, rows = table.set_index(["group", "mode"]), float("nan"), []
    art = {(g, m): (t, tot, mem, ok) for g, m, t, tot, mem, ok in ARTICLE_TABLE_36}
    for g in sorted(table["group"].unique()):
        iso, a_iso = d.loc[(g, "isolated")], art[(g, "isolated")]
        for mode in ("shared (correct)", "shared (wrong)"):
            ours, a, v = (d.loc[(g, mode)], art.get((g, mode), (nan, nan, nan, None)),
                          ttft_verdict(table, g, mode))
            rows.append({"group": g, "mode": mode,
                         "TTFT ratio, ours": nan if v is None else v.value,
                         "TTFT ratio, article": a[0] / a_iso[0],
                         "latency ratio, ours (1 run)": ours["total latency (ms)"]
                         / iso["total latency (ms)"],
                         "latency ratio, article": a[1] / a_iso[1],
                         "KV ratio, ours": ours["peak KV (KiB)"] /
                         iso["peak KV (KiB)"], "memory ratio, article": a[2] / a_iso[2],
                         "identical, ours": ours["identical"], "consistent, article": a[3],
                         # 0: answers only
                         "timed runs": int(min(ours["timed runs"], iso["timed runs"]))})
    return pd.DataFrame(rows)


def fig_table36(table: Any):
    """TTFT bars (median, min–max whiskers) and token agreement / recall markers per row of the
    table."""
    import matplotlib.pyplot as plt

    labels = [f"g{g} {m}" for g, m in zip(table["group"], table["mode"])]
    colors = {"isolated": "tab:gray", "shared (correct)": "tab:blue", "shared (wrong)": "tab:red"}
    # groups scored on answers only have no TTFT
    timed = [i for i, v in enumerate(table["TTFT (ms)"]) if v == v]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6),
                               gridspec_kw={"width_ratios": [max(len(timed), 1), len(table)]})
    med = [table["TTFT (ms)"].iloc[i] for i in timed]
    whiskers = [[m - table["TTFT min (ms)"].iloc[i] for m, i in zip(med, timed)],
                [table["TTFT max (ms)"].iloc[i] - m for m, i in zip(med, timed)]]
    a.bar(range(len(timed)), med, yerr=whiskers, capsize=4,
          color=[colors[table["mode"].iloc[i]] for i in timed])
    a.set_xticks(range(len(timed)), [labels[i] for i in timed], rotation=60, ha="right", fontsize=8)
    untimed = ", ".join(sorted({str(g) for i, g in enumerate(table["group"]) if i not in timed}))
    a.set_title("time to first token"
                + (f" (groups {untimed}: answers only, not timed)" if untimed else ""), fontsize=9)
    a.set_ylabel("TTFT (ms): median, whiskers min–max")
    b.plot(range(len(table)), table["token agreement"], "o", label="token agreement with isolated")
    b.plot(range(len(table)), table["recall"], "s", mfc="none", label="passphrase recall")
    b.set_xticks(range(len(table)), labels, rotation=60, ha="right", fontsize=8)
    b.set(ylim=(-0.05, 1.05), ylabel="fraction", title="output consistency")
    # above the axes
    b.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def restart_text(positions: Any) -> str:
    """The suffix-restart row of notebook 03's ``position_experiment`` (``position_table``), with
    its n."""
    from kvlab.lessons.nb03_position import RESTART, RIGHT

    r, n = positions.loc[RESTART], int(positions.loc[RESTART, "prompts"])
    return (f"notebook 03's position experiment (n = {n} prompts): {1 - r['identical']:.0%} of "
            f"answers changed, recall {r['recalled']:.0%} (right positions "
            f"{positions.loc[RIGHT, 'recalled']:.0%})")


def evidence(table: Any, positions: Any = None) -> dict[str, str]:
    """Decision-table evidence (row name -> text): the scored requests' answers, the TTFT ratio as
    ``ttft_text``; the position row rests on ``positions`` (notebook 03's ``position_table``) when
    given."""
    d = table.set_index(["group", "mode"])

    def row(g: int, m: str) -> str:
        r, timing = d.loc[(g, m)], ttft_text(table, g, m)
        recall = "" if r["recall"] != r["recall"] else f", recall {r['recall']:.0%}"
        return (f"{int(r['requests'])} requests: {r['identical']:.0%} identical{recall}"
                + ("" if timing.startswith("TTFT not timed") else f", {timing}"))

    cached, other = ([d.loc[(2, m), "cached tokens"] for m in MODES[1:]],
                     d.loc[(3, "shared (wrong)")])
    return {
        "identical-prefix": f"nb05 group 1, engine prefix cache: {row(1, 'shared (correct)')}",
        "same-start": f"nb05 group 2, B after donor A's other start: chained keys {cached[0]:.1f} "
                      f"cached tokens per request; content-only keys: {cached[1]:.1f}, "
                      f"{row(2, 'shared (wrong)')}",
        "positions-agree": "nb05 group 1 with positions restarting after the cache: "
                           f"{row(1, 'shared (wrong)')}"
                           + ("" if positions is None else f"; {restart_text(positions)}"),
        "independent-context": "nb05 group 3 shared beyond the prefix: "
                               f"{row(3, 'shared (wrong)')}, answered A's passphrase "
                               f"{other[ANSWERED_A]:.0%}",
        "overlap-different-start": "nb05 group 2 served with another start's K/V: "
                                   f"{row(2, 'shared (wrong)')}",
    }


BUG_ROWS = {1: {"positions-agree"}, 2: {"same-start", "overlap-different-start"},
            3: {"independent-context"}}


def check_bug_for_group(answer: dict[int, str] | None) -> Verdict:
    """Exercise 05.1: ``{group: row name}``, the decision-table row (``common.ROW_NAMES``) each
    group's bug breaks."""
    hint = "give a dict {group: row name}, the names in the first column of the decision table"
    if not answer:
        return unanswered(hint)
    try:
        got = {int(k): v for k, v in dict(answer).items()}
    except (TypeError, ValueError):
        return verdict(False, hint=hint)
    if unknown := sorted(str(v) for v in got.values() if v not in ROW_NAMES):
        return verdict(False, hint=f"{unknown} is not a row name; the rows are {list(ROW_NAMES)}")
    wrong = [g for g in BUG_ROWS if got.get(g) not in BUG_ROWS[g]]
    return verdict(not wrong, "each bug breaks the row its group tests",
                   f"group(s) {wrong}: re-read which condition the bug violates")


def check_position_fix(positions: Any, model: Any, tokenizer: Any, workload: Workload,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> Verdict:
    """Exercise 05.3: ``positions(item) -> range`` for ``Engine(..., positions=)`` that numbers the
    computed tokens right with the prefix cache on: every answer equal to isolated, with cached
    tokens."""
    hint = ("positions must continue after the cached tokens: the item computes tokens item.start "
            ".. item.end - 1")
    if positions is None:
        return unanswered("write a function item -> range for Engine(..., positions=); " + hint)
    kw = dict(num_blocks=sum(cdiv(len(p) + workload.max_tokens, block_size)
                             for p in workload.prompts) + 8,
              block_size=block_size)
    sp, prompts = SamplingParams(max_tokens=workload.max_tokens), workload.prompts
    reference = Engine(model, tokenizer, enable_prefix_caching=False, **kw).generate(prompts, sp)
    try:
        outs = Engine(model, tokenizer, positions=positions, **kw).generate(prompts, sp)
    except Exception as err:  # noqa: BLE001 (the learner's code may fail in any way)
        return verdict(False, hint=f"your positions raised {type(err).__name__}: {err}")
    same, cached = (sum(a.output_ids == b.output_ids for a, b in zip(outs, reference)),
                    sum(o.num_cached_tokens for o in outs))
    return verdict(same == len(outs) and cached > 0,
                   f"{same}/{len(outs)} identical with {cached} cached tokens",
                   f"{same}/{len(outs)} requests identical to isolated, {cached} cached tokens: "
                   f"{hint}")


def check_kv_ratio(answer: float | None, num_requests: int, prefix_tokens: int, private_tokens: int,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> Verdict:
    """Exercise 05.2: shared/isolated K/V in blocks, ``num_requests`` sharing the prefix's full
    blocks, each with ``private_tokens`` of its own (a partial prefix block is private)."""
    hint = ("compute (shared blocks + private blocks) / isolated blocks; count blocks, not tokens "
            "(a partial block is a whole block)")
    value = as_number(answer)
    if value is None:
        return (unanswered(hint) if answer is None
                else verdict(False, hint=f"give a number, not {answer!r}"))
    full, per_request = (prefix_tokens // block_size,
                         cdiv(prefix_tokens + private_tokens, block_size))
    want = (full + num_requests * (per_request - full)) / (num_requests * per_request)
    return verdict(abs(value - want) < 1e-3, f"{want:.4f}", f"not {value:.4f}: {hint}")


TRANSLATION = {  # the article's translation example (its 2.2, 3.3-3.5): one prefix, several texts
    "zh": ("你是一个专业的翻译助手，请将以下内容翻译成英文。",
           ("今天天气很好。", "明天会下雨吗？")),
    # the same request in English; a 135M model does not translate into Chinese, so the target is
    # French
    "en": ("You are a professional translation assistant. Please translate the following into "
           "French.",
           ("The weather is nice today.", "Will it rain tomorrow?")),
}
UPDATE_TURN = ("From now on the passphrase is {p}.", "Understood. The passphrase is now {p}.")


def is_real_chat_model(tokenizer: Any) -> bool:
    """True for a general chat model with its own chat template (SmolLM2), False for the bundled
    passphrase model."""
    # the bundled model speaks ChatML too, but only its prompts
    name = getattr(tokenizer, "name_or_path", "") or ""
    bundled = bool(name) and Path(name).expanduser().resolve() == BUNDLED_MODEL.resolve()
    return not bundled and "im_start" in str(getattr(tokenizer, "chat_template", None) or "")


def _ids(tokenizer: Any, *texts: str) -> list[int]:
    # the template's text, as is
    return list(tokenizer("".join(texts), add_special_tokens=False)["input_ids"])


def _turns(system: str, *turns: tuple[str, str], question: str) -> str:
    return P.chatml("system", system) + "".join(P.chatml("user", u) + P.chatml("assistant", a)
                                                for u, a in turns) \
        + P.chatml("user", question) + P.IM_START + "assistant\n"


def real_groups(tokenizer: Any, n: int = 4, questions: int = 2,
                block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 16,
                translations: int = 2, n_wrong: int | None = None,
                wrong_questions: int = 1) -> dict[int, Workload]:
    """The article's three groups in ChatML text (SmolLM2), as token ids: 1 passphrase prompts and
    translations; 2 B after donor A's block-aligned extra turn; 3 A's history changes the
    passphrase."""
    from kvlab.lessons.workloads import _aligned_preamble

    m = n if n_wrong is None else n_wrong
    if wrong_questions < 1 or m % wrong_questions:
        raise ValueError(f"n_wrong={m} must be a multiple of "
                         f"wrong_questions={wrong_questions} (>= 1)")
    ex = {seed: P.make_example(seed, "heldout", history="none") for seed in range(max(n, m))}
    one = [(seed, P.REAL_SYSTEM.format(p=ex[seed].passphrase),
            P.REAL_QUESTIONS[(seed + q) % len(P.REAL_QUESTIONS)],
            {"expected": ex[seed].answer}) for q in range(questions) for seed in range(n)]
    one += [(lang, system, text, {"kind": "translation"})
            for lang, (system, texts) in TRANSLATION.items()
            for text in texts[:translations]]
    groups = {1: Workload("real-groups/1",
                          [_ids(tokenizer, _turns(sy, question=q)) for _, sy, q, _ in one],
                          max_tokens,
                          [{"group": 1, "seed": seed, "role": "served", "lenient": True,
                            "question": q, **more,
                            "prefix_tokens": len(_ids(tokenizer, P.chatml("system", sy)))}
                           for seed, sy, q, more in one])}
    served = [_ids(tokenizer,
                   _turns(P.REAL_SYSTEM.format(p=ex[seed].passphrase),
                          question=P.REAL_QUESTIONS[0]))
              for seed in range(m)]
    pres = [_aligned_preamble(tokenizer, seed, block_size, "heldout") for seed in range(m)]
    groups[2] = Workload("real-groups/2", [pre + b for pre, b in zip(pres, served)] + served,
                         max_tokens,
                         [{"group": 2, "seed": seed, "role": role, "expected": ex[seed].answer,
                           "lenient": True,
                           "offset": len(pres[seed]),
                           **({"donor": seed} if role == "served" else {})}
                          for role in ("donor", "served") for seed in range(m)])
    prompts, meta, asked = [], [], P.REAL_QUESTIONS[:wrong_questions]
    for seed in range(m // wrong_questions):
        new, system = (P.make_example(seed + 10_000, "heldout", history="none").passphrase,
                       P.REAL_SYSTEM.format(p=ex[seed].passphrase))
        update, prefix = (tuple(t.format(p=new) for t in UPDATE_TURN),
                          len(_ids(tokenizer, P.chatml("system", system))))
        prompts.append(_ids(tokenizer, _turns(system, update, question=asked[0])))
        meta.append({"group": 3, "seed": seed, "role": "donor", "expected": new, "lenient": True,
                     "prefix_tokens": prefix})
        for question in asked:
            prompts.append(_ids(tokenizer, _turns(system, question=question)))
            meta.append({"group": 3, "seed": seed, "role": "served", "expected": ex[seed].answer,
                         "lenient": True,
                         "question": question, "prefix_tokens": prefix, "other_answer": new,
                         "beyond_prompt": _ids(
                             tokenizer, P.chatml("system", system), P.chatml("user", update[0]),
                             P.chatml("assistant", update[1]))
                         + _ids(tokenizer, P.chatml("user", question), P.IM_START,
                                                                     "assistant\n")})
    groups[3] = Workload("real-groups/3", prompts, max_tokens, meta)
    return groups


def groups_for(tokenizer: Any, n: int, block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 12,
               **real: Any
               ) -> dict[int, Workload]:
    """``real_groups`` for a chat model with a ChatML template, else the bundled model's
    ``seed_groups``."""
    make = real_groups if is_real_chat_model(tokenizer) else seed_groups
    return make(tokenizer, n=n, block_size=block_size, max_tokens=max_tokens,
                **(real if make is real_groups else {}))


def three_requests(tokenizer: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> list[list[int]]:
    """Three prompts (token ids) on one passphrase system prompt, three different questions (group
    1, one passphrase)."""
    return groups_for(tokenizer, n=1, block_size=block_size, questions=3, translations=0)[1].prompts


def latest_bench(model_name: Any, path: Any = None) -> dict | None:
    """``build/bench/bench.json`` (``scripts/bench.py``) if run on ``model_name`` at 512 prefix
    tokens, else None."""
    import json

    path = Path(path or Path(__file__).resolve().parents[2] / "build" / "bench" / "bench.json")
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ours = (str(report.get("model", {}).get("config", "")).lower(),
            report.get("workload", {}).get("prefix_tokens"))
    return (dict(report, path=str(path)) if ours == (str(model_name or "bundled").lower(), 512)
            else None)


def bench_tables(report: dict):
    """The recorded benchmark's system table and ratio table as DataFrames (``error`` filled with
    "")."""
    import pandas as pd

    table = pd.DataFrame(report["systems"])
    table["error"] = table.get("error", pd.Series([""] * len(table))).fillna("")
    return table, pd.DataFrame(report["ratios"])


def pick_model(model: Any, smoke: bool) -> Any:
    """A notebook's ``MODEL="auto"``: SmolLM2 on a full run, the bundled tiny model (None) under
    SMOKE."""
    return (None if smoke else "smollm2") if model == "auto" else model


def fig_request_path(path: dict[str, Any], max_tokens: int = 48) -> Any:
    """Token position -> logical block -> physical block -> K/V slot of one request (``path``: its
    ``block_size``, ``block_table``, ``slot_mapping``, ``num_tokens``, ``cached_tokens``),
    ``max_tokens`` around the cache's end."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bs, table, total, cached = (path["block_size"], path["block_table"], path["num_tokens"],
                                path["cached_tokens"])
    # positions lo .. hi - 1
    lo = min(max(0, (cached - max_tokens // 2) // bs * bs), max(0, total - max_tokens))
    hi = min(total, lo + max_tokens)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * (hi - lo) + 2.5), 3.4))
    for p in range(lo, hi):
        for y, text, color, gid in ((2, p, "#9ecae1" if p < cached else "white", "position"),
                                    (0, path["slot_mapping"][p], "#f0f0f0", "slot")):
            ax.add_patch(Rectangle((p - lo, y), 0.95, 0.6, facecolor=color, edgecolor="black",
                                   linewidth=0.5,
                                   gid=("cached" if p < cached else "computed") if y else None))
            ax.text(p - lo + 0.47, y + 0.3, str(text), ha="center", va="center", fontsize=6,
                    rotation=90, gid=gid)
    for j in range(lo // bs, cdiv(hi, bs)):
        x0, x1 = max(j * bs, lo) - lo, min((j + 1) * bs, hi) - lo
        ax.add_patch(Rectangle((x0, 1), x1 - x0 - 0.05, 0.6, facecolor="#fdd0a2",
                               edgecolor="black"))
        # a cut-off block
        text = f"logical {j} → physical {table[j]}" if x1 - x0 >= 8 else f"{j}→{table[j]}"
        ax.text((x0 + x1) / 2, 1.3, text, ha="center", va="center",
                fontsize=7 if x1 - x0 >= 3 else 5, gid="block")
    for y, name in ((2.3, "token position\n(shaded: from cache)"), (1.3, "block table"),
                    (0.3, "slot in K/V store\n= block x size + offset")):
        ax.text(-0.4, y, name, ha="right", va="center", fontsize=8)
    ax.set(xlim=(-0.2, hi - lo), ylim=(-0.2, 2.8))
    ax.axis("off")
    shown = "" if (lo, hi) == (0, total) else f" (positions {lo}–{hi - 1} shown)"
    ax.set_title(f"{total} tokens, block size {bs}, {cached} tokens from the cache{shown}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def load_for_notebook(model: Any, smoke: bool, device: str, dtype: str, threads: int | None):
    """``MODEL="auto"`` loaded (the bundled model when SmolLM2 is missing), one torch thread on a
    CPU: (model, tok, name)."""
    import torch

    import kvlab

    name = pick_model(model, smoke)
    try:
        m, tok = kvlab.load_model(name, device=device, dtype=dtype)
    except OSError as err:  # SmolLM2 not converted on this machine: the bundled model instead
        print(f"{name} is not available here ({err}); using the bundled model")
        name, (m, tok) = None, kvlab.load_model(None, device=device, dtype=dtype)
    p = next(m.parameters())
    if threads or smoke or p.device.type == "cpu":
        torch.set_num_threads(threads or 1)
    print(f"{name or 'bundled passphrase model'}: {m.config.model_type}, "
          f"{m.config.num_hidden_layers} layers, {p.dtype} on {p.device}, torch threads "
          f"{torch.get_num_threads()}"
          + (" - SMOKE: the bundled tiny model, whose answers and timings are not SmolLM2's"
             if smoke else ""))
    return m, tok, name


def show_groups(groups: dict[int, Workload], tok: Any) -> None:
    """One scored prompt of each group, decoded (group 3 also as its wrong row serves it: on A's
    conversation)."""
    def show(ids: list[int]) -> str:
        return tok.decode(ids).replace(chr(10), " | ")

    for g, wl in groups.items():
        i = wl.served()[0]
        m = wl.meta[i]
        print(f"group {g} ({len(wl.served())} scored), {GROUP_CONDITIONS[g][0]}:\n  "
              + (repr(show(wl.prompts[i])) if g == 1 else f"...{show(wl.prompts[i][-40:])!r}")
              + (f"\n  its donor A starts with another turn and holds B's text from position "
                 f"{wl.meta[m['donor']]['offset']}" if "donor" in m else "")
              + (f"\n  served wrongly, on A's conversation: ...{show(m['beyond_prompt'][-40:])!r}"
                 if "beyond_prompt" in m else ""))


# ----------------------------------------------------------------------------- table 3.6's run loop
def run_mode(model, tok, workload: Workload, group: int, mode: str, block_size: int,
             max_tokens=None,
             donors: bool = True) -> dict:
    """One row, once: outputs in prompt order (None for a donor left out), peak K/V bytes, the
    computed share."""
    prompts, outputs = prompts_for(workload, group, mode), [None] * len(workload)
    keep = [i for i, m in enumerate(workload.meta) if donors or m.get("role") != "donor"]
    engine = make_engine(model, tok, group, mode,
                         sum(cdiv(len(prompts[i]) + workload.max_tokens, block_size)
                                                      for i in keep) + 8, block_size)
    # max_tokens=1: a prefill-only run
    new = workload.max_tokens if max_tokens is None else max_tokens
    got = engine.generate([prompts[i] for i in keep], [SamplingParams(
        max_tokens=1 if workload.meta[i].get("role") == "donor" else new) for i in keep])
    assert all(o.finish_reason != "error" for o in got), [o.error for o in got
                                                          if o.finish_reason == "error"]
    for i, o in zip(keep, got):
        outputs[i] = o
    computed = sum(len(o.prompt_ids) - o.num_cached_tokens
                   for o in got) / sum(len(o.prompt_ids) for o in got)
    return {"outputs": outputs, "peak_kv_bytes": engine.peak_kv_bytes, "computed share": computed}


def table_36(model, tok, groups: dict, repeats: int = 3, block_size: int = 16, timed=None,
             progress=False):
    """Table 3.6 -> (DataFrame, runs): each (group, mode) once in full, then the ``timed`` groups
    ``repeats`` prefill-only times, modes interleaved (TTFT median, min–max); untimed groups are
    scored on answers only."""
    import pandas as pd
    from tqdm.auto import tqdm

    timed = set(groups) if timed is None else set(timed)
    todo = [(g, m, None) for g in groups for m in MODES]
    todo += [(g, m, 1) for r in range(repeats) for g in sorted(timed)
             for m in (MODES[::-1] if r % 2 == 0 else MODES)]
    runs, ttft, rows, nan = {}, {(g, m): [] for g in groups for m in MODES}, [], float("nan")
    for g, m, new in tqdm(todo, desc="table 3.6 runs", disable=not progress):
        run = run_mode(model, tok, groups[g], g, m, block_size, new,
                       donors=g in timed or m != "isolated")
        runs.setdefault((g, m), run)
        if new == 1:   # the mean TTFT of the scored requests, in ms
            ttft[(g, m)].append(statistics.mean(run["outputs"][i].ttft
                                                for i in groups[g].served()) * 1e3)
    for (g, m), times in ttft.items():
        run, wl = runs[(g, m)], groups[g]
        rows.append({"group": g, "condition": GROUP_CONDITIONS[g][0], "mode": m,
                     "bug": WRONG_MODES[g] if m == "shared (wrong)" else "",
                     "requests": len(wl.served()),
                     "TTFT (ms)": statistics.median(times) if times else nan,
                     "TTFT min (ms)": min(times, default=nan),
                     "TTFT max (ms)": max(times, default=nan),
                     "timed runs": len(times), "TTFT runs (ms)": tuple(times),
                     "ideal": run["computed share"],
                     "total latency (ms)": statistics.mean(run["outputs"][i].latency
                                                           for i in wl.served()) * 1e3
                     if times else nan,
                     "peak KV (KiB)": run["peak_kv_bytes"] / 1024 if times else nan,
                     **score_row(wl, runs[(g, "isolated")]["outputs"], run["outputs"])})
    return pd.DataFrame(rows), runs


def show_table(table: Any):
    """The measured table, styled ("—": not applicable)."""
    print("— : not applicable (recall: only requests that ask for a passphrase are scored; "
          "answered A's passphrase: group 3 only; time and K/V: group 1 only, the others are "
          "scored on answers)")
    fmt = {c: "{:.1f}"
           for c in ("TTFT (ms)", "TTFT min (ms)", "TTFT max (ms)", "total latency (ms)",
                     "cached tokens")}
    fmt |= {c: "{:.2f}"
            for c in ("ideal", "token agreement", "identical", "recall", "answered A's passphrase")}
    return table.drop(columns=["condition", "TTFT runs (ms)"]).style.format(
        fmt | {"peak KV (KiB)": "{:.0f}"}, na_rep="—")


def answers_table(groups: dict[int, Workload], runs: dict) -> Any:
    """The first line of a few answers per group and mode (group 1: the translations too)."""
    import pandas as pd

    rows = []
    for g, wl in groups.items():
        picks = (wl.served()[:3]
                 + ([i for i in wl.served() if wl.meta[i].get("kind") == "translation"] if g == 1
                    else []))
        for i in dict.fromkeys(picks):
            m = wl.meta[i]
            rows.append({"group": g,
                         "request": str(m.get("question"))[:40] if g == 1 else f"seed {m['seed']}",
                         "expected": m.get("expected", "(translation)"),
                         **{mode: runs[(g, mode)]["outputs"][i].text.strip().split("\n")[0][:70]
                            for mode in MODES},
                         "A's passphrase": m.get("other_answer", "")})
    return pd.DataFrame(rows).style.set_properties(**{"white-space": "pre-wrap",
                                                      "text-align": "left"})


def say_wrong_shares(table: Any, positions: Any = None) -> None:
    """Per group: how many scored answers the wrong share changed, and recall (printed from the
    table); group 1 also with ``positions`` (notebook 03's ``position_table``), the n >= 24 the
    position verdict rests on."""
    d = table.set_index(["group", "mode"])
    for g in sorted(table["group"].unique()):
        iso, bad = d.loc[(g, "isolated")], d.loc[(g, "shared (wrong)")]
        other = bad[ANSWERED_A]
        print(f"group {g}, {WRONG_MODES[g]}: {1 - bad['identical']:.0%} of {bad['requests']} "
              f"scored answers changed (token agreement with isolated {bad['token agreement']:.2f})"
              + (f", passphrase recall {iso['recall']:.0%} isolated -> {bad['recall']:.0%}"
                 if bad["recall"] == bad["recall"] else "")
              + (f", and {other:.0%} answered A's passphrase instead" if other == other else "")
              + (f"; {restart_text(positions)}" if g == 1 and positions is not None else ""))


def say_against_article(table: Any) -> None:
    """The verdict lines beside the article's table 3.6 (agree / partly / DIFFER / note), printed
    from the numbers."""
    from kvlab.lessons.passphrase import memory_column

    d, art = table.set_index(["group", "mode"]), {(g, m): t for g, m, t, *_ in ARTICLE_TABLE_36}
    same = {g: d.loc[(g, "shared (correct)")] for g in sorted(table["group"].unique())}
    wrong = [d.loc[(g, "shared (wrong)")] for g in (2, 3) if (g, "shared (wrong)") in d.index]
    a, v = (art[(1, "shared (correct)")] / art[(1, "isolated")],
            ttft_verdict(table, 1, "shared (correct)"))
    ok = v is not None and v.ok
    ttft = (("note", "") if not ok else
            ("agree", ": the article's ratio lies inside our range") if v.lo <= a <= v.hi else
            ("partly", f": a saving in every run, {'smaller' if v.lo > a else 'larger'} than "
                       "the article's") if v.hi < 1 else
            ("DIFFER", ": the shared row was slower in every run" if v.lo >= 1
             else ": a saving in some runs only"))
    shown = ", ".join(f"group {g} {r['identical']:.0%} of {r['requests']}" for g, r in same.items())
    lines = [("agree" if all(r["identical"] == 1 for r in same.values()) else "DIFFER",
              f"correct sharing: identical outputs in {shown} (the article: consistent)"),
             (ttft[0],
              f"group 1 shared/isolated {ttft_text(table, 1, 'shared (correct)')} (the article: "
              f"x{a:.2f}){ttft[1]}"
              + (f", {d.loc[(1, 'shared (correct)'), 'cached tokens']:.0f} prompt tokens per "
                 "request from the cache" if ok else "")),
             ("agree" if all(r["identical"] < 1 for r in wrong) else "DIFFER",
              "groups 2 and 3 shared wrongly: "
              + " and ".join(f"{1 - r['identical']:.0%} of {r['requests']}" for r in wrong)
              + " answers changed (the article: inconsistent)")]
    if (2, "shared (correct)") in d.index:
        c, w = (d.loc[(2, "shared (correct)"), "cached tokens"],
                d.loc[(2, "shared (wrong)"), "cached tokens"])
        lines.append(("differ" if c == 0 else "note",
                      f"group 2: chained keys reuse {c:.1f} tokens per request, content-only keys "
                      f"{w:.1f}; the article's group-2 row shows a saving, which a correct cache "
                      + ("cannot give here: only the wrong share reuses the donor's blocks"
                         if c == 0 else
                         "gives here only for blocks with the same start (another B's), never the "
                         "donor's")))
    kv = d.loc[(1, "shared (correct)"), "peak KV (KiB)"] / d.loc[(1, "isolated"), "peak KV (KiB)"]
    lines.append(("memory",
                  f"{memory_column()} Ours counts K/V alone: group 1's peak K/V shared/isolated "
                  f"x{kv:.2f}."))
    for tag, text in lines:
        print(f"{tag:<8}{text}")
