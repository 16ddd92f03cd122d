"""Structure: whitespace, chat markup, tools order, item order and conversation history, each with
its rewrite."""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from functools import partial
from itertools import groupby
from os.path import commonprefix

from ..divergence import lcp
from ..logio import Record
from ..prepare import SYSTEM_ROLES, Prepared, parse_chatml
from ..tokenization import PromptEncoder
from .base import Culprit, _shorten, _where, map_contents, record_segments, tool_name
from .textdiff import Finding, _tool_names, by_key, stable_key


def normalize_ws(text: str) -> str:
    """CRLF -> LF, no trailing spaces on lines, at most one blank line in a row, no outer
    whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def normalize_records(records: list[Record]) -> list[Record]:
    """Whitespace-normalise every message (``normalize_ws``)."""
    return map_contents(records, lambda role, index, content: normalize_ws(content))


def rerender_chatml(records: list[Record]) -> list[Record]:
    """Hand-rendered ChatML prompts -> chat records, so the one chat template renders every
    request."""
    out = []
    for rec in records:
        parsed = parse_chatml(rec.prompt) if rec.kind == "prompt" else []
        if (
            parsed
            and parsed[-1][0] == "user"
            and re.search(r"<\|im_start\|>\s*assistant\s*$", rec.prompt)
        ):
            msgs = [{"role": role, "content": rec.prompt[s:e]} for role, s, e in parsed]
            rec = Record(rec.line, "messages", messages=msgs, meta=dict(rec.meta))
        out.append(rec)
    return out


def hand_rendered(
    prep: Prepared, enc: PromptEncoder | None, limit: int = 2000
) -> list[tuple[int, str, str]]:
    """(token position, prompt, template) where a ChatML prompt differs from the template's
    rendering of it."""
    if enc is None:
        return []
    out = []
    for rec, ts in zip(prep.records, prep.tokens):
        conv = rerender_chatml([rec])[0] if rec.kind == "prompt" and len(out) < limit else rec
        # conv is rec: not ChatML
        if conv is rec or (text := enc.try_render(conv)) is None or text == rec.prompt:
            continue
        c = lcp(text, rec.prompt)
        tok = enc.encode([rec.prompt[:c]])[0]
        out.append((lcp(tok, ts), rec.prompt[max(0, c - 20):c + 20], text[max(0, c - 20):c + 20]))
    return out


def sort_tools(records: list[Record]) -> list[Record]:
    """Send tools in one order (by name)."""
    return [
        rec.replace(tools=sorted(rec.tools, key=tool_name))
        if rec.tools and [tool_name(t) for t in rec.tools] != sorted(map(tool_name, rec.tools))
        else rec
        for rec in records
    ]


def whitespace_culprit(prep: Prepared, findings: list[Finding]) -> Culprit | None:
    """Pairs that differ only in whitespace at their divergence point."""
    if not (ws := [f for f in findings if f.kind == "whitespace"]):
        return None
    ex = ws[0]
    affected = sum(
        1 for rec in prep.records if any(normalize_ws(c) != c for _, _, c in record_segments(rec))
    )
    return Culprit(
        "whitespace",
        "whitespace differences in text that is otherwise shared",
        int(statistics.median(f.token_pos for f in ws)),
        _where(ex.role, ex.index),
        [
            f"{len(ws)} diffed pairs differ only in whitespace at that point",
            f"request: {ex.text_a!r}",
            f"partner: {ex.text_b!r}",
        ],
        "normalise whitespace in every message (CRLF, trailing spaces, runs of blank lines, "
        "outer whitespace)",
        affected,
        fix=normalize_records,
        examples=[(ex.text_a, ex.text_b)],
    )


def template_culprit(
    prep: Prepared, findings: list[Finding], enc: PromptEncoder | None = None
) -> Culprit | None:
    """Chat markup that differs: pairs that differ outside any message, or hand-rendered ChatML
    prompts."""
    tp = [f for f in findings if f.kind == "template"]
    hand = hand_rendered(prep, enc)
    if not tp and not hand:
        return None
    ex = (hand[0][1], hand[0][2]) if hand else (tp[0].text_a, tp[0].text_b)
    chatml_prompts = sum(1 for r in prep.records if r.kind == "prompt" and parse_chatml(r.prompt))
    fix = rerender_chatml if chatml_prompts else None
    positions = [f.token_pos for f in tp] + [pos for pos, _, _ in hand]
    ev = [
        f"{len(hand)} hand-rendered ChatML prompts differ from what the chat template renders for "
        "the same messages"
    ] * bool(hand) + [f"{len(tp)} diffed pairs differ outside any message's content"] * bool(tp)
    ev += [
        f"the prompt: {ex[0]!r}",
        f"the template: {ex[1]!r}" if hand else f"the earlier prompt: {ex[1]!r}",
        f"record kinds in the log: {dict(Counter(r.kind for r in prep.records))}",
    ]
    return Culprit(
        "template",
        "the chat markup differs between requests (hand-rendered prompts or another template)",
        int(statistics.median(positions)),
        "chat-template markup",
        ev,
        "render every request through the model's one chat template"
        + (f" ({chatml_prompts} hand-rendered ChatML prompts become chat records)" if fix else ""),
        chatml_prompts,
        fix=fix,
        examples=[ex],
    )


def tools_culprit(prep: Prepared, findings: list[Finding]) -> Culprit | None:
    """The same set of tools sent in more than one order."""
    sent = [_tool_names(r) for r in prep.records if r.tools]
    orders: dict[frozenset, set] = defaultdict(set)
    for names in sent:
        orders[frozenset(names)].add(names)
    if not (varying := {k: v for k, v in orders.items() if len(v) > 1}):
        return None
    n_aff = sum(1 for names in sent if frozenset(names) in varying)
    k, v = max(varying.items(), key=lambda kv: len(kv[1]))
    tf = [f for f in findings if f.kind == "tools"]
    ex = sorted(v)[:2]  # sorted: the same example on every run (a set of tuples has no fixed order)
    return Culprit(
        "tools-order",
        "the same tools sent in varying order",
        int(statistics.median(f.token_pos for f in tf)) if tf else None,
        "the tools (rendered into the prompt)",
        [
            f"{n_aff} requests send one of {len(varying)} tool sets; the set of {len(k)} tools "
            f"came in {len(v)} "
            "different orders",
            "one order: " + ", ".join(ex[0]),
            "another:   " + ", ".join(ex[1]),
        ],
        "send the tools sorted by name",
        n_aff,
        fix=sort_tools,
        examples=[(", ".join(ex[0]), ", ".join(ex[1]))],
    )


def sort_items(
    records: list[Record], role: str, index: int | None, sep: str, prefix: str
) -> list[Record]:
    """Sort every run of consecutive items (paragraphs/lines) that start with ``prefix`` in one
    message."""

    def sort_runs(c: str) -> str:
        runs = groupby(c.split(sep), key=lambda item: item.startswith(prefix))
        return sep.join(x for is_item, run in runs for x in (sorted(run) if is_item else run))

    return map_contents(
        records,
        lambda r, i, c: sort_runs(c) if r == role and index in (None, i) and prefix in c else c,
    )


def order_culprits(prep: Prepared, findings: list[Finding], min_count: int = 2) -> list[Culprit]:
    """Same items (documents, examples) in another order: sort runs of items that share a header."""
    out = []
    for (role, index, sep), fs in by_key(
        findings, "order", lambda f: (f.role, f.index, f.sep)
    ).items():
        if len(fs) < min_count:
            continue
        items = [it for f in fs for it in f.items_a + f.items_b]
        prefix = stable_key(commonprefix(items), items[0])
        ex = fs[0]
        unit = "paragraphs" if sep == "\n\n" else "lines"
        affected = sum(
            1
            for rec in prep.records
            for r, idx, c in record_segments(rec)
            if r == role and (index is None or idx == index) and prefix and c.count(prefix) >= 2
        )
        out.append(
            Culprit(
                "order",
                f"the same {unit} in varying order in {_where(role, index)}"
                + (f" (items starting {prefix!r})" if prefix else ""),
                int(statistics.median(f.token_pos for f in fs)),
                _where(role, index),
                [
                    f"{len(fs)} of the diffed pairs hold the same {len(ex.items_a)} {unit} "
                    "in another order",
                    "request: " + " | ".join(_shorten(x, 40) for x in ex.items_a),
                    "partner: " + " | ".join(_shorten(x, 40) for x in ex.items_b),
                ],
                f"sort the {unit} that start with {prefix!r} (one canonical order, e.g. by id)"
                if prefix
                else f"send the {unit} in one canonical order (they share no header the "
                     "doctor could sort by)",
                affected,
                fix=partial(sort_items, role=role, index=index, sep=sep, prefix=prefix)
                if prefix
                else None,
                examples=[("\n".join(ex.items_a), "\n".join(ex.items_b))],
                details={"prefix": prefix, "sep": sep},
            )
        )
    return out


def conversation_key(rec: Record) -> object | None:
    """Which conversation a chat record belongs to: its ``session``, else its user and first user
    message."""
    if rec.kind != "messages":
        return None
    if rec.get("session") is not None:
        return ("session", str(rec.get("session")))
    first = next((m["content"] for m in rec.messages if m["role"] == "user"), None)
    return None if first is None else ("user+first", str(rec.get("user")), first)


def _split(rec: Record) -> tuple[list[str], list[tuple[str, str]]]:
    """A chat record's system contents, and its history: (role, content) of its other messages."""
    return ([m["content"] for m in rec.messages if m["role"] in SYSTEM_ROLES],
            [(m["role"], m["content"]) for m in rec.messages if m["role"] not in SYSTEM_ROLES])


def _new_from(h: list[tuple[str, str]], prev: list[tuple[str, str]]) -> int:
    """Where a turn's new messages start: after the previous turn's history, its last message, or
    the last exchange."""
    if h[:len(prev)] == prev:  # already append-only
        return len(prev)
    if prev and prev[-1] in h:
        return len(h) - h[::-1].index(prev[-1])
    return len(h) - (2 if len(h) >= 2 and h[-2][0] == "assistant" else 1)


def append_histories(records: list[Record]) -> list[Record]:
    """Rebuild every conversation so each turn re-sends the full history of the previous one, then
    the new messages."""
    full: dict[object, list[dict]] = {}
    last: dict[object, list[tuple[str, str]]] = {}
    out = []
    for rec in records:
        if (key := conversation_key(rec)) is None:
            out.append(rec)
            continue
        hist = [m for m in rec.messages if m["role"] not in SYSTEM_ROLES]
        h = _split(rec)[1]
        full[key] = full.get(key, []) + [dict(m) for m in hist[_new_from(h, last.get(key, [])):]]
        last[key] = h
        system = [dict(m) for m in rec.messages if m["role"] in SYSTEM_ROLES]
        out.append(rec.replace(messages=system + [dict(m) for m in full[key]]))
    return out


def multiturn_culprit(prep: Prepared) -> Culprit | None:
    """Conversations whose turns rebuild the history instead of appending to it."""
    convs: dict[object, list[int]] = defaultdict(list)
    for i, rec in enumerate(prep.records):
        if (key := conversation_key(rec)) is not None:
            convs[key].append(i)
    turns = [(key, prev, cur) for key, idx in convs.items() for prev, cur in zip(idx, idx[1:])]
    kinds: Counter = Counter()
    example, template_breaks = None, 0
    for key, prev, cur in turns:
        (sp, hp), (sc, hc) = _split(prep.records[prev]), _split(prep.records[cur])
        # appended: the template may still re-render the history differently
        if hc[: len(hp)] == hp:
            if sp == sc:
                template_breaks += (
                    lcp(prep.tokens[prev], prep.tokens[cur]) < len(prep.tokens[prev]) - 8
                )
            continue
        j = next(
            (j for j in range(1, len(hp)) if hc[: len(hp) - j] == hp[j:] and len(hp) - j > 0), None
        )
        kind = f"window: dropped the oldest {j} message(s)" if j else "edited or replaced history"
        kinds[kind] += 1
        example = example or (key, prev, cur, len(hp), len(hc), kind)
    follow, rebuilt = len(turns), sum(kinds.values())
    if not rebuilt and not template_breaks:
        return None
    ev = [
        f"{follow} follow-up turns in {sum(len(v) > 1 for v in convs.values())} conversations; "
        f"{rebuilt} ({rebuilt / max(follow, 1):.0%}) do not re-send the previous turn's "
        "history unchanged"
    ]
    ev += [f"  {n}x {k}" for k, n in kinds.most_common(4)]
    if example:
        key, prev, cur, lp, lc, kind = example
        ev.append(
            f"e.g. {key[0]} {key[1]!r}: line {prep.records[prev].line} sends {lp} history "
            f"messages, the next turn (line {prep.records[cur].line}) sends {lc} ({kind})"
        )
    if template_breaks:
        ev.append(
            f"{template_breaks} turns append their messages but the chat template re-renders the "
            "history differently (the token prefix breaks anyway)"
        )
    position = (
        int(statistics.median(prep.sys_tokens[i] for idx in convs.values() for i in idx))
        if convs
        else None
    )
    return Culprit(
        "multi-turn",
        "multi-turn conversations rebuild their history instead of appending to it",
        position,
        "the conversation history",
        ev,
        "send each turn as the previous turn's messages + the reply + the new "
        "message (append-only)",
        rebuilt,
        fix=append_histories if rebuilt else None,
        details={"follow_ups": follow, "rebuilt": rebuilt},
    )
