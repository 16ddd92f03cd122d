"""Notebook 08: why is my hit rate low? The doctor on a realistic log, each culprit, time on the engine, 5.4.

Tables and sentences are built here from a ``kvlab.doctor.Diagnosis``; the figures are the doctor's own
(``kvlab.doctor.report.fig_*``). ``engine_ttft`` replays a few requests through the paged engine to
turn a hit-rate gain into time to first token. The checkers run the reader's answer against a replay
and never print the answer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.doctor import Diagnosis
from kvlab.doctor.culprits import Culprit, record_segments
from kvlab.doctor.logio import read_log
from kvlab.doctor.prepare import prepare
from kvlab.doctor.replay import replay_block_manager, replay_tokens
from kvlab.doctor.report import fig_divergence, fig_hit_rates, pct  # noqa: F401  (re-exported)
from kvlab.doctor.tokenization import PromptEncoder, ids, tokstr
from kvlab.lessons import common  # noqa: F401  (registers the CJK font for the doctor's figures)
from kvlab.lessons.doctor_log import make_log

KIND_NAMES = {"volatile": "a per-request field (timestamp, id)", "per-user": "a per-user field (name, account)",
              "per-session": "a per-conversation field", "order": "items in varying order (RAG documents)",
              "tools-order": "tools in varying order", "whitespace": "whitespace differences",
              "template": "another chat markup", "multi-turn": "history rebuilt, not appended",
              "alignment": "shared prefix not aligned to blocks", "tenant-salt": "tenant salts split a shared prefix"}


def notebook_log(smoke: bool, seed: int = 0) -> tuple[list[dict], Any]:
    """The notebook's log: a help desk and a coding assistant, short enough for the bundled model's 1,024 positions."""
    return make_log(support_conversations=60 if smoke else 330, coding_conversations=20 if smoke else 110,
                    users=30 if smoke else 120, doc_sentences=1, rules=4, tools=4, seed=seed)


def requests_table(log: Sequence[dict], n: int = 6) -> pd.DataFrame:
    """A few requests: app, tenant, user, session, time, messages, and the start of the system prompt."""
    rows = []
    for r in log[:n]:
        first = r["messages"][0]["content"] if "messages" in r else r["prompt"]
        rows.append({"app": r.get("app"), "tenant": r.get("tenant"), "user": r.get("user"), "session": r.get("session"),
                     "timestamp": r.get("timestamp"), "messages": len(r.get("messages", [])),
                     "tools": len(r.get("tools", []) or []), "system prompt starts": first[:70].replace("\n", " ⏎ ")})
    return pd.DataFrame(rows)


def hit_table(d: Diagnosis) -> pd.DataFrame:
    """Hit rate per block size: unbounded, at the capacity, without salts; the ceiling."""
    rows = []
    for r in d.table:
        rows.append({"block size": r["block_size"], "unbounded cache": r["unbounded_hit_rate"],
                     "capacity (blocks)": r["capacity_blocks"], "at capacity": r.get("capacity_hit_rate"),
                     "without tenant salts": r.get("unsalted_hit_rate"),
                     "requests sharing < 1 block": r["short_requests"]})
    out = pd.DataFrame(rows).set_index("block size")
    out.attrs["ceiling"] = d.ceiling["hit_rate"]
    return out


def points_table(points: Sequence[dict]) -> pd.DataFrame:
    """The most common divergence points with the text around them."""
    return pd.DataFrame([{"token": p["position"], "requests": p["requests"], "…text before": "…" + p["before"][-40:],
                          "this request goes on": p["after_request"][:30], "the earlier prompt went on": p["after_partner"][:30]}
                         for p in points]).replace({"\n": "⏎"}, regex=True)


def culprit_table(d: Diagnosis) -> pd.DataFrame:
    """The culprits whose fix changed the replay, in fix order, with the numbers before and after."""
    k = d.cap_key
    rows = []
    for n, c in enumerate(d.kept, 1):
        rows.append({"#": n, "culprit": KIND_NAMES.get(c.kind, c.kind), "where": c.where, "token": c.position,
                     "requests": c.affected, "hit rate before": c.before[k]["hit_rate"],
                     "after this fix": c.chained[k]["hit_rate"],
                     "prefill tokens before": c.before[k]["computed_tokens"],
                     "after": c.chained[k]["computed_tokens"],
                     "this fix alone": c.alone[k]["hit_rate"] if c.alone else None})
    return pd.DataFrame(rows).set_index("#")


def dropped_table(d: Diagnosis) -> pd.DataFrame:
    """Candidates the doctor measured and dropped: their fix did not change the replay enough."""
    return pd.DataFrame([{"candidate": c.title[:90], "hit rate before (unbounded)": c.before["unbounded"]["hit_rate"],
                          "with its fix": c.chained["unbounded"]["hit_rate"] if c.chained else None}
                         for c in d.culprits if c.no_effect])


def sentence(c: Culprit, cap_key: str) -> str:
    """'Fixing X took the hit rate from a to b (+p points) and the prefill from m to n tokens.'"""
    b, a = c.before[cap_key], c.chained[cap_key]
    change = a["hit_rate"] - b["hit_rate"]
    verb = "raised" if change > 0 else "lowered" if change < 0 else "left"
    saved = b["computed_tokens"] - a["computed_tokens"]
    return (f"Fixing {KIND_NAMES.get(c.kind, c.kind)} {verb} the hit rate from {pct(b['hit_rate'])} to "
            f"{pct(a['hit_rate'])} ({100 * change:+.1f} points): {abs(saved)} prompt tokens "
            f"{'fewer' if saved >= 0 else 'more'} to prefill ({b['computed_tokens']} -> {a['computed_tokens']}).")


def card(c: Culprit, cap_key: str) -> str:
    """A culprit as text: title, where, evidence, fix, and the measured sentence."""
    lines = [f"{c.title}", f"  where: {c.where}" + (f", from token ~{c.position}" if c.position is not None else "")]
    lines += [f"  - {e}" for e in c.evidence]
    lines.append(f"  fix: {c.fix_text}")
    if c.chained is not None and c.before is not None and cap_key in c.chained:
        lines.append("  " + sentence(c, cap_key))
    return "\n".join(lines)


def first_request(d: Diagnosis, app: str) -> int:
    """Index of the first request of an app that carries more than one message (a follow-up turn if any)."""
    return next((i for i, r in enumerate(d.prep.records) if r.get("app") == app and r.kind == "messages"
                 and len(r.messages) > 2), next(i for i, r in enumerate(d.prep.records) if r.get("app") == app))


def before_after(c: Culprit, d: Diagnosis, i: int, chars: int = 260) -> tuple[str, str]:
    """The start of the system message and of the last user message of request ``i``, before and after a fix."""
    rec = d.prep.records[i]
    fixed = c.fix([rec])[0]

    def show(r) -> str:
        segs = record_segments(r)
        system = next((x for role, _, x in segs if role == "system"), "")
        user = next((x for role, _, x in reversed(segs) if role == "user"), "")
        return f"[system] {system[:chars]}…\n[last user message] {user[:chars]}"
    return show(rec), show(fixed)


def engine_ttft(model: Any, tok: Any, prompts: dict[str, list[list[int]]], block_size: int = DEFAULT_BLOCK_SIZE,
                num_blocks: int | None = None, repeats: int = 1) -> pd.DataFrame:
    """Each variant's prompts, one at a time, through a fresh paged engine with prefix caching.

    Per variant: the engine's hit rate and the doctor's replay of the same prompts (they must agree), and
    the time to first token (median and total over the requests). ``num_blocks`` defaults to room for
    every prompt of a variant (no eviction, like the doctor's unbounded replay).
    """
    from kvlab.engine import Engine, SamplingParams

    if num_blocks is None:
        num_blocks = max(sum(cdiv(len(p) + 1, block_size) for p in ps) for ps in prompts.values()) + 4
    rows = []
    warm = Engine(model, tok, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    warm.generate([next(iter(prompts.values()))[0]], SamplingParams(max_tokens=1))  # warm-up, not counted
    for name, ps in prompts.items():
        ttfts = []
        for _ in range(repeats):
            engine = Engine(model, tok, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)
            outs = [engine.generate([p], SamplingParams(max_tokens=1))[0] for p in ps]
            ttfts.append([o.ttft for o in outs])
        st = engine.stats()
        doctor = replay_tokens([tokstr(p) for p in ps], block_size)
        per = [statistics.median(x) for x in zip(*ttfts)]
        rows.append({"variant": name, "requests": len(ps), "prompt tokens": sum(map(len, ps)),
                     "engine cached tokens": sum(o.num_cached_tokens for o in outs), "engine hit rate": st["hit_rate"],
                     "doctor's replay": doctor.hit_rate, "median TTFT (ms)": 1000 * statistics.median(per),
                     "total TTFT (s)": sum(per)})
    return pd.DataFrame(rows).set_index("variant")


def fit_prompts(tokens: Sequence[str], max_len: int, n: int) -> list[int]:
    """Indices of the first ``n`` prompts no longer than ``max_len`` tokens."""
    return [i for i, t in enumerate(tokens) if len(t) <= max_len][:n]


ARTICLE_54 = [
    ("系统提示词固定不变，作为共享前缀的主体", "keep the system prompt fixed: it is the body of the shared prefix"),
    ("前缀长度对齐到16 token的整数倍", "align the prefix length to a multiple of 16 tokens"),
    ("动态内容（时间、用户ID等）放到后缀", "put dynamic content (time, user id) in the suffix"),
    ("多轮对话只共享系统提示词，对话历史不共享", "multi-turn: share only the system prompt, not the history"),
    ("开启写时复制，确保共享块只读", "copy-on-write: shared blocks are read-only"),
    ("监控前缀命中率和显存占用，设置告警阈值", "monitor the hit rate and KV memory, with alert thresholds"),
    ("每次模型或tokenizer更新后重新验证前缀一致性", "re-verify prefix consistency after every model or tokenizer update"),
]


def template_54(d: Diagnosis, other_tokenizer: tuple[str, float, float] | None = None) -> pd.DataFrame:
    """The article's 5.4 strategy template, each line with what this log measured."""
    k = d.cap_key
    base = d.baseline[k]["hit_rate"]
    final = d.chain[-1][f"{k}_hit_rate"]

    def gain(kinds: tuple[str, ...]) -> str:
        cs = [c for c in d.kept if c.kind in kinds]
        if not cs:
            return "no such culprit kept in this log"
        return "; ".join(f"{label(c)}: {pct(c.before[k]['hit_rate'])} -> {pct(c.chained[k]['hit_rate'])}" for c in cs)

    def label(c) -> str:  # a field culprit is named by its line, e.g. 'Current time:'
        if c.kind in ("volatile", "per-user", "per-session") and ": " in c.title:
            return f"{KIND_NAMES[c.kind]} '{c.title.rsplit(': ', 1)[-1].strip()}'"
        return KIND_NAMES[c.kind]

    al = d.culprit("alignment")
    if al is not None and al.chained is not None:
        u0, u1 = al.before["unbounded"], al.chained["unbounded"]
        align = (f"padding every shared prefix to a block boundary: {pct(u0['hit_rate'])} -> {pct(u1['hit_rate'])}, "
                 f"prefill {u0['computed_tokens']} -> {u1['computed_tokens']} tokens"
                 + (" (below the doctor's threshold: dropped)" if al.no_effect else ""))
    else:
        align = "no shared prefix ended inside a block"
    sizes = ", ".join(f"{bs}: {pct(replay_tokens(d.final.tokens, bs).hit_rate)}" for bs in d.block_sizes)
    so = d.system_only
    multi = (f"on the fixed log, sharing only the system prompt: {pct(so['hit_rate_system_only'])}; sharing the "
             f"(append-only) history too: {pct(so['hit_rate_history_shared'])}" if so else "no system prompts in the log")
    fixed_system = gain(("template", "whitespace", "order", "tools-order"))
    other = (f"the same fixed log tokenized for {other_tokenizer[0]}: {pct(other_tokenizer[2])} "
             f"({pct(other_tokenizer[1])} with {d.model}; block size {d.block_size}, unbounded): the numbers belong "
             "to one tokenizer and template, so the doctor runs again after every update") if other_tokenizer else \
        "no second tokenizer available here to compare"
    measured = [
        f"as logged {pct(base)}; every fix in order: {pct(final)}. Fixes that made the system part stable: {fixed_system}",
        f"{align}. The fixed log, unbounded cache, per block size: {sizes}",
        gain(("volatile", "per-user", "per-session")),
        multi,
        "not a property of the traffic: kvlab's BlockManager copies a shared partial block before a write "
        "(notebooks 04 and 07 show the bug without it)",
        f"the replay is the number vLLM's prefix_cache_hits / prefix_cache_queries would show for this traffic "
        f"({pct(base)}); its ceiling (token-granular, no eviction) is {pct(d.ceiling['hit_rate'])}",
        other,
    ]
    return pd.DataFrame([{"article 5.4 (zh)": zh, "the advice": en, "measured on this log": m}
                         for (zh, en), m in zip(ARTICLE_54, measured)])


def fix_labels(chain: Sequence[dict]) -> list[str]:
    """One label per step of the fix chain; a kind that occurs twice is told apart by its field or title."""
    kinds = [r["kind"] for r in chain]
    out = []
    for k, r in enumerate(chain):
        if k == 0:
            out.append("as logged")
        elif kinds.count(r["kind"]) == 1:
            out.append(f"+ {r['kind']}")
        else:
            what = r["step"].rsplit(": ", 1)[-1].strip() if ": " in r["step"] else r["step"]
            out.append(f"+ {r['kind']}: {what[:28]}")
    return out


def fig_fixes(d: Diagnosis):
    """Hit rate after each fix, applied one after the other; every bar labelled apart (None with no fix)."""
    import matplotlib.pyplot as plt

    if len(d.chain) < 2:
        return None
    key = "capacity_hit_rate" if "capacity_hit_rate" in d.chain[0] else "unbounded_hit_rate"
    fig, ax = plt.subplots(figsize=(7.2, 0.8 + 0.42 * len(d.chain)))
    vals = [100 * r[key] for r in d.chain]
    ax.barh(range(len(vals)), vals, color=["0.6"] + ["C0"] * (len(vals) - 1))
    for y, v in enumerate(vals):
        ax.text(v + 0.5, y, f"{v:.1f} %", va="center", fontsize=8)
    ax.set_yticks(range(len(vals)), fix_labels(d.chain))
    ax.invert_yaxis()
    ax.set_xlabel(f"hit rate (%), block size {d.block_size}")
    ax.set_xlim(0, 110)
    ax.set_title("fixes applied one after the other")
    fig.tight_layout()
    return fig


def retokenized_hit_rate(d: Diagnosis, model: str | None, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[str, float, float] | None:
    """(model, hit rate here, hit rate with ``model``'s tokenizer) of the fixed log, unbounded; None if not available."""
    try:
        enc = PromptEncoder(model)
    except Exception:
        return None
    final = [r for r in d.final.records]
    prep = prepare(final, enc)
    here = replay_tokens(d.final.tokens, block_size).hit_rate
    return enc.name, here, replay_tokens(prep.tokens, block_size).hit_rate


def whole_log_check(d: Diagnosis) -> dict:
    """The doctor's as-logged number at the first block size and capacity, and kvlab's BlockManager on the whole log."""
    bs, cap = d.block_size, d.capacity_blocks[d.block_size]
    salts = d.tenants
    ref = replay_block_manager(d.prep.tokens, bs, cap, salts, check=False)
    key = "capacity_hit_tokens" if cap is not None else "unbounded_hit_tokens"
    return {"doctor (fast replay)": d.row()[key], "kvlab.cache.BlockManager": ref.hit_tokens,
            "equal": d.row()[key] == ref.hit_tokens, "BlockManager seconds": ref.seconds}


# --- exercises -------------------------------------------------------------------------------------------
def _say(ok: bool, good: str, hint: str) -> bool:
    print(("correct: " + good) if ok else ("not yet: " + hint))
    return ok


def check_fix(my_fix: Callable[[list[dict]], list[dict]] | None, smoke: bool = True) -> bool:
    """Exercise 1: ``my_fix(messages)`` keeps every line of a support request but makes its system prompt shareable.

    Passes when the fixed log reaches 95 % of the hit rate of the doctor's own fix for the timestamp
    line (unbounded cache, block size 16) and every line of every message is still there.
    """
    hint = ("write my_fix(messages) that returns new messages where the line starting 'Current time:' has left "
            "the system message and sits in the last user message; keep every other line where it is")
    if my_fix is None:
        return _say(False, "", hint)
    log, _ = make_log(support_conversations=40, coding_conversations=0, users=12, doc_sentences=1, rules=4, seed=7)
    recs, _ = read_log(log)
    enc = PromptEncoder()
    fixed = []
    for r in recs:
        try:
            out = my_fix([dict(m) for m in r.messages])
        except Exception as e:  # the reader's code: report, do not raise
            return _say(False, "", f"my_fix raised {type(e).__name__}: {e}")
        if not isinstance(out, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in out):
            return _say(False, "", "my_fix must return a list of {'role': ..., 'content': ...} dicts")
        lines_in = sorted(x.strip() for m in r.messages for x in m["content"].split("\n") if x.strip())
        lines_out = sorted(x.strip() for m in out for x in m["content"].split("\n") if x.strip())
        if lines_in != lines_out:
            return _say(False, "", "some line was lost, changed or duplicated: move the line, do not edit it")
        fixed.append(r.replace(messages=out))
    got = replay_tokens(prepare(fixed, enc).tokens, 16).hit_rate
    from kvlab.doctor.culprits import FieldPattern, move_fields

    ref = replay_tokens(prepare(move_fields(recs, [FieldPattern("system", 0, "Current time: ", "prefix", "line", "")]),
                                enc).tokens, 16).hit_rate
    base = replay_tokens(prepare(recs, enc).tokens, 16).hit_rate
    if got >= 0.95 * ref:
        return _say(True, f"your fix takes this small log from {pct(base)} to {pct(got)} (the doctor's: {pct(ref)})", hint)
    return _say(False, "", f"your fixed log hits {pct(got)} of the prompt tokens, the log as logged {pct(base)}: the "
                           "system prompts still differ somewhere before the shared rules. " + hint)


def check_identical_rate(answer: float | None, requests: int = 50, tokens: int = 100, block_size: int = DEFAULT_BLOCK_SIZE) -> bool:
    """Exercise 2: the unbounded hit rate of ``requests`` identical prompts of ``tokens`` tokens."""
    hint = ("the first request finds nothing; every later one reuses whole blocks only, and never its last "
            "token (n-1 rule): count the cached tokens per repeat, then divide by all prompt tokens")
    if answer is None:
        return _say(False, "", hint)
    prompt = tokstr(list(range(tokens)))
    truth = replay_tokens([prompt] * requests, block_size).hit_rate
    return _say(abs(float(answer) - truth) < 1e-3, f"{pct(truth)}, as the replay measures", hint)


__all__ = ["ARTICLE_54", "KIND_NAMES", "before_after", "card", "check_fix", "check_identical_rate", "culprit_table",
           "dropped_table", "engine_ttft", "fig_divergence", "fig_fixes", "fig_hit_rates", "first_request", "fix_labels",
           "fit_prompts", "hit_table", "ids", "notebook_log", "pct", "points_table", "requests_table",
           "retokenized_hit_rate", "sentence", "template_54", "whole_log_check"]
