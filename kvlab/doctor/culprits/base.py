"""What a culprit is (a reason prompts stop sharing, and its fix); how a record's messages are read
and rewritten."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..logio import Record
from ..prepare import Prepared, parse_chatml

Fix = Callable[[list[Record]], list[Record]]


@dataclass
class Culprit:
    """A reason prompts stop sharing: what, where, the evidence, and the fix (measured later)."""

    # volatile, per-user, per-session, order, tools-order, whitespace, template, multi-turn,
    # alignment, ...
    kind: str
    title: str
    position: int | None  # typical token position where it breaks the shared prefix
    where: str
    evidence: list[str]
    fix_text: str
    affected: int  # requests it touches
    fix: Fix | None = None  # rewrites the records
    token_fix: Callable[[Prepared], Prepared] | None = None  # rewrites the tokens (alignment)
    policy: str | None = None  # "public-prefix" for the tenant culprit
    examples: list[tuple[str, str]] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    alone: dict | None = None  # measured: this fix on the original log
    chained: dict | None = None  # measured: this fix after the ones before it
    before: dict | None = None  # measured: the log just before this fix (in the chain)
    # measured, and it changed nothing worth reporting: not a culprit of this log
    no_effect: bool = False
    fixed_log: str | None = None

    @property
    def measurable(self) -> bool:
        """Whether the doctor can re-measure the log with this fix."""
        return self.fix is not None or self.token_fix is not None or self.policy is not None


def _where(role: str | None, index: int | None) -> str:
    if role is None:
        return "chat-template markup"
    if role == "prompt":
        return "the prompt"
    return f"the {role} message" + (f" (messages[{index}])" if index is not None else "")


def _shorten(s: str, n: int = 90) -> str:
    s = s.replace("\n", "⏎")
    return s if len(s) <= n else s[: n - 1] + "…"


def tool_name(tool: dict, default: str = "") -> str:
    """A tool's function name (OpenAI format), or ``default``."""
    return str((tool.get("function") or {}).get("name", tool.get("name", default)))


def record_segments(rec: Record) -> list[tuple[str, int, str]]:
    """(role, index, content) of each message (parsed back from a ChatML prompt; a plain prompt is
    one)."""
    if rec.kind == "messages":
        return [(m["role"], i, m["content"]) for i, m in enumerate(rec.messages)]
    if rec.kind == "prompt":
        return [
            (role, i, rec.prompt[s:e]) for i, (role, s, e) in enumerate(parse_chatml(rec.prompt))
        ] or [("prompt", 0, rec.prompt)]
    return []


def map_contents(records: list[Record], fn: Callable[[str, int, str], str]) -> list[Record]:
    """Each record with ``fn(role, index, content)`` applied to its messages (a record it leaves
    alone is kept)."""
    out = []
    for rec in records:
        old = [c for _, _, c in record_segments(rec)]
        new = [fn(role, i, c) for role, i, c in record_segments(rec)]
        out.append(with_contents(rec, new) if new != old else rec)
    return out


def _tail_insert(prompt: str, text: str) -> str:
    """Put ``text`` at the end of a plain prompt, before a trailing chat-markup tail if there is
    one."""
    # the last mark
    m = next(reversed(list(re.finditer(r"<\|[a-z_]+\|>|\[/?INST\]", prompt))), None)
    if m is not None and len(prompt) - m.start() <= 64:
        return prompt[: m.start()] + text + "\n" + prompt[m.start():]
    return prompt.rstrip("\n") + "\n\n" + text + ("\n" if prompt.endswith("\n") else "")


def with_contents(rec: Record, contents: list[str], prepend_user: str = "") -> Record:
    """A copy of ``rec`` whose segments hold ``contents``; ``prepend_user`` goes before the last
    user message."""
    contents = list(contents)
    users = [j for j, (role, _, _) in enumerate(record_segments(rec)) if role == "user"]
    if prepend_user and users:
        contents[users[-1]] = prepend_user + "\n\n" + contents[users[-1]]
        prepend_user = ""
    if rec.kind == "messages":
        msgs = [dict(m, content=c) for m, c in zip(rec.messages, contents)]
        # no user message: the context becomes its own user message before generation
        if prepend_user:
            msgs.append({"role": "user", "content": prepend_user})
        return rec.replace(messages=msgs)
    if rec.kind == "prompt":
        parsed = parse_chatml(rec.prompt)
        text = rec.prompt if parsed else contents[0]
        for (_, s, e), c in reversed(list(zip(parsed, contents))):
            text = text[:s] + c + text[e:]
        return rec.replace(prompt=_tail_insert(text, prepend_user) if prepend_user else text)
    return rec
