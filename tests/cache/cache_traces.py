"""Synthetic traces and a small replay loop for the cache tests, through ``CacheManager``'s members only.

The cache tests travel with ``kvlab/cache`` and so cannot import ``kvlab.lessons.traces`` (whose traces
and replay notebook 04 uses); these are the same shapes in random token ids: a few system prompts with
unique questions, and conversations that re-send their history.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

VOCAB = 32_000


@dataclass(slots=True)
class Request:
    """One prompt, the tokens its decode writes, and the turn it must wait for."""

    req_id: str
    prompt: list[int]
    output: list[int]
    after: str | None = None


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix_trace(num_requests: int, prefix_lens: Iterable[int] = (200, 400, 800),
                        suffix_len: tuple[int, int] = (16, 64), output_len: tuple[int, int] = (8, 32),
                        seed: int = 0) -> list[Request]:
    """Requests that each start with one of a few system prompts, then a unique question."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, n) for n in prefix_lens]
    return [Request(f"r{i}", rng.choice(prefixes) + _ids(rng, rng.randint(*suffix_len)),
                    _ids(rng, rng.randint(*output_len))) for i in range(num_requests)]


def multiturn_trace(num_conversations: int, turns: int = 4, system_len: int = 300,
                    user_len: tuple[int, int] = (16, 64), output_len: tuple[int, int] = (16, 64),
                    num_system_prompts: int = 2, seed: int = 0) -> list[Request]:
    """Conversations whose turn k re-sends the system prompt, the whole history and a new user message."""
    rng = random.Random(seed)
    systems = [_ids(rng, system_len) for _ in range(num_system_prompts)]
    out = []
    for c in range(num_conversations):
        history = systems[c % num_system_prompts]
        for t in range(turns):
            prompt = history + _ids(rng, rng.randint(*user_len))
            reply = _ids(rng, rng.randint(*output_len))
            out.append(Request(f"c{c}t{t}", prompt, reply, after=f"c{c}t{t - 1}" if t else None))
            history = prompt + reply
    return out


def replay(cache, requests: list[Request], max_running: int = 16) -> dict:
    """Admit while blocks allow (reserving a request's every block), decode one token a step, free; ``cache.stats()``.

    A turn waits until the turn it follows has finished.
    """
    bs = cache.block_size
    need = {r.req_id: -(-(len(r.prompt) + len(r.output)) // bs) for r in requests}
    assert max(need.values()) <= cache.num_blocks, "a request needs more blocks than the cache has"
    ids = {r.req_id for r in requests}
    waiting = deque(r for r in requests if r.after not in ids)
    blocked: dict[str, list[Request]] = {}
    for r in requests:
        if r.after in ids:
            blocked.setdefault(r.after, []).append(r)
    running: dict[str, int] = {}  # req_id -> tokens decoded so far
    by_id = {r.req_id: r for r in requests}
    reserved = 0  # blocks promised to running requests but not yet taken
    while waiting or running:
        while waiting and len(running) < max_running and cache.num_free_blocks - reserved >= need[waiting[0].req_id]:
            r = waiting.popleft()
            cache.allocate(r.req_id, r.prompt)
            reserved += need[r.req_id] - len(cache.block_table(r.req_id))
            running[r.req_id] = 0
        assert running, "no request can be admitted"
        for rid, done in list(running.items()):
            r = by_id[rid]
            if done < len(r.output):
                before = len(cache.block_table(rid))
                cache.append(rid, r.output[done])
                reserved -= len(cache.block_table(rid)) - before
                done += 1
            if done == len(r.output):
                reserved -= need[rid] - len(cache.block_table(rid))
                cache.free(rid)
                del running[rid]
                waiting.extend(blocked.pop(rid, ()))
            else:
                running[rid] = done
    return cache.stats()
