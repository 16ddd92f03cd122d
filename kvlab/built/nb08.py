"""What notebook 08_why_is_my_hit_rate_low.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from kvlab.cache import DEFAULT_BLOCK_SIZE, cdiv
from kvlab.doctor import Diagnosis
from kvlab.doctor.culprits import Culprit, record_segments
from kvlab.doctor.replay import replay_block_manager, replay_tokens
from kvlab.doctor.report import pct
from kvlab.doctor.tokenization import tokstr
from kvlab.lessons.timing import Timing, time_interleaved


# --- 08_why_is_my_hit_rate_low.ipynb, cell 5 ---
def requests_table(log: Sequence[dict], n: int = 6) -> pd.DataFrame:
    """A few requests: app, tenant, user, session, time, messages, start of the system prompt."""
    rows = []
    for r in log[:n]:
        first = r["messages"][0]["content"] if "messages" in r else r["prompt"]
        rows.append({"app": r.get("app"), "tenant": r.get("tenant"), "user": r.get("user"),
                     "session": r.get("session"), "timestamp": r.get("timestamp"),
                     "messages": len(r.get("messages", [])), "tools": len(r.get("tools", []) or []),
                     "system prompt starts": first[:70].replace("\n", " ⏎ ")})
    return pd.DataFrame(rows)


# --- 08_why_is_my_hit_rate_low.ipynb, cell 9 ---
def hit_table(d: Diagnosis) -> pd.DataFrame:
    """Hit rate per block size: unbounded, at the capacity, without salts; the ceiling."""
    rows = []
    for r in d.table:
        rows.append({"block size": r["block_size"], "unbounded cache": r["unbounded_hit_rate"],
                     "capacity (blocks)": r["capacity_blocks"],
                     "at capacity": r.get("capacity_hit_rate"),
                     "without tenant salts": r.get("unsalted_hit_rate"),
                     "requests sharing < 1 block": r["short_requests"]})
    out = pd.DataFrame(rows).set_index("block size")
    out.attrs["ceiling"] = d.ceiling["hit_rate"]
    return out


# --- 08_why_is_my_hit_rate_low.ipynb, cell 13 ---
def whole_log_check(d: Diagnosis) -> dict:
    """The doctor's as-logged number at the first block size and capacity, and kvlab's BlockManager
    on the whole log."""
    bs, cap = d.block_size, d.capacity_blocks[d.block_size]
    salts = d.tenants
    ref = replay_block_manager(d.prep.tokens, bs, cap, salts, check=False)
    key = "capacity_hit_tokens" if cap is not None else "unbounded_hit_tokens"
    return {"doctor (fast replay)": d.row()[key], "kvlab.cache.BlockManager": ref.hit_tokens,
            "equal": d.row()[key] == ref.hit_tokens, "BlockManager seconds": ref.seconds}


# --- 08_why_is_my_hit_rate_low.ipynb, cell 16 ---
def points_table(points: Sequence[dict]) -> pd.DataFrame:
    """The most common divergence points with the text around them."""
    return pd.DataFrame([{"token": p["position"], "requests": p["requests"],
                          "…text before": "…" + p["before"][-40:],
                          "this request goes on": p["after_request"][:30],
                          "the earlier prompt went on": p["after_partner"][:30]}
                         for p in points]).replace({"\n": "⏎"}, regex=True)


# --- 08_why_is_my_hit_rate_low.ipynb, cell 19 ---
KIND_NAMES = {"volatile": "a per-request field (timestamp, id)",
              "per-user": "a per-user field (name, account)",
              "per-session": "a per-conversation field",
              "order": "items in varying order (RAG documents)",
              "tools-order": "tools in varying order", "whitespace": "whitespace differences",
              "template": "another chat markup", "multi-turn": "history rebuilt, not appended",
              "alignment": "shared prefix not aligned to blocks",
              "tenant-salt": "tenant salts split a shared prefix"}


def culprit_table(d: Diagnosis) -> pd.DataFrame:
    """The culprits whose fix changed the replay, in fix order, with numbers before and after."""
    k = d.cap_key
    rows = []
    for n, c in enumerate(d.kept, 1):
        rows.append({"#": n, "culprit": KIND_NAMES.get(c.kind, c.kind), "where": c.where,
                     "token": c.position, "requests": c.affected,
                     "hit rate before": c.before[k]["hit_rate"],
                     "after this fix": c.chained[k]["hit_rate"],
                     "prefill tokens before": c.before[k]["computed_tokens"],
                     "after": c.chained[k]["computed_tokens"],
                     "this fix alone": c.alone[k]["hit_rate"] if c.alone else None})
    return pd.DataFrame(rows).set_index("#")


# --- 08_why_is_my_hit_rate_low.ipynb, cell 21 ---
def sentence(c: Culprit, cap_key: str) -> str:
    """'Fixing X took the hit rate from a to b (+p points) and the prefill from m to n tokens.'"""
    b, a = c.before[cap_key], c.chained[cap_key]
    change = a["hit_rate"] - b["hit_rate"]
    verb = "raised" if change > 0 else "lowered" if change < 0 else "left"
    saved = b["computed_tokens"] - a["computed_tokens"]
    cache = "the finite cache" if cap_key == "capacity" else "an unbounded cache"
    return (f"Fixing {KIND_NAMES.get(c.kind, c.kind)} {verb} the hit rate ({cache}) from "
            f"{pct(b['hit_rate'])} to {pct(a['hit_rate'])} ({100 * change:+.1f} points): "
            f"{abs(saved)} prompt tokens {'fewer' if saved >= 0 else 'more'} to prefill "
            f"({b['computed_tokens']} -> {a['computed_tokens']}).")


def card(c: Culprit, cap_key: str) -> str:
    """A culprit as text: title, where, evidence, fix, and the measured sentence."""
    at = f", from token ~{c.position}" if c.position is not None else ""
    lines = [f"{c.title}", f"  where: {c.where}{at}"]
    lines += [f"  - {e}" for e in c.evidence]
    lines.append(f"  fix: {c.fix_text}")
    if c.chained is not None and c.before is not None and cap_key in c.chained:
        lines.append("  " + sentence(c, cap_key))
    return "\n".join(lines)


# --- 08_why_is_my_hit_rate_low.ipynb, cell 23 ---
def dropped_table(d: Diagnosis) -> pd.DataFrame:
    """Candidates the doctor measured and dropped: their fix did not change the replay enough."""
    return pd.DataFrame([{"candidate": c.title[:90],
                          "hit rate before (unbounded)": c.before["unbounded"]["hit_rate"],
                          "with its fix": c.chained["unbounded"]["hit_rate"] if c.chained else None}
                         for c in d.culprits if c.no_effect])


# --- 08_why_is_my_hit_rate_low.ipynb, cell 26 ---
def first_request(d: Diagnosis, app: str) -> int:
    """Index of the first request of an app with more than one message (a follow-up turn if any)."""
    recs = list(enumerate(d.prep.records))
    return next((i for i, r in recs if r.get("app") == app and r.kind == "messages"
                 and len(r.messages) > 2), next(i for i, r in recs if r.get("app") == app))


def before_after(c: Culprit, d: Diagnosis, i: int, chars: int = 260) -> tuple[str, str]:
    """The start of request ``i``'s system message and last user message, before and after a fix."""
    rec = d.prep.records[i]
    fixed = c.fix([rec])[0]

    def show(r) -> str:
        segs = record_segments(r)
        system = next((x for role, _, x in segs if role == "system"), "")
        user = next((x for role, _, x in reversed(segs) if role == "user"), "")
        return f"[system] {system[:chars]}…\n[last user message] {user[:chars]}"
    return show(rec), show(fixed)


# --- 08_why_is_my_hit_rate_low.ipynb, cell 43 ---
def engine_ttft(model: Any, tok: Any, prompts: dict[str, list[list[int]]],
                block_size: int = DEFAULT_BLOCK_SIZE,
                repeats: int = 3) -> tuple[pd.DataFrame, dict[str, Timing]]:
    """Each variant's prompts, one at a time, through a fresh paged engine with prefix caching."""
    from kvlab.engine import Engine, SamplingParams

    num_blocks = max(sum(cdiv(len(p) + 1, block_size) for p in ps) for ps in prompts.values()) + 4
    sp = SamplingParams(max_tokens=1)

    def fresh() -> Engine:
        return Engine(model, tok, num_blocks=num_blocks, block_size=block_size,
                      enable_prefix_caching=True)

    def run(ps: list[list[int]]):
        return lambda engine: (engine, [engine.generate([p], sp)[0] for p in ps])

    fresh().generate([next(iter(prompts.values()))[0]], sp)  # warm-up, not timed
    jobs = {name: (fresh, run(ps)) for name, ps in prompts.items()}
    timings = time_interleaved(jobs, repeats=repeats, warmup=0)
    rows = []
    for name, ps in prompts.items():
        engine, outs = timings[name].result
        t = timings[name]
        rows.append({"variant": name, "requests": len(ps), "prompt tokens": sum(map(len, ps)),
                     "engine cached tokens": sum(o.num_cached_tokens for o in outs),
                     "engine hit rate": engine.stats()["hit_rate"],
                     "doctor's replay": replay_tokens([tokstr(p) for p in ps], block_size).hit_rate,
                     "all requests (s)": t.median, "min (s)": t.lo, "max (s)": t.hi})
    return pd.DataFrame(rows).set_index("variant"), timings


def fit_prompts(tokens, max_len: int, n: int) -> list[int]:
    """Indices of the first ``n`` prompts no longer than ``max_len`` tokens."""
    return [i for i, t in enumerate(tokens) if len(t) <= max_len][:n]
