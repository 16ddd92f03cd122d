"""The article's table 3.6, measured: isolated, shared (correct) and shared (wrong) for its three groups.

Every row runs the group's workload (``kvlab.lessons.workloads.seed_groups``) through kvlab's paged
engine (``kvlab.engine.Engine``), all requests submitted at once:

* **isolated**: prefix caching off, every request computes its whole prompt;
* **shared (correct)**: prefix caching on: whole blocks whose chained hash (all tokens before them, the
  model) matches are reused, read-only;
* **shared (wrong)**: the engine with one actual bug, a different one per group:

  1. ``PositionRestartEngine``: the cached prefix is reused, but the positions of the uncached tokens
     are counted from 0 instead of from the cached length (the article's section 3.4 warning);
  2. ``content_keyed_engine``: a block's cache key is its own token ids only (no parent hash, no
     position), so B's blocks hit the same text that donor A computed at a later start;
  3. ``beyond_prefix``: B is served on top of A's cached conversation (the cache keyed on the system
     prompt and handed A's history along with it), i.e. B's question appended to A's context.

Scores (per served request, against its isolated output): token agreement, identical, passphrase
recall; timing: TTFT and latency (arrival to first / last token), peak KV bytes of the engine.
The article's own figures are kept in ``ARTICLE_TABLE_36`` as *its claims*, never as our numbers.
"""

from __future__ import annotations

import hashlib
import statistics
from array import array
from collections.abc import Sequence
from typing import Any

from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.cache.block_manager import BlockManager
from kvlab.cache.block_pool import Block, BlockPool
from kvlab.engine import Engine, SamplingParams
from kvlab.lessons import passphrase as P
from kvlab.lessons.common import ROW_NAMES, Verdict, as_number, unanswered, verdict
from kvlab.lessons.nb03_position import token_agreement
from kvlab.lessons.workloads import GROUP_CONDITIONS, Workload

__all__ = ["ARTICLE_TABLE_36", "BUG_ROWS", "ContentKeyedBlockManager", "ContentKeyedPool", "PositionRestartEngine", "WRONG_MODES", "article_table",
           "check_bug_for_group", "check_kv_ratio", "check_position_fix", "compare_with_article", "content_hash",
           "content_keyed_engine", "evidence", "ttft_ratios", "ttft_text", "fig_table36", "make_engine", "run_mode", "table_36",
           "TRANSLATION", "TracingEngine", "answers_table", "bench_tables", "format_step", "groups_for",
           "is_real_chat_model", "latest_bench", "pick_model", "real_groups", "trace_three_requests"]

# The article's table 3.6 as it prints it: (group, policy, TTFT ms, total ms, GPU memory GB, output consistent).
# Its claims, on Qwen1.5-7B-Chat and a GPU; kept only to print beside our measurements.
ARTICLE_TABLE_36 = (
    (1, "isolated", 320, 580, 14.2, True),
    (1, "shared (correct)", 185, 410, 13.8, True),
    (2, "isolated", 315, 575, 14.2, True),
    (2, "shared (wrong)", 190, 420, 13.9, False),
    (3, "isolated", 318, 590, 14.3, True),
    (3, "shared (wrong)", 188, 415, 13.8, False),
)

WRONG_MODES = {
    1: "positions restart after the cached prefix",
    2: "cache key = a block's own tokens (another start's K/V)",
    3: "shared beyond the prefix (A's conversation K/V)",
}


def article_table():
    """The article's table 3.6 as a DataFrame (its claims, typed from the article, not measured here)."""
    import pandas as pd

    return pd.DataFrame([{"group": g, "mode": m, "condition": GROUP_CONDITIONS[g][0], "article (zh)": GROUP_CONDITIONS[g][1],
                          "TTFT (ms)": t, "total (ms)": tot, "memory (GB)": mem, "consistent": ok}
                         for g, m, t, tot, mem, ok in ARTICLE_TABLE_36])


# ----------------------------------------------------------------------------- bug 1: positions restart

class PositionRestartEngine(Engine):
    """The engine with one line changed: positions count only the tokens computed, not the cached ones.

    A request that hits the prefix cache prefills its uncached tokens at positions 0, 1, ... (as when
    a loop passes only the new tokens and lets the model number them from 0); a request without a hit
    is unaffected.
    """

    def _positions(self, item: Any) -> range:
        skipped = item.seq.num_cached_tokens or 0
        return range(item.start - skipped, item.end - skipped)  # the bug: Engine._positions is range(start, end)


# ----------------------------------------------------------------------------- bug 2: content-only keys

def content_hash(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """The bug's block key: sha256 of the block's own token ids (parent, position and model ignored)."""
    return hashlib.sha256(array("q", token_ids).tobytes()).digest()


class ContentKeyedPool(BlockPool):
    """A pool whose lookup trusts equal token ids alone (no parent check): the same text anywhere hits."""

    def lookup(self, block_hash: bytes, token_ids: Sequence[int], parent_serial: int, *args: Any,
               **kwargs: Any) -> Block | None:
        """A cached block with this hash and these tokens, wherever and after whatever it was computed."""
        return next((b for b in self.cached.get(block_hash, ()) if b.token_ids == list(token_ids)), None)


class ContentKeyedBlockManager(BlockManager):
    """kvlab's ``BlockManager`` keyed on each block's own tokens (``content_hash``, ``ContentKeyedPool``): the bug."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(num_blocks, block_size, hash_fn=content_hash)
        self.pool = ContentKeyedPool(num_blocks, block_size)  # built here, before any engine sees the manager


def content_keyed_engine(model: Any, tokenizer: Any, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, **kwargs: Any) -> Engine:
    """An engine whose prefix cache is keyed on each block's tokens only (no chain, no position)."""
    return Engine(model, tokenizer, cache=ContentKeyedBlockManager(num_blocks, block_size), **kwargs)


# ----------------------------------------------------------------------------- running one mode

def _num_blocks(workload: Workload, block_size: int) -> int:
    return sum(cdiv(len(p) + workload.max_tokens, block_size) for p in workload.prompts) + 8


def make_engine(model: Any, tokenizer: Any, group: int, mode: str, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                **kwargs: Any) -> Engine:
    """The engine of one row: "isolated", "shared (correct)" or "shared (wrong)" (the group's bug)."""
    kw = dict(num_blocks=num_blocks, block_size=block_size, **kwargs)
    if mode == "isolated":
        return Engine(model, tokenizer, enable_prefix_caching=False, **kw)
    if mode == "shared (correct)" or (mode == "shared (wrong)" and group == 3):
        return Engine(model, tokenizer, enable_prefix_caching=True, **kw)
    if mode == "shared (wrong)" and group == 1:
        return PositionRestartEngine(model, tokenizer, enable_prefix_caching=True, **kw)
    if mode == "shared (wrong)" and group == 2:
        return content_keyed_engine(model, tokenizer, **kw)
    raise ValueError(f"unknown mode {mode!r} for group {group}")


def _prompts(workload: Workload, group: int, mode: str) -> list[list[int]]:
    if group == 3 and mode == "shared (wrong)":  # B's question on top of A's conversation
        return [m.get("beyond_prompt", p) for p, m in zip(workload.prompts, workload.meta)]
    return workload.prompts


def run_mode(model: Any, tokenizer: Any, workload: Workload, group: int, mode: str, block_size: int = DEFAULT_BLOCK_SIZE,
             max_num_batched_tokens: int = 4096, max_tokens: int | None = None, donors: bool = True) -> dict[str, Any]:
    """Run one row once: the engine's outputs (prompt order), peak KV bytes and the engine's stats.

    Donors (they only fill the cache) get one new token; ``donors=False`` leaves them out (their outputs are None),
    for a row whose answers alone count. ``max_tokens=1`` makes a prefill-only run, whose TTFT is the full run's
    (every request is admitted in the first step)."""
    engine = make_engine(model, tokenizer, group, mode, _num_blocks(workload, block_size), block_size,
                         max_num_batched_tokens=max_num_batched_tokens)
    new = workload.max_tokens if max_tokens is None else max_tokens
    meta = workload.meta or [{}] * len(workload)
    keep = [i for i, m in enumerate(meta) if donors or m.get("role") != "donor"]
    prompts = _prompts(workload, group, mode)
    sampling = [SamplingParams(max_tokens=1 if meta[i].get("role") == "donor" else new) for i in keep]
    got = engine.generate([prompts[i] for i in keep], sampling)
    bad = [o.error for o in got if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]}")
    outs: list[Any] = [None] * len(workload)
    for i, o in zip(keep, got):
        outs[i] = o
    return {"outputs": outs, "peak_kv_bytes": engine.peak_kv_bytes, "stats": engine.stats()}


def _recalled(meta: dict[str, Any], text: str, key: str = "expected") -> bool:
    return (P.mentions if meta.get("lenient") else P.recalled)(text, meta[key])


def _score_rows(workload: Workload, reference: list[Any], run: dict[str, Any]) -> dict[str, float]:
    served = workload.served()
    outs = run["outputs"]
    agree = [token_agreement(reference[i].output_ids, outs[i].output_ids) for i in served]
    same = [reference[i].output_ids == outs[i].output_ids for i in served]
    asked = [i for i in served if "expected" in workload.meta[i]]  # translations have no expected answer
    recall = [_recalled(workload.meta[i], outs[i].text) for i in asked]
    other = [_recalled(workload.meta[i], outs[i].text, "other_answer") for i in served
             if "other_answer" in workload.meta[i]]
    return {"token agreement": statistics.mean(agree), "identical": statistics.mean(same),
            "recall": statistics.mean(recall) if recall else float("nan"),
            "answered A's passphrase": statistics.mean(other) if other else float("nan"),
            "cached tokens": statistics.mean(outs[i].num_cached_tokens for i in served)}


MODES = ("isolated", "shared (correct)", "shared (wrong)")


def _mean_ttft_ms(run: dict[str, Any], served: list[int]) -> float:
    return statistics.mean(run["outputs"][i].ttft for i in served) * 1e3


def table_36(model: Any, tokenizer: Any, groups: dict[int, Workload], repeats: int = 3, block_size: int = DEFAULT_BLOCK_SIZE,
             progress: bool = False, timed: Sequence[int] | None = None, warmup: bool = True):
    """The table: per group, isolated / shared (correct) / shared (wrong).

    Each row runs once in full (answers, scores, latency, peak KV, the first TTFT); the groups in ``timed`` (default:
    all) run ``repeats - 1`` more prefill-only times per mode, the modes interleaved, for the TTFT's median and
    spread. The other groups are scored on their answers only: their isolated row runs without the donors (which
    change no scored answer) and their time and KV columns are NaN (``timed runs`` 0). Returns ``(table, runs)``:
    a DataFrame with one row per (group, mode) (``TTFT runs (ms)``: each run's mean TTFT), and the full run of
    each row (outputs and stats) keyed by ``(group, mode)``.
    """
    import pandas as pd

    timed = set(groups) if timed is None else set(timed)
    if warmup:
        first = next(iter(groups.values()))
        warm = Workload(first.name, first.prompts[:2], 2, first.meta[:2])
        run_mode(model, tokenizer, warm, 1, "isolated", block_size)  # warm-up (first-call costs), not timed
    todo = [(g, m, None) for g in groups for m in MODES]
    todo += [(g, m, 1) for g in groups if g in timed for _ in range(repeats - 1) for m in MODES]
    if progress:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc="table 3.6 runs")
    runs, ttft = {}, {(g, m): [] for g in groups for m in MODES}
    for group, mode, new in todo:
        donors = group in timed or mode != "isolated"
        run = run_mode(model, tokenizer, groups[group], group, mode, block_size, max_tokens=new, donors=donors)
        runs.setdefault((group, mode), run)
        if group in timed:
            ttft[(group, mode)].append(_mean_ttft_ms(run, groups[group].served()))
    rows, nan = [], float("nan")
    for group in groups:
        wl = groups[group]
        reference = runs[(group, "isolated")]["outputs"]
        for mode in MODES:
            run, times = runs[(group, mode)], ttft[(group, mode)]
            latency = statistics.mean(run["outputs"][i].latency for i in wl.served()) * 1e3 if times else nan
            rows.append({"group": group, "condition": GROUP_CONDITIONS[group][0], "mode": mode,
                         "bug": WRONG_MODES[group] if mode == "shared (wrong)" else "",
                         "requests": len(wl.served()), "TTFT (ms)": statistics.median(times) if times else nan,
                         "TTFT min (ms)": min(times, default=nan), "TTFT max (ms)": max(times, default=nan),
                         "timed runs": len(times), "TTFT runs (ms)": tuple(times), "total latency (ms)": latency,
                         "peak KV (KiB)": run["peak_kv_bytes"] / 1024 if times else nan,
                         **_score_rows(wl, reference, run)})
    return pd.DataFrame(rows), runs


def ttft_ratios(table: Any, group: int, mode: str) -> list[float]:
    """Per run, ``mode``'s mean TTFT over the isolated row's in the same repeat (the runs are interleaved)."""
    d = table.set_index(["group", "mode"])
    if "TTFT runs (ms)" not in d.columns:
        return [d.loc[(group, mode), "TTFT (ms)"] / d.loc[(group, "isolated"), "TTFT (ms)"]]
    return [a / b for a, b in zip(d.loc[(group, mode), "TTFT runs (ms)"], d.loc[(group, "isolated"), "TTFT runs (ms)"])]


def ttft_text(table: Any, group: int, mode: str, repeats: int | None = None) -> str:
    """``TTFT x0.71 (x0.66-x0.80 over 3 paired runs)``, or one run's ratio marked as not evidence."""
    ratios = ttft_ratios(table, group, mode)
    if not ratios or ratios[0] != ratios[0]:  # an answers-only group: no timing
        return "TTFT not timed (answers only)"
    n = len(ratios) if repeats is None or len(ratios) > 1 else repeats
    mid = statistics.median(ratios)
    if n < 3:
        return f"TTFT x{mid:.2f} ({n} run{'s' if n > 1 else ''}: a timing, not evidence)"
    spread = f"x{min(ratios):.2f}-x{max(ratios):.2f} over {n} paired runs" if len(ratios) > 1 else f"median of {n} runs"
    return f"TTFT x{mid:.2f} ({spread})"


def compare_with_article(table: Any):
    """Per group: shared/isolated ratios of TTFT, latency and memory, ours beside the article's claims."""
    import pandas as pd

    art = {(g, m): (t, tot, mem, ok) for g, m, t, tot, mem, ok in ARTICLE_TABLE_36}
    rows = []
    for group in sorted(table["group"].unique()):
        d = table[table.group == group].set_index("mode")
        iso = d.loc["isolated"]
        for mode in ("shared (correct)", "shared (wrong)"):
            ours = d.loc[mode]
            a_iso, a = art.get((group, "isolated")), art.get((group, mode))
            rows.append({
                "group": group, "mode": mode,
                "TTFT ratio, ours": ours["TTFT (ms)"] / iso["TTFT (ms)"],
                "TTFT ratio, article": a[0] / a_iso[0] if a else float("nan"),
                "latency ratio, ours": ours["total latency (ms)"] / iso["total latency (ms)"],
                "latency ratio, article": a[1] / a_iso[1] if a else float("nan"),
                "KV ratio, ours": ours["peak KV (KiB)"] / iso["peak KV (KiB)"],
                "memory ratio, article": a[2] / a_iso[2] if a else float("nan"),
                "identical, ours": ours["identical"],
                "consistent, article": a[3] if a else None,
                "timed runs": int(min(ours.get("timed runs", 1), iso.get("timed runs", 1))),  # 0: answers only
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
    untimed = sorted({int(g) for i, g in enumerate(table["group"]) if i not in timed})
    note = f" (groups {', '.join(map(str, untimed))}: answers only, not timed)" if untimed else ""
    a.set(ylabel="mean TTFT (ms)", title="time to first token" + note)
    a.title.set_fontsize(9)
    b.plot(range(len(table)), table["token agreement"], "o", label="token agreement with isolated")
    b.plot(range(len(table)), table["recall"], "s", mfc="none", label="passphrase recall")
    b.set_xticks(range(len(table)), labels, rotation=60, ha="right", fontsize=8)
    b.set(ylim=(-0.05, 1.05), ylabel="fraction", title="output consistency")
    b.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=2, fontsize=8, frameon=False)  # above the axes
    fig.tight_layout()
    return fig


def evidence(table: Any, repeats: int | None = None) -> dict[str, str]:
    """Decision-table evidence (row name -> text) from a measured table 3.6: answers from the scored requests, a
    TTFT ratio with its spread over the paired runs (fewer than three runs are marked as not evidence)."""
    d = table.set_index(["group", "mode"])

    def row(g: int, m: str) -> str:
        r = d.loc[(g, m)]
        recall = "" if r["recall"] != r["recall"] else f", recall {r['recall']:.0%}"
        n = f"{int(r['requests'])} requests: " if "requests" in r else ""
        timing = ttft_text(table, g, m, repeats)
        return f"{n}{r['identical']:.0%} identical{recall}" + ("" if timing.startswith("TTFT not timed") else f", {timing}")

    return {
        "identical-prefix": f"nb05 group 1, engine prefix cache: {row(1, 'shared (correct)')}",
        "same-start": f"nb05 group 2, B after donor A's other start: chained keys "
                      f"{d.loc[(2, 'shared (correct)'), 'cached tokens']:.1f} cached tokens per request; "
                      f"content-only keys: {d.loc[(2, 'shared (wrong)'), 'cached tokens']:.1f}, {row(2, 'shared (wrong)')}",
        "positions-agree": f"nb05 group 1 with positions restarting after the cache: {row(1, 'shared (wrong)')}",
        "independent-context": f"nb05 group 3 shared beyond the prefix: {row(3, 'shared (wrong)')}, "
                               f"answered A's passphrase {d.loc[(3, 'shared (wrong)'), 'answered A' + chr(39) + 's passphrase']:.0%}",
        "overlap-different-start": f"nb05 group 2 served with another start's K/V: {row(2, 'shared (wrong)')}",
    }


def end_of_turn_note(detail: dict[str, dict], end_ids: int | Sequence[int] | None,
                     reference: str = "HF generate (batch)/isolated") -> str:
    """Why a headline row's token agreement with HF generate is below 1, read off the outputs.

    The engines run with ``ignore_eos`` and keep emitting an end-of-turn token the model picks; HF
    generate's reference is forced to the full length (``min_new_tokens`` masks the end tokens), so
    after a chosen end token the two continue differently. Returns "" when nothing ended early.
    """
    ref = detail.get(reference, {}).get("outputs")
    end = {end_ids} if isinstance(end_ids, int) else set(end_ids or ())
    if not ref or not end:
        return ""
    ends, before, agree = [], 0, 0
    for key, run in detail.items():
        if key == reference or "outputs" not in run:
            continue
        for r, out in zip(ref, run["outputs"]):
            stop = next((i for i, t in enumerate(out) if t in end), None)
            if stop is None:
                continue
            ends.append(stop + 1)
            before += stop
            agree += sum(a == b for a, b in zip(r[:stop], out[:stop]))
    if not ends:
        return ""
    n = len(ref[0])
    tail = f" Before the end token, agreement is {agree / before:.2f}." if before else ""
    return (f"token agreement below 1 is the end of turn: in {len(ends)} request runs the model chose an end token "
            f"as token {min(ends)}{'' if min(ends) == max(ends) else f' to {max(ends)}'} of {n}; every other system keeps emitting it, HF generate is forced "
            f"past it (min_new_tokens masks it), so from there on the tokens differ.{tail}")


# ----------------------------------------------------------------------------- exercise checkers

BUG_ROWS = {1: {"positions-agree"}, 2: {"same-start", "overlap-different-start"}, 3: {"independent-context"}}


def check_bug_for_group(answer: dict[int, str] | None) -> Verdict:
    """Exercise 05.1: which decision-table row does each group's bug break? ``{group: row name}``.

    Row names as in the decision table's index (``kvlab.lessons.common.ROW_NAMES``), e.g. "same-start".
    """
    hint = "give a dict {group: row name}, the names in the first column of the decision table"
    if not answer:
        return unanswered(hint)
    try:
        got = {int(k): v for k, v in dict(answer).items()}
    except (TypeError, ValueError):
        return verdict(False, hint=hint)
    unknown = sorted(str(v) for v in got.values() if v not in ROW_NAMES)
    if unknown:
        return verdict(False, hint=f"{unknown} is not a row name; the rows are {list(ROW_NAMES)}")
    wrong = [g for g in BUG_ROWS if got.get(g) not in BUG_ROWS[g]]
    return verdict(not wrong, "each bug breaks the row its group tests",
                   f"group(s) {wrong}: re-read which condition the bug violates")


def check_position_fix(engine_cls: type | None, model: Any, tokenizer: Any, workload: Workload,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> Verdict:
    """Exercise 05.3: an ``Engine`` subclass that keeps the prefix cache on and numbers positions right."""
    hint = "positions must continue after the cached tokens, and the prefix cache must stay on"
    if engine_cls is None:
        return unanswered("define a subclass of T.PositionRestartEngine whose _positions numbers the computed tokens right; "
                          + hint)
    kw = dict(num_blocks=_num_blocks(workload, block_size), block_size=block_size)
    sp = SamplingParams(max_tokens=workload.max_tokens)
    reference = Engine(model, tokenizer, enable_prefix_caching=False, **kw).generate(workload.prompts, sp)
    try:
        outs = engine_cls(model, tokenizer, enable_prefix_caching=True, **kw).generate(workload.prompts, sp)
    except Exception as err:  # the learner's code may fail in any way
        return verdict(False, hint=f"your engine raised {type(err).__name__}: {err}")
    same = sum(a.output_ids == b.output_ids for a, b in zip(outs, reference))
    cached = sum(o.num_cached_tokens for o in outs)
    return verdict(same == len(outs) and cached > 0, f"{same}/{len(outs)} identical with {cached} cached tokens",
                   f"{same}/{len(outs)} requests identical to isolated, {cached} cached tokens: {hint}")


def check_kv_ratio(answer: float | None, num_requests: int, prefix_tokens: int, private_tokens: int,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> Verdict:
    """Exercise 05.2: the block-granular shared/isolated KV ratio for ``num_requests`` sharing a prefix.

    ``private_tokens`` per request (suffix + new tokens whose K/V is stored); full prefix blocks are
    stored once, everything else (partial prefix block included) per request.
    """
    hint = "compute (shared blocks + private blocks) / isolated blocks; count blocks, not tokens (a partial block is a whole block)"
    if answer is None:
        return unanswered(hint)
    value = as_number(answer)
    if value is None:
        return verdict(False, hint=f"give a number, not {answer!r}")
    full = prefix_tokens // block_size
    per_request = cdiv(prefix_tokens + private_tokens, block_size)
    want = (full + num_requests * (per_request - full)) / (num_requests * per_request)
    return verdict(abs(value - want) < 1e-3, f"{want:.4f}", f"not {value:.4f}: {hint}")


# ----------------------------------------------------------------------------- the real chat model (SmolLM2)

# The article's translation example (its 2.2 and 3.3-3.5): one prefix, several texts to translate.
TRANSLATION = {
    "zh": ("你是一个专业的翻译助手，请将以下内容翻译成英文。", ("今天天气很好。", "明天会下雨吗？")),
    # the same request in English; a 135M model does not translate into Chinese, so the target is French
    "en": ("You are a professional translation assistant. Please translate the following into French.",
           ("The weather is nice today.", "Will it rain tomorrow?")),
}
UPDATE_TURN = ("From now on the passphrase is {p}.", "Understood. The passphrase is now {p}.")


def pick_model(model: Any, smoke: bool) -> Any:
    """The notebook's ``MODEL="auto"``: SmolLM2 on a full run, the bundled tiny model (None) under SMOKE."""
    if model == "auto":
        return None if smoke else "smollm2"
    return model


def is_real_chat_model(tokenizer: Any) -> bool:
    """True for a general chat model with its own chat template (SmolLM2), False for the bundled passphrase model."""
    from pathlib import Path

    from kvlab.engine.models import BUNDLED_MODEL

    name = getattr(tokenizer, "name_or_path", "") or ""
    if name and Path(name).expanduser().resolve() == BUNDLED_MODEL.resolve():
        return False  # the bundled model speaks ChatML too, but only its training prompts
    return bool(getattr(tokenizer, "chat_template", None)) and "im_start" in str(tokenizer.chat_template)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _turns(system: str, *turns: tuple[str, str], question: str) -> str:
    text = P.chatml("system", system)
    for user, assistant in turns:
        text += P.chatml("user", user) + P.chatml("assistant", assistant)
    return text + P.chatml("user", question) + P.IM_START + "assistant\n"


def real_groups(tokenizer: Any, n: int = 4, questions: int = 2, block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 16,
                split: str = "heldout", start: int = 0, translations: int = 2, n_wrong: int | None = None,
                wrong_questions: int = 1) -> dict[int, Workload]:
    """The article's three groups in real text for a ChatML chat model (SmolLM2), as token-id workloads.

    Group 1: ``n`` passphrase system prompts (``passphrase.REAL_SYSTEM``), ``questions`` different questions
    each, plus the article's translation prefix in Chinese and in English with two texts each. Group 2: B's
    passphrase prompt, and donor A = a block-aligned extra system turn + B's whole text. Group 3: the same
    system prompt; A's history changes the passphrase, B asks without that history. Answers are scored with
    ``passphrase.mentions`` (a chat model answers in a sentence); translations have no expected answer.
    Groups 2 and 3 score ``n_wrong`` requests each (default ``n``): group 2 one per passphrase (each its own donor, so
    no two scored requests share a start), group 3 ``wrong_questions`` per passphrase (the donor asks the first).
    """
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

    prompts, meta, donors = [], [], {}
    from kvlab.lessons.workloads import _aligned_preamble

    m = n if n_wrong is None else n_wrong
    if wrong_questions < 1 or m % wrong_questions:
        raise ValueError(f"n_wrong={m} must be a multiple of wrong_questions={wrong_questions} (>= 1)")

    def passphrases(k: int) -> list[tuple[int, Any]]:
        return [(seed, P.make_example(seed, split, history="none")) for seed in range(start, start + k)]

    for seed, ex in passphrases(m):
        b = _ids(tokenizer, _turns(P.REAL_SYSTEM.format(p=ex.passphrase), question=P.REAL_QUESTIONS[0]))
        pre = _aligned_preamble(tokenizer, seed, block_size, split)
        donors[seed] = len(prompts)
        prompts.append(pre + b)
        meta.append({"group": 2, "seed": seed, "role": "donor", "expected": ex.answer, "lenient": True,
                     "offset": len(pre)})
    for seed, ex in passphrases(m):
        prompts.append(_ids(tokenizer, _turns(P.REAL_SYSTEM.format(p=ex.passphrase), question=P.REAL_QUESTIONS[0])))
        meta.append({"group": 2, "seed": seed, "role": "served", "expected": ex.answer, "lenient": True,
                     "donor": donors[seed], "offset": meta[donors[seed]]["offset"]})
    groups[2] = Workload("real-groups/2", prompts, max_tokens, meta)

    prompts, meta = [], []
    asked = P.REAL_QUESTIONS[:wrong_questions]
    for seed, ex in passphrases(m // wrong_questions):
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
    from kvlab.lessons.workloads import seed_groups

    if is_real_chat_model(tokenizer):
        return real_groups(tokenizer, n=n, block_size=block_size, max_tokens=max_tokens, translations=translations,
                           n_wrong=n_wrong, wrong_questions=wrong_questions)
    return seed_groups(tokenizer, n=n, block_size=block_size, max_tokens=max_tokens)


def answers_table(groups: dict[int, Workload], runs: dict, tokenizer: Any, per_group: int = 3):
    """Real answers side by side: per group, a few served requests isolated / shared (correct) / shared (wrong)."""
    import pandas as pd

    rows = []
    for g, wl in groups.items():
        served = wl.served()
        picks = served[:per_group]
        if g == 1:  # show the translations too
            picks += [i for i in served if wl.meta[i].get("kind") == "translation"]
        for i in dict.fromkeys(picks):
            m = wl.meta[i]
            q = m.get("question")
            rows.append({"group": g, "request": q[:40] if g == 1 and isinstance(q, str) else f"seed {m['seed']}",
                         "expected": m.get("expected", "(translation)"),
                         **{mode: runs[(g, mode)]["outputs"][i].text.strip().split("\n")[0][:70]
                            for mode in ("isolated", "shared (correct)", "shared (wrong)")},
                         "A's passphrase": m.get("other_answer", "")})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- the engine, opened: one traced step

class TracingEngine(Engine):
    """The engine unchanged, plus a record of what every step sends to the model (for printing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace: list[dict[str, Any]] = []

    def _forward(self, sched: Any) -> Any:
        from kvlab.engine.paged_attention import build_batch

        bm, bs = self.block_manager, self.block_manager.block_size
        spans = [(it.start, it.end, bm.block_table(it.seq.seq_id)) for it in sched.items]
        batch = build_batch(self.store, spans)
        rows = []
        for it, (s, e, table) in zip(sched.items, spans):
            cached = (it.seq.num_cached_tokens or 0) if it.is_prefill else 0
            rows.append({"request": it.seq.request_id, "kind": "prefill" if it.is_prefill else "decode",
                         "positions": (s, e), "query rows": e - s, "block table": list(table),
                         "hit blocks": list(table[: cached // bs]), "cached tokens": cached})
        self.trace.append({"step": self.num_steps, "rows": rows, "slot_mapping": batch.slot_mapping.tolist(),
                           "attention groups": [g.query_index.shape for g in batch.groups]})
        return super()._forward(sched)


def _runs(values: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3..5, 9"``: contiguous runs of a slot mapping."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]}..{values[j]}" if j > i else f"{values[i]}")
        i = j + 1
    return ", ".join(out)


def trace_three_requests(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], first: Sequence[int],
                         block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 2) -> list[dict[str, Any]]:
    """Serve ``first`` alone (it fills the prefix cache), then ``prompts`` (three) at once; return their steps.

    The trace of the second ``generate``: its first step is the three prefills (with their prefix-cache
    hits), the next ones are decodes.
    """
    blocks = sum(cdiv(len(p) + max_tokens, block_size) for p in [first, *prompts]) + 4
    engine = TracingEngine(model, tokenizer, num_blocks=blocks, block_size=block_size, enable_prefix_caching=True)
    engine.generate([list(first)], SamplingParams(max_tokens=max_tokens))
    engine.trace.clear()
    engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=max_tokens))
    return engine.trace


def format_step(step: dict[str, Any], block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """One traced step as text: per request its positions, block table, hit blocks; then the slot mapping."""
    lines = [f"step {step['step']}: {sum(r['query rows'] for r in step['rows'])} query rows in one packed forward"]
    off = 0
    for r in step["rows"]:
        s, e = r["positions"]
        slots = step["slot_mapping"][off:off + r["query rows"]]
        off += r["query rows"]
        lines.append(f"  request {r['request']!s:>3} {r['kind']:7s} positions {s}..{e - 1} ({r['query rows']} query rows), "
                     f"block table {r['block table']}")
        if r["kind"] == "prefill":
            lines.append(f"      prefix-cache hits: blocks {r['hit blocks']} ({r['cached tokens']} tokens, not computed)")
        lines.append(f"      slot mapping (block x {block_size} + offset) of its new K/V: {_runs(slots)}")
    lines.append(f"  attention groups (sequences x padded query rows): {[tuple(s) for s in step['attention groups']]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the recorded benchmark

def latest_bench(model_name: Any, path: Any = None) -> dict | None:
    """``build/bench/bench.json`` (written by ``scripts/bench.py``) if it was run on ``model_name`` at full size, else None."""
    import json
    from pathlib import Path

    path = Path(path) if path is not None else Path(__file__).resolve().parents[2] / "build" / "bench" / "bench.json"
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    want = str(model_name or "bundled").lower()
    got = str(report.get("model", {}).get("config", "")).lower()
    if got != want or report.get("workload", {}).get("prefix_tokens") != 512:
        return None
    report["path"] = str(path)
    return report


def bench_tables(report: dict):
    """The recorded benchmark's system table and ratio table as DataFrames (``error`` filled with "")."""
    import pandas as pd

    table = pd.DataFrame(report["systems"])
    table["error"] = table.get("error", pd.Series([""] * len(table))).fillna("")
    return table, pd.DataFrame(report["ratios"])


def request_path(engine: Engine, request_id: Any) -> dict[str, Any]:
    """A running request's path through the engine now: its tokens, block table, slot mapping, cached tokens."""
    if request_id not in engine.requests:
        raise KeyError(f"request {request_id!r} is not running (finished or never added): step() it first, "
                       "and give it max_tokens > 1 so it is still there")
    seq_id = engine.requests[request_id].seq_id
    bm = engine.block_manager
    return {"request_id": request_id, "block_size": bm.block_size, "num_tokens": len(bm.seqs[seq_id].token_ids),
            "block_table": bm.block_table(seq_id), "slot_mapping": bm.slot_mapping(seq_id),
            "cached_tokens": bm.num_cached_tokens(seq_id)}


def fig_request_path(path: dict[str, Any], max_tokens: int = 48) -> Any:
    """One request through the engine: token position -> logical block -> physical block -> slot in the K/V store.

    A long request is drawn in a window of ``max_tokens`` positions around where its cached part ends."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bs, table, total, cached = path["block_size"], path["block_table"], path["num_tokens"], path["cached_tokens"]
    lo = min(max(0, (cached - max_tokens // 2) // bs * bs), max(0, total - max_tokens))
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
    ax.set_xlim(-0.2, hi - lo)
    ax.set_ylim(-0.2, 2.8)
    ax.axis("off")
    shown = "" if (lo, hi) == (0, total) else f" (positions {lo}–{hi - 1} shown)"
    ax.set_title(f"request {path['request_id']!r}: {total} tokens, block size {bs}, "
                 f"{cached} tokens from the cache{shown}", fontsize=10)
    fig.tight_layout()
    return fig
