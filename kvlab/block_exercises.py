"""Checkers for notebook 04's exercises: each runs the reader's function against the real manager.

A checker prints what it found and returns True or False; it never raises on a wrong answer, and an
exercise left as ``raise NotImplementedError`` is reported as not attempted.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvlab.block_manager import BlockManager
from kvlab.workloads import replay, timestamp_trace


def _attempt(fn: Callable, *args):
    try:
        return True, fn(*args)
    except NotImplementedError:
        return False, None


def check_cached_tokens(predict: Callable[[int, int], int]) -> bool:
    """Exercise 1: ``predict(n, block_size)`` = cached tokens when an identical n-token prompt repeats."""
    for bs in (1, 2, 4, 16, 64):
        for n in range(1, 3 * bs + 3):
            m = BlockManager(8 + 2 * (n // bs + 1), bs)
            m.allocate("first", list(range(n)))
            truth = m.allocate("again", list(range(n)))
            ok, guess = _attempt(predict, n, bs)
            if not ok:
                print("exercise 1: not attempted yet")
                return False
            if guess != truth:
                print(f"exercise 1: for n={n}, block_size={bs} you predicted {guess}; the manager cached {truth}")
                return False
    print("exercise 1: correct for every n and block size tried")
    return True


def _leaky_manager(rng: random.Random) -> tuple[BlockManager, set[int]]:
    m = BlockManager(32, 4)
    system = [rng.randrange(1000) for _ in range(rng.randint(4, 20))]
    for i in range(rng.randint(3, 6)):
        m.allocate(i, system + [rng.randrange(1000) for _ in range(rng.randint(1, 9))])
    for i in list(m.seqs)[::2]:
        m.free(i)
    in_use = sorted({b for s in m.seqs.values() for b in s.block_table})
    leaked = set(rng.sample(in_use, rng.randint(1, min(3, len(in_use)))))
    for b in leaked:  # a reference that no block table holds
        m.pool.share(m.pool.blocks[b], "nobody")
    return m, leaked


def check_find_leaks(find_leaks: Callable[[BlockManager], set[int]]) -> bool:
    """Exercise 2: ``find_leaks(manager)`` returns the ids of blocks with more refs than table entries."""
    rng = random.Random(4)
    for trial in range(20):
        m, leaked = _leaky_manager(rng)
        ok, found = _attempt(find_leaks, m)
        if not ok:
            print("exercise 2: not attempted yet")
            return False
        if set(found or ()) != leaked:
            print(f"exercise 2: trial {trial}: you found {sorted(found or ())}, the leaked blocks are {sorted(leaked)}")
            return False
    print("exercise 2: correct on 20 managers with planted leaks")
    return True


def check_timestamp_prompt(build: Callable[[list[int], list[int], list[int]], list[int]]) -> bool:
    """Exercise 3: ``build(system, timestamp, question)`` keeps every part and hits >= 95 % of the ideal."""
    base = timestamp_trace(24, where="none", seed=1)
    stamped = timestamp_trace(24, where="start", seed=1)
    ideal = replay(BlockManager(4096, 16), base)["hit_tokens"]
    system = base[0].prompt[:256]
    built = []
    for b, s in zip(base, stamped, strict=True):
        stamp, question = s.prompt[:8], b.prompt[256:]
        ok, prompt = _attempt(build, list(system), list(stamp), list(question))
        if not ok:
            print("exercise 3: not attempted yet")
            return False
        if sorted(prompt) != sorted(system + stamp + question):
            print("exercise 3: the prompt must contain the system prompt, the timestamp and the question, once each")
            return False
        built.append(type(b)(b.req_id, prompt, b.output))
    got = replay(BlockManager(4096, 16), built)["hit_tokens"]
    if got < 0.95 * ideal:
        print(f"exercise 3: {got} cached tokens, need at least 95% of the {ideal} a timestamp-free prompt gets")
        return False
    print(f"exercise 3: {got} cached tokens vs {ideal} without any timestamp: correct")
    return True
