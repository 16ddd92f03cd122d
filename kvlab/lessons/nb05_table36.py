"""Notebook 05's table 3.6: its workloads (``real_groups``), scores, figures, checkers, the article's claims.

The row engines and the run loop are notebook 05's ``#| export`` cells (``kvlab.built.nb05``)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvlab.built.nb01 import Timing, ratio_verdict
from kvlab.built.nb03 import token_agreement
from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.engine import Engine, SamplingParams
from kvlab.engine.models import BUNDLED_MODEL
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import ROW_NAMES, Verdict, as_number, unanswered, verdict
from kvlab.lessons.workloads import GROUP_CONDITIONS, Workload, seed_groups

__all__ = ["ARTICLE_TABLE_36", "BUG_ROWS", "TRANSLATION", "WRONG_MODES", "article_table",
           "check_bug_for_group", "check_kv_ratio", "check_position_fix", "compare_with_article", "evidence",
           "fig_request_path", "fig_table36", "groups_for", "is_real_chat_model", "latest_bench", "pick_model", "bench_tables",
           "real_groups", "score_row", "three_requests", "ttft_text", "ttft_verdict"]

# The article's table 3.6, its claims (Qwen1.5-7B-Chat, a GPU): group, policy, TTFT ms, total ms, memory GB, consistent
ARTICLE_TABLE_36 = (
    (1, "isolated", 320, 580, 14.2, True),
    (1, "shared (correct)", 185, 410, 13.8, True),
    (2, "isolated", 315, 575, 14.2, True),
    (2, "shared (wrong)", 190, 420, 13.9, False),
    (3, "isolated", 318, 590, 14.3, True),
    (3, "shared (wrong)", 188, 415, 13.8, False),
)

WRONG_MODES = {1: "positions restart after the cached prefix", 2: "cache key = a block's own tokens (another start's K/V)",
               3: "shared beyond the prefix (A's conversation K/V)"}


def article_table():
    """The article's table 3.6 as a DataFrame (its claims, typed from the article, not measured here)."""
    import pandas as pd

    return pd.DataFrame([{"group": g, "mode": m, "condition": GROUP_CONDITIONS[g][0], "article (zh)": GROUP_CONDITIONS[g][1],
                          "TTFT (ms)": t, "total (ms)": tot, "memory (GB)": mem, "consistent": ok}
                         for g, m, t, tot, mem, ok in ARTICLE_TABLE_36])


def score_row(workload: Workload, reference: list[Any], outputs: list[Any]) -> dict[str, float]:
    """One row's scores over the served requests, against the isolated row's outputs ``reference``."""
    served = workload.served()

    def said(i: int, key: str) -> bool:
        meta = workload.meta[i]
        return (P.mentions if meta.get("lenient") else P.recalled)(outputs[i].text, meta[key])

    asked = [i for i in served if "expected" in workload.meta[i]]  # translations have no expected answer
    other, nan = [i for i in served if "other_answer" in workload.meta[i]], float("nan")
    return {"token agreement": statistics.mean(token_agreement(reference[i].output_ids, outputs[i].output_ids)
                                               for i in served),
            "identical": statistics.mean(reference[i].output_ids == outputs[i].output_ids for i in served),
            "recall": statistics.mean(said(i, "expected") for i in asked) if asked else nan,
            "answered A's passphrase": statistics.mean(said(i, "other_answer") for i in other) if other else nan,
            "cached tokens": statistics.mean(outputs[i].num_cached_tokens for i in served)}


def ttft_verdict(table: Any, group: int, mode: str) -> Any:
    """``mode``'s TTFT over the isolated row's, judged by notebook 01's guard (``ratio_verdict``): the ratio of the
    median TTFTs, its min-max, and a flag below the ideal (the row's computed share of prompt tokens) or above 1.5.
    The one definition of the ratio: the table's "TTFT ratio, ours" and every sentence use it. None: not timed."""
    d = table.set_index(["group", "mode"])
    num, den = d.loc[(group, mode), "TTFT runs (ms)"], d.loc[(group, "isolated"), "TTFT runs (ms)"]
    return ratio_verdict(Timing(mode, tuple(x / 1e3 for x in num)), Timing("isolated", tuple(x / 1e3 for x in den)),
                         ideal=d.loc[(group, mode), "ideal"]) if len(num) and len(den) else None


def ttft_text(table: Any, group: int, mode: str) -> str:
    """``TTFT x0.71 (x0.66-x0.80 over 3 interleaved runs, ideal x0.40)``, the guard's flag instead when it has one."""
    v = ttft_verdict(table, group, mode)
    if v is None:
        return "TTFT not timed (answers only)"
    row = table.set_index(["group", "mode"]).loc[(group, mode)]
    n, ideal = len(row["TTFT runs (ms)"]), row["ideal"]
    if n < 3:
        return f"TTFT x{v.value:.2f} ({n} run{'s' if n > 1 else ''}: a timing, not evidence)"
    return v.says(f"TTFT x{v.value:.2f} (x{v.lo:.2f}-x{v.hi:.2f} over {n} interleaved runs, ideal x{ideal:.2f})")


def compare_with_article(table: Any):
    """Per group: shared/isolated ratios of TTFT (as ``ttft_verdict``), latency and memory, ours beside the article's."""
    import pandas as pd

    art, nan, rows = {(g, m): (t, tot, mem, ok) for g, m, t, tot, mem, ok in ARTICLE_TABLE_36}, float("nan"), []
    for group in sorted(table["group"].unique()):
        d = table[table.group == group].set_index("mode")
        iso = d.loc["isolated"]
        for mode in ("shared (correct)", "shared (wrong)"):
            ours, a_iso, a, v = d.loc[mode], art.get((group, "isolated")), art.get((group, mode)), ttft_verdict(
                table, group, mode)
            rows.append({
                "group": group, "mode": mode, "TTFT ratio, ours": nan if v is None else v.value,
                "TTFT ratio, article": a[0] / a_iso[0] if a else nan,
                "latency ratio, ours (1 run)": ours["total latency (ms)"] / iso["total latency (ms)"],
                "latency ratio, article": a[1] / a_iso[1] if a else nan,
                "KV ratio, ours": ours["peak KV (KiB)"] / iso["peak KV (KiB)"],
                "memory ratio, article": a[2] / a_iso[2] if a else nan,
                "identical, ours": ours["identical"], "consistent, article": a[3] if a else None,
                "timed runs": int(min(ours["timed runs"], iso["timed runs"])),  # 0: answers only
            })
    return pd.DataFrame(rows)


def fig_table36(table: Any):
    """Two panels per row of the table: mean TTFT (bars) and token agreement / recall (markers)."""
    import matplotlib.pyplot as plt

    labels = [f"g{g} {m}" for g, m in zip(table["group"], table["mode"])]
    colors = {"isolated": "tab:gray", "shared (correct)": "tab:blue", "shared (wrong)": "tab:red"}
    timed = [i for i, v in enumerate(table["TTFT (ms)"]) if v == v]  # groups scored on answers only have no TTFT
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [max(len(timed), 1), len(table)]})
    a.bar(range(len(timed)), [table["TTFT (ms)"].iloc[i] for i in timed],
          color=[colors[table["mode"].iloc[i]] for i in timed])
    a.set_xticks(range(len(timed)), [labels[i] for i in timed], rotation=60, ha="right", fontsize=8)
    untimed = ", ".join(sorted({str(g) for i, g in enumerate(table["group"]) if i not in timed}))
    a.set_title("time to first token" + (f" (groups {untimed}: answers only, not timed)" if untimed else ""), fontsize=9)
    a.set_ylabel("mean TTFT (ms)")
    b.plot(range(len(table)), table["token agreement"], "o", label="token agreement with isolated")
    b.plot(range(len(table)), table["recall"], "s", mfc="none", label="passphrase recall")
    b.set_xticks(range(len(table)), labels, rotation=60, ha="right", fontsize=8)
    b.set(ylim=(-0.05, 1.05), ylabel="fraction", title="output consistency")
    b.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=2, fontsize=8, frameon=False)  # above the axes
    fig.tight_layout()
    return fig


def evidence(table: Any) -> dict[str, str]:
    """Decision-table evidence (row name -> text): the scored requests' answers, the TTFT ratio as ``ttft_text``."""
    d = table.set_index(["group", "mode"])

    def row(g: int, m: str) -> str:
        r, timing = d.loc[(g, m)], ttft_text(table, g, m)
        recall = "" if r["recall"] != r["recall"] else f", recall {r['recall']:.0%}"
        return (f"{int(r['requests'])} requests: {r['identical']:.0%} identical{recall}"
                + ("" if timing.startswith("TTFT not timed") else f", {timing}"))

    cached = [d.loc[(2, m), "cached tokens"] for m in ("shared (correct)", "shared (wrong)")]
    return {
        "identical-prefix": f"nb05 group 1, engine prefix cache: {row(1, 'shared (correct)')}",
        "same-start": f"nb05 group 2, B after donor A's other start: chained keys {cached[0]:.1f} cached tokens per "
                      f"request; content-only keys: {cached[1]:.1f}, {row(2, 'shared (wrong)')}",
        "positions-agree": f"nb05 group 1 with positions restarting after the cache: {row(1, 'shared (wrong)')}",
        "independent-context": f"nb05 group 3 shared beyond the prefix: {row(3, 'shared (wrong)')}, answered A's "
                               f"passphrase {d.loc[(3, 'shared (wrong)'), chr(39).join(['answered A', 's passphrase'])]:.0%}",
        "overlap-different-start": f"nb05 group 2 served with another start's K/V: {row(2, 'shared (wrong)')}",
    }


BUG_ROWS = {1: {"positions-agree"}, 2: {"same-start", "overlap-different-start"}, 3: {"independent-context"}}


def check_bug_for_group(answer: dict[int, str] | None) -> Verdict:
    """Exercise 05.1: ``{group: row name}``, the decision-table row (``common.ROW_NAMES``) each group's bug breaks."""
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
    """Exercise 05.3: ``positions(item) -> range`` for ``Engine(..., positions=)`` that numbers the computed tokens
    right with the prefix cache on: every answer equal to isolated, with cached tokens."""
    hint = "positions must continue after the cached tokens: the item computes tokens item.start .. item.end - 1"
    if positions is None:
        return unanswered("write a function item -> range for Engine(..., positions=); " + hint)
    kw = dict(num_blocks=sum(cdiv(len(p) + workload.max_tokens, block_size) for p in workload.prompts) + 8,
              block_size=block_size)
    sp, prompts = SamplingParams(max_tokens=workload.max_tokens), workload.prompts
    reference = Engine(model, tokenizer, enable_prefix_caching=False, **kw).generate(prompts, sp)
    try:
        outs = Engine(model, tokenizer, positions=positions, **kw).generate(prompts, sp)
    except Exception as err:  # noqa: BLE001 (the learner's code may fail in any way)
        return verdict(False, hint=f"your positions raised {type(err).__name__}: {err}")
    same, cached = sum(a.output_ids == b.output_ids for a, b in zip(outs, reference)), sum(o.num_cached_tokens for o in outs)
    return verdict(same == len(outs) and cached > 0, f"{same}/{len(outs)} identical with {cached} cached tokens",
                   f"{same}/{len(outs)} requests identical to isolated, {cached} cached tokens: {hint}")


def check_kv_ratio(answer: float | None, num_requests: int, prefix_tokens: int, private_tokens: int,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> Verdict:
    """Exercise 05.2: shared/isolated K/V in blocks, ``num_requests`` sharing the prefix's full blocks, each with
    ``private_tokens`` of its own (a partial prefix block is private)."""
    hint = "compute (shared blocks + private blocks) / isolated blocks; count blocks, not tokens (a partial block is a whole block)"
    value = as_number(answer)
    if value is None:
        return unanswered(hint) if answer is None else verdict(False, hint=f"give a number, not {answer!r}")
    full, per_request = prefix_tokens // block_size, cdiv(prefix_tokens + private_tokens, block_size)
    want = (full + num_requests * (per_request - full)) / (num_requests * per_request)
    return verdict(abs(value - want) < 1e-3, f"{want:.4f}", f"not {value:.4f}: {hint}")


TRANSLATION = {  # the article's translation example (its 2.2, 3.3-3.5): one prefix, several texts
    "zh": ("你是一个专业的翻译助手，请将以下内容翻译成英文。", ("今天天气很好。", "明天会下雨吗？")),
    # the same request in English; a 135M model does not translate into Chinese, so the target is French
    "en": ("You are a professional translation assistant. Please translate the following into French.",
           ("The weather is nice today.", "Will it rain tomorrow?")),
}
UPDATE_TURN = ("From now on the passphrase is {p}.", "Understood. The passphrase is now {p}.")


def is_real_chat_model(tokenizer: Any) -> bool:
    """True for a general chat model with its own chat template (SmolLM2), False for the bundled passphrase model."""
    name = getattr(tokenizer, "name_or_path", "") or ""  # the bundled model speaks ChatML too, but only its prompts
    bundled = bool(name) and Path(name).expanduser().resolve() == BUNDLED_MODEL.resolve()
    return not bundled and "im_start" in str(getattr(tokenizer, "chat_template", None) or "")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template's text, as is


def _turns(system: str, *turns: tuple[str, str], question: str) -> str:
    text = P.chatml("system", system)
    for user, assistant in turns:
        text += P.chatml("user", user) + P.chatml("assistant", assistant)
    return text + P.chatml("user", question) + P.IM_START + "assistant\n"


def real_groups(tokenizer: Any, n: int = 4, questions: int = 2, block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 16,
                split: str = "heldout", start: int = 0, translations: int = 2, n_wrong: int | None = None,
                wrong_questions: int = 1) -> dict[int, Workload]:
    """The article's three groups in ChatML text (SmolLM2), as token ids. 1: ``n`` passphrase system prompts x
    ``questions``, and the translation prefix (zh, en); 2: B, and donor A = a block-aligned extra turn + B's text;
    3: one system prompt, A's history changes the passphrase. Groups 2 and 3 score ``n_wrong`` requests each."""
    groups: dict[int, Workload] = {}
    prompts, meta = [], []
    examples = [P.make_example(seed, split, history="none") for seed in range(start, start + n)]
    for q in range(questions):
        for seed, ex in zip(range(start, start + n), examples):
            question = P.REAL_QUESTIONS[(seed + q) % len(P.REAL_QUESTIONS)]
            system = P.REAL_SYSTEM.format(p=ex.passphrase)
            prompts.append(_ids(tokenizer, _turns(system, question=question)))
            meta.append({"group": 1, "seed": seed, "role": "served", "expected": ex.answer, "lenient": True,
                         "question": question, "prefix_tokens": len(_ids(tokenizer, P.chatml("system", system)))})
    for lang, (system, texts) in TRANSLATION.items():
        for text in texts[:translations]:
            prompts.append(_ids(tokenizer, _turns(system, question=text)))
            meta.append({"group": 1, "seed": lang, "role": "served", "lenient": True, "question": text,
                         "kind": "translation", "prefix_tokens": len(_ids(tokenizer, P.chatml("system", system)))})
    groups[1] = Workload("real-groups/1", prompts, max_tokens, meta)

    from kvlab.lessons.workloads import _aligned_preamble

    m = n if n_wrong is None else n_wrong
    if wrong_questions < 1 or m % wrong_questions:
        raise ValueError(f"n_wrong={m} must be a multiple of wrong_questions={wrong_questions} (>= 1)")
    passphrases = [(seed, P.make_example(seed, split, history="none")) for seed in range(start, start + m)]
    served = [_ids(tokenizer, _turns(P.REAL_SYSTEM.format(p=ex.passphrase), question=P.REAL_QUESTIONS[0]))
              for _, ex in passphrases]
    pres = [_aligned_preamble(tokenizer, seed, block_size, split) for seed, _ in passphrases]
    meta = [{"group": 2, "seed": seed, "role": role, "expected": ex.answer, "lenient": True, "offset": len(pre),
             **({"donor": k} if role == "served" else {})}
            for role in ("donor", "served") for k, ((seed, ex), pre) in enumerate(zip(passphrases, pres))]
    groups[2] = Workload("real-groups/2", [pre + b for pre, b in zip(pres, served)] + served, max_tokens, meta)

    prompts, meta = [], []
    asked = P.REAL_QUESTIONS[:wrong_questions]
    for seed, ex in passphrases[:m // wrong_questions]:
        new = P.make_example(seed + 10_000, split, history="none").passphrase
        system = P.REAL_SYSTEM.format(p=ex.passphrase)
        update = tuple(t.format(p=new) for t in UPDATE_TURN)
        a_history = P.chatml("system", system) + P.chatml("user", update[0]) + P.chatml("assistant", update[1])
        prefix_tokens = len(_ids(tokenizer, P.chatml("system", system)))
        prompts.append(_ids(tokenizer, _turns(system, update, question=asked[0])))
        meta.append({"group": 3, "seed": seed, "role": "donor", "expected": new, "lenient": True,
                     "prefix_tokens": prefix_tokens})
        for question in asked:
            beyond = _ids(tokenizer, a_history) + _ids(tokenizer, P.chatml("user", question) + P.IM_START + "assistant\n")
            prompts.append(_ids(tokenizer, _turns(system, question=question)))
            meta.append({"group": 3, "seed": seed, "role": "served", "expected": ex.answer, "lenient": True,
                         "question": question, "prefix_tokens": prefix_tokens, "beyond_prompt": beyond,
                         "other_answer": new})
    groups[3] = Workload("real-groups/3", prompts, max_tokens, meta)
    return groups


def groups_for(tokenizer: Any, n: int, block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 12, translations: int = 2,
               n_wrong: int | None = None, wrong_questions: int = 1) -> dict[int, Workload]:
    """``real_groups`` for a chat model with a ChatML template, else the bundled model's ``seed_groups`` (``n``)."""
    if is_real_chat_model(tokenizer):
        return real_groups(tokenizer, n=n, block_size=block_size, max_tokens=max_tokens, translations=translations,
                           n_wrong=n_wrong, wrong_questions=wrong_questions)
    return seed_groups(tokenizer, n=n, block_size=block_size, max_tokens=max_tokens)


def three_requests(tokenizer: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> list[list[int]]:
    """Three prompts (token ids) on one passphrase system prompt, three different questions (group 1, one passphrase)."""
    make = real_groups if is_real_chat_model(tokenizer) else seed_groups
    return make(tokenizer, n=1, questions=3, block_size=block_size, **({"translations": 0} if make is real_groups
                                                                          else {}))[1].prompts


def latest_bench(model_name: Any, path: Any = None) -> dict | None:
    """``build/bench/bench.json`` (``scripts/bench.py``) if run on ``model_name`` at 512 prefix tokens, else None."""
    import json

    path = Path(path or Path(__file__).resolve().parents[2] / "build" / "bench" / "bench.json")
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (str(report.get("model", {}).get("config", "")).lower(), report.get("workload", {}).get("prefix_tokens")) != (
            str(model_name or "bundled").lower(), 512):
        return None
    return dict(report, path=str(path))


def bench_tables(report: dict):
    """The recorded benchmark's system table and ratio table as DataFrames (``error`` filled with "")."""
    import pandas as pd

    table = pd.DataFrame(report["systems"])
    table["error"] = table.get("error", pd.Series([""] * len(table))).fillna("")
    return table, pd.DataFrame(report["ratios"])


def pick_model(model: Any, smoke: bool) -> Any:
    """A notebook's ``MODEL="auto"``: SmolLM2 on a full run, the bundled tiny model (None) under SMOKE."""
    return (None if smoke else "smollm2") if model == "auto" else model


def fig_request_path(path: dict[str, Any], max_tokens: int = 48) -> Any:
    """Token position -> logical block -> physical block -> K/V slot of one request (``path``: its ``block_size``,
    ``block_table``, ``slot_mapping``, ``num_tokens``, ``cached_tokens``), ``max_tokens`` around the cache's end."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bs, table, total, cached = path["block_size"], path["block_table"], path["num_tokens"], path["cached_tokens"]
    lo = min(max(0, (cached - max_tokens // 2) // bs * bs), max(0, total - max_tokens))  # positions lo .. hi - 1
    hi = min(total, lo + max_tokens)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * (hi - lo) + 2.5), 3.4))
    for p in range(lo, hi):
        x, hit = p - lo, p < cached
        ax.add_patch(Rectangle((x, 2), 0.95, 0.6, facecolor="#9ecae1" if hit else "white", edgecolor="black",
                               linewidth=0.5, gid="cached" if hit else "computed"))
        ax.text(x + 0.47, 2.3, str(p), ha="center", va="center", fontsize=6, rotation=90, gid="position")
        ax.add_patch(Rectangle((x, 0), 0.95, 0.6, facecolor="#f0f0f0", edgecolor="black", linewidth=0.5))
        ax.text(x + 0.47, 0.3, str(path["slot_mapping"][p]), ha="center", va="center", fontsize=6, rotation=90,
                gid="slot")
    for j in range(lo // bs, cdiv(hi, bs)):
        x0, x1 = max(j * bs, lo) - lo, min((j + 1) * bs, hi) - lo
        ax.add_patch(Rectangle((x0, 1), x1 - x0 - 0.05, 0.6, facecolor="#fdd0a2", edgecolor="black"))
        text = f"logical {j} → physical {table[j]}" if x1 - x0 >= 8 else f"{j}→{table[j]}"  # a cut-off block
        ax.text((x0 + x1) / 2, 1.3, text, ha="center", va="center", fontsize=7 if x1 - x0 >= 3 else 5, gid="block")
    for y, name in ((2.3, "token position\n(shaded: from cache)"), (1.3, "block table"),
                    (0.3, "slot in K/V store\n= block x size + offset")):
        ax.text(-0.4, y, name, ha="right", va="center", fontsize=8)
    ax.set(xlim=(-0.2, hi - lo), ylim=(-0.2, 2.8))
    ax.axis("off")
    shown = "" if (lo, hi) == (0, total) else f" (positions {lo}–{hi - 1} shown)"
    ax.set_title(f"{total} tokens, block size {bs}, {cached} tokens from the cache{shown}", fontsize=10)
    fig.tight_layout()
    return fig


# --- figures of section 5 (the sys512 benchmark, kvlab.bench.peers) ---
def fig_sys512(table: Any, title: str = "sys512"):
    """Three panels: mean TTFT, throughput and peak KV bytes per system, shared beside isolated.

    Horizontal bars, one row per system (names never overlap); a log time axis when the TTFTs span
    more than a factor of 30, so no bar vanishes.
    """
    import matplotlib.pyplot as plt

    ok = table[table["error"] == ""]
    systems = list(dict.fromkeys(ok["system"]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.55 * len(systems) + 2.2), gridspec_kw={"width_ratios": [1, 1, 0.7]})
    for ax, col, label in ((axes[0], "TTFT (ms)", "mean TTFT (ms)"), (axes[1], "throughput (tok/s)", "generated tokens / s")):
        for j, mode in enumerate(("isolated", "shared")):
            vals = [ok[(ok.system == s) & (ok["mode"] == mode)][col] for s in systems]
            ax.barh([i + (j - 0.5) * 0.38 for i in range(len(systems))], [v.iloc[0] if len(v) else 0 for v in vals],
                    0.38, label=mode, color=("tab:gray", "tab:blue")[j])
        ax.set_yticks(range(len(systems)), systems if ax is axes[0] else [""] * len(systems), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        vals = ok[col].dropna()
        if col == "TTFT (ms)" and len(vals) and vals.min() > 0 and vals.max() / vals.min() > 30:
            ax.set_xscale("log")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="mode")
    kv = ok[ok.system == "kvlab"].set_index("mode")["peak KV (MiB)"]
    axes[2].bar(["isolated", "shared"], [kv.get("isolated", 0), kv.get("shared", 0)], color=["tab:gray", "tab:blue"])
    axes[2].set_ylabel("peak KV bytes (MiB)")
    axes[0].set_title("time to first token")
    axes[1].set_title("throughput")
    axes[2].set_title("kvlab: KV cache in use at the peak")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def fig_sweep(sweep_table: Any, prefix_tokens: int, num_requests: int):
    """TTFT ratio vs prefix length (at ``num_requests``) and KV bytes vs requests (at ``prefix_tokens``)."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    d = sweep_table[sweep_table.requests == num_requests].sort_values("prefix tokens")
    a.plot(d["prefix tokens"], d["TTFT ratio"], "o-", label="measured shared/isolated")
    a.plot(d["prefix tokens"], d["ideal"], "k--", label="ideal (uncached tokens / all)")
    a.axvline(prefix_tokens, color="tab:red", alpha=0.4)
    top = max(1.1, 1.08 * float(max(d["TTFT ratio"].max(), d["ideal"].max()))) if len(d) else 1.1
    a.set(xlabel="shared prefix (tokens)", ylabel="TTFT shared / isolated", title=f"{num_requests} requests", ylim=(0, top))
    a.legend()
    d = sweep_table[sweep_table["prefix tokens"] == prefix_tokens].sort_values("requests")
    b.plot(d["requests"], d["KV isolated (MiB)"], "o-", color="tab:gray", label="isolated")
    b.plot(d["requests"], d["KV shared (MiB)"], "o-", color="tab:blue", label="shared")
    b.axvline(num_requests, color="tab:red", alpha=0.4)
    b.set(xlabel="requests", ylabel="peak KV (MiB)", title=f"{prefix_tokens}-token prefix")
    b.set_xticks(sorted(sweep_table["requests"].unique()))  # whole requests only, the counts measured
    a.set_xticks(sorted(sweep_table["prefix tokens"].unique()))
    b.legend()
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- engine speed against the machine
