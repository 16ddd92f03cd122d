"""Fleet workloads as sessions of turns with Poisson arrivals (token ids, no torch).

A ``Session`` is one conversation: a system prompt, the user messages of its turns, and how many
tokens each reply has. Turn ``j``'s prompt is the system prompt, then every earlier turn's user
message and the reply the model *actually gave* (the driver fills these in as replies come back),
then user message ``j``. Sessions start as a Poisson process; the next turn arrives a think time
after the reply.

- ``chat``: multi-tenant multi-turn chat: ``num_tenants`` system prompts, each shared by many
  sessions of 3-8 turns that append their history.
- ``from_prompts``: independent one-turn requests (e.g. ``kvlab.lessons.workloads.sys512``'s
  prompts: 16 requests sharing a 512-token prefix) with Poisson arrivals.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["FleetWorkload", "Session", "chat", "from_prompts"]


@dataclass
class Session:
    """One conversation: system prompt, user messages, reply lengths, start time and think time
    (s)."""

    session_id: str
    tenant: str
    system: list[int]
    users: list[list[int]]
    reply_tokens: list[int]
    start: float
    think: float = 0.0
    # what a model-free replica "generates"
    scripted_replies: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int, replies: Sequence[Sequence[int]]) -> list[int]:
        """Turn ``turn``'s prompt given the replies of the turns before it."""
        ids = list(self.system)
        for i in range(turn):
            ids += self.users[i] + list(replies[i])
        return ids + self.users[turn]

    @property
    def num_turns(self) -> int:
        """Turns in this session."""
        return len(self.users)


@dataclass
class FleetWorkload:
    """Named sessions; ``num_requests`` counts their turns."""

    name: str
    sessions: list[Session]

    @property
    def num_requests(self) -> int:
        """All turns of all sessions."""
        return sum(s.num_turns for s in self.sessions)

    @property
    def num_tenants(self) -> int:
        """Distinct tenants (system prompts)."""
        return len({s.tenant for s in self.sessions})


def _ids(rng: random.Random, n: int, vocab: int, low: int = 3) -> list[int]:
    return [rng.randrange(low, vocab) for _ in range(n)]


def chat(
    num_sessions: int = 24,
    num_tenants: int = 4,
    *,
    system_tokens: int = 192,
    user_tokens: tuple[int, int] = (16, 48),
    reply_tokens: int = 8,
    turns: tuple[int, int] = (3, 8),
    rate: float = 4.0,
    think: float = 0.5,
    vocab: int = 1024,
    seed: int = 0,
) -> FleetWorkload:
    """Multi-tenant multi-turn chat: sessions start at ``rate`` per second (Poisson), tenants drawn
    uniformly."""
    rng = random.Random(f"kvlab-chat:{seed}")
    systems = [_ids(rng, system_tokens, vocab) for _ in range(num_tenants)]
    sessions, t = [], 0.0
    for s in range(num_sessions):
        t += rng.expovariate(rate)
        k = rng.randrange(num_tenants)
        n = rng.randint(*turns)
        users = [_ids(rng, rng.randint(*user_tokens), vocab) for _ in range(n)]
        replies = [_ids(rng, reply_tokens, vocab) for _ in range(n)]
        sessions.append(Session(f"s{s}", f"tenant{k}", systems[k], users, [reply_tokens] * n, t,
                                rng.expovariate(1 / think) if think > 0 else 0.0, replies))
    return FleetWorkload(f"chat{num_tenants}x{num_sessions}", sessions)


def from_prompts(
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    rate: float = 8.0,
    name: str = "prompts",
    vocab: int = 1024,
    seed: int = 0,
) -> FleetWorkload:
    """One-turn sessions, one per prompt, arriving at ``rate`` per second (Poisson)."""
    rng = random.Random(f"kvlab-prompts:{seed}")
    sessions, t = [], 0.0
    for i, p in enumerate(prompts):
        t += rng.expovariate(rate)
        sessions.append(
            Session(
                f"r{i}",
                "tenant0",
                [],
                [list(p)],
                [max_tokens],
                t,
                0.0,
                [_ids(rng, max_tokens, vocab)],
            )
        )
    return FleetWorkload(name, sessions)
