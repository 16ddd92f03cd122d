"""Synthetic request traces for the block manager, and a small scheduler loop that replays them."""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.interface import CacheManager
from kvlab.engine.trace_replay import TraceRequest, replay_trace

VOCAB = 32_000
SYSTEM_PROMPTS = {
    "zh": "你是一个专业的翻译助手，请将以下内容翻译成英文：",
    "en": "You are a professional translation assistant. Translate the following text into "
          "English:",
}


def toy_tokenize(text: str) -> list[int]:
    """A stable stand-in tokenizer: one id per CJK character, word, or punctuation mark."""
    pieces = re.findall(r"[\u4e00-\u9fff]|\w+|[^\w\s]", text)
    return [zlib.crc32(p.encode()) % VOCAB for p in pieces]


@dataclass(slots=True)
class Request(TraceRequest):
    """One prompt, its decode's tokens, a tenant salt, the turn it waits for (``after``) and
    free-form ``tags``."""

    tags: dict = field(default_factory=dict)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix_trace(
    num_requests: int,
    prefix_lens: Iterable[int] = (200, 400, 800),
    suffix_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (8, 32),
    seed: int = 0,
) -> list[Request]:
    """Requests that each start with one of a few system prompts, then a unique question."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, n) for n in prefix_lens]
    out = []
    for i in range(num_requests):
        k = rng.randrange(len(prefixes))
        prompt = prefixes[k] + _ids(rng, rng.randint(*suffix_len))
        out.append(Request(f"r{i}", prompt, _ids(rng, rng.randint(*output_len)),
                           tags={"system": k}))
    return out


def multiturn_trace(
    num_conversations: int,
    turns: int = 4,
    system_len: int = 300,
    user_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (16, 64),
    num_system_prompts: int = 2,
    history: str = "full",
    window: int = 1,
    seed: int = 0,
) -> list[Request]:
    """Conversations whose turn k re-sends the system prompt, the history and a new user message."""
    if history not in ("full", "window", "none"):
        raise ValueError(f"history must be full, window or none, got {history!r}")
    rng = random.Random(seed)
    systems = [_ids(rng, system_len) for _ in range(num_system_prompts)]
    out = []
    for c in range(num_conversations):
        exchanges: list[list[int]] = []
        system = systems[c % num_system_prompts]
        for t in range(turns):
            user = _ids(rng, rng.randint(*user_len))
            kept = {"full": exchanges, "window": exchanges[-window:] if window else [],
                    "none": []}[history]
            prompt = system + [tok for ex in kept for tok in ex] + user
            reply = _ids(rng, rng.randint(*output_len))
            out.append(Request(f"c{c}t{t}", prompt, reply, after=f"c{c}t{t - 1}" if t else None,
                               tags={"conversation": c, "turn": t}))
            exchanges.append(user + reply)
    return out


def timestamp_trace(
    num_requests: int,
    system_len: int = 256,
    where: str = "end",
    timestamp_len: int = 8,
    suffix_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (8, 16),
    seed: int = 0,
) -> list[Request]:
    """One system prompt that carries a per-request timestamp at its ``start``, ``end`` or
    ``none``."""
    if where not in ("start", "end", "none"):
        raise ValueError(f"where must be start, end or none, got {where!r}")
    rng = random.Random(seed)
    system = _ids(rng, system_len)
    out = []
    for i in range(num_requests):
        # one a minute
        stamp = toy_tokenize(f"Time: {i // 60 % 24:02d}:{i % 60:02d}, 2024-05-{1 + i // 1440:02d}")
        stamp = (stamp + [0] * timestamp_len)[:timestamp_len]
        prompt = {"start": stamp + system, "end": system + stamp, "none": system}[where]
        prompt = prompt + _ids(rng, rng.randint(*suffix_len))
        out.append(Request(f"r{i}", prompt, _ids(rng, rng.randint(*output_len))))
    return out


def realistic_trace(
    num_conversations: int = 400,
    num_system_prompts: int = 4,
    turns: tuple[int, int] = (1, 4),
    seed: int = 0,
) -> list[Request]:
    """A few shared system prompts (100-1000 tokens), conversations of 1-4 growing turns."""
    rng = random.Random(seed)
    systems = [_ids(rng, rng.randint(100, 1000)) for _ in range(num_system_prompts)]
    # a few prompts are much more popular
    weights = [1 / (k + 1) for k in range(num_system_prompts)]
    out = []
    for c in range(num_conversations):
        system = rng.choices(systems, weights)[0]
        history: list[int] = []
        for t in range(rng.randint(*turns)):
            user = _ids(rng, rng.randint(8, 120))
            reply = _ids(rng, rng.randint(8, 64))
            out.append(Request(f"c{c}t{t}", system + history + user, reply,
                               after=f"c{c}t{t - 1}" if t else None,
                               tags={"conversation": c, "turn": t}))
            history += user + reply
    return out


def replay(manager: CacheManager, requests: list[Request], max_running: int = 16) -> dict:
    """Replay a trace on the real scheduler (``kvlab.engine.trace_replay``); the cache's stats plus
    the run's."""
    t0 = time.perf_counter()
    run = replay_trace(manager, requests, max_num_seqs=max_running)
    seconds = time.perf_counter() - t0
    m = manager.metrics
    return {
        **manager.stats(),
        "block_size": manager.block_size,
        "num_blocks": manager.num_blocks,
        "steps": run.steps,
        "wasted_slots_mean": run.wasted_slots_mean,
        "peak_blocks_used": run.peak_blocks_used,
        "block_ops": m.hashed_blocks + m.blocks_taken + m.blocks_hit,
        "seconds": seconds,
        "cached_tokens": run.cached_tokens,
    }


def block_size_sweep(
    requests: list[Request], block_sizes: Iterable[int], capacity_tokens: int,
    max_running: int = 16, **kw
) -> list[dict]:
    """Replay one trace at several block sizes with the same KV capacity in tokens."""
    rows = []
    for bs in block_sizes:
        row = replay(BlockManager(capacity_tokens // bs, bs, **kw), requests, max_running)
        row.pop("cached_tokens")
        rows.append(row)
    return rows


# The article's translation requests (section 3.5), with English versions beside them.
ARTICLE_QUESTIONS = {"zh": ["今天天气很好。", "今天天气很好。", "明天会下雨吗？"],
                     "en": ["The weather is nice today.", "The weather is nice today.",
                            "Will it rain tomorrow?"]}


def three_requests(block_size: int = 4, num_blocks: int = 24, lang: str = "zh", decode: int = 3,
                   **kw):
    """Step the article's three translation requests through a fresh manager."""
    m = BlockManager(num_blocks, block_size, **kw)
    system = toy_tokenize(SYSTEM_PROMPTS[lang])
    answers = [toy_tokenize(a) for a in ARTICLE_QUESTIONS["en" if lang == "zh" else "zh"]]
    names = ["A", "B", "C"]
    for name, question in zip(names, ARTICLE_QUESTIONS[lang], strict=True):
        prompt = system + toy_tokenize(question)
        cached = m.allocate(name, prompt)
        yield f"{name} arrives: {len(prompt)} prompt tokens, {cached} from the cache", m
    for step in range(decode):
        for name, answer in zip(names, answers, strict=True):
            m.append(name, answer[step % len(answer)])
    yield f"after {decode} decode steps each", m
    m.free("A")
    yield "A finishes: its blocks are released tail first", m
