"""Named token-id workloads shared by notebooks 05-07, the tests and the benchmarks (no torch)."""

from __future__ import annotations

import random
from typing import Any

from kvlab.bench.workload import Workload, ideal_prefill_fraction, sys512
from kvlab.cache import DEFAULT_BLOCK_SIZE
from kvlab.lessons import passphrase as P

__all__ = ["GROUP_CONDITIONS", "Workload", "ideal_prefill_fraction", "seed_groups", "sys512"]

# The article's wording of each group's condition (its table 3.6, first two columns).
GROUP_CONDITIONS = {
    1: ("identical prefix", "完全相同"),
    2: ("overlapping text, different start", "部分重叠"),
    3: ("identical prefix, different following context", "相同但上下文不同"),
}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _questions(lang: str) -> tuple[str, ...]:
    return P.ASK_ZH if lang == "zh" else P.ASK_EN


def _aligned_preamble(tokenizer: Any, seed: int, block_size: int, split: str) -> list[int]:
    """Ids of an extra system turn of filler lines whose length is a multiple of ``block_size``."""
    rng = random.Random(f"kvlab-group2:{split}:{seed}")
    pool = P.FILLER_ZH + P.FILLER_EN
    for _ in range(500):
        lines = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
        ids = _encode(tokenizer, P.chatml("system", "\n".join(lines)))
        if len(ids) % block_size == 0:
            return ids
    raise RuntimeError(f"no block-aligned preamble found for seed {seed}; try another block size")


def seed_groups(tokenizer: Any, n: int = 8, split: str = "heldout", start: int = 0,
                questions: int = 3,
                block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int = 12) -> dict[int, Workload]:
    """The article's three groups as passphrase workloads: ``{1: Workload, 2: ..., 3: ...}``."""
    groups: dict[int, Workload] = {}
    # group 1: one system prompt, several questions; the first questions of every prompt come first
    prompts, meta = [], []
    for q in range(questions):
        for seed in range(start, start + n):
            ex = P.make_example(seed, split, history="none")
            asked = P.with_question(ex, _questions(ex.lang)[(seed + q) % 4])
            prompts.append(_encode(tokenizer, asked.prompt_text))
            meta.append({"group": 1, "seed": seed, "role": "served", "expected": ex.answer,
                         "lang": ex.lang,
                         "question": q, "prefix_tokens": len(_encode(tokenizer, ex.prefix_text))})
    groups[1] = Workload("seed-groups/1", prompts, max_tokens, meta)

    # group 2: donor A = [extra system turn] + B's whole text; served B starts where A's overlap
    # starts
    prompts, meta = [], []
    donors = {}
    for seed in range(start, start + n):
        ex = P.make_example(seed, split, history="none")
        b = _encode(tokenizer, ex.prompt_text)
        pre = _aligned_preamble(tokenizer, seed, block_size, split)
        a = pre + b
        assert _encode(tokenizer,
                       tokenizer.decode(pre) + ex.prompt_text) == a, "A must tokenize as pre + B"
        donors[seed] = len(prompts)
        prompts.append(a)
        meta.append({"group": 2, "seed": seed, "role": "donor", "expected": ex.answer,
                     "lang": ex.lang,
                     "offset": len(pre)})
    for seed in range(start, start + n):
        ex = P.make_example(seed, split, history="none")
        prompts.append(_encode(tokenizer, ex.prompt_text))
        meta.append({"group": 2, "seed": seed, "role": "served", "expected": ex.answer,
                     "lang": ex.lang,
                     "donor": donors[seed], "offset": meta[donors[seed]]["offset"]})
    groups[2] = Workload("seed-groups/2", prompts, max_tokens, meta)

    # group 3: A's history updates the passphrase, B's does not; same system prompt
    prompts, meta = [], []
    for seed in range(start, start + n):
        lang = "zh" if seed % 2 else "en"
        a = P.make_example(seed, split, lang=lang, history="update")
        b = P.make_example(seed, split, lang=lang, history="chat" if seed % 3 == 0 else "none")
        assert a.system == b.system and a.answer != b.answer
        history_a = "".join(P.chatml("user", t.user) + P.chatml("assistant", t.assistant)
                            for t in a.turns[:-1])
        question_b = P.chatml("user", b.turns[-1].user) + P.IM_START + "assistant\n"
        beyond = _encode(tokenizer, a.prefix_text + history_a) + _encode(tokenizer, question_b)
        prefix = len(_encode(tokenizer, a.prefix_text))
        prompts.append(_encode(tokenizer, a.prompt_text))
        meta.append({"group": 3, "seed": seed, "role": "donor", "expected": a.answer, "lang": lang,
                     "history": "update", "prefix_tokens": prefix})
        prompts.append(_encode(tokenizer, b.prompt_text))
        meta.append({"group": 3, "seed": seed, "role": "served", "expected": b.answer, "lang": lang,
                     "history": b.extra["history"], "prefix_tokens": prefix,
                     "beyond_prompt": beyond,
                     "other_answer": a.answer})
    groups[3] = Workload("seed-groups/3", prompts, max_tokens, meta)
    return groups
