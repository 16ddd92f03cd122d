"""Helpers every lesson uses: the article's decision table, timing, CJK-safe labels."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlab.engine.models import model_device_dtype, synchronize


@torch.no_grad()
def time_prefill(model: Any, prefix_ids: Sequence[int], suffix_ids: Sequence[int], repeats: int = 5
                 ) -> dict[str, float]:
    """Median seconds to the first token's logits: full prefill vs suffix-only on a cached prefix.

    Runs are interleaved (full, cached, full, ...) so a busy machine slows both alike. ``ideal`` is
    the uncached share of the tokens; ``max_abs_logit_diff`` checks both paths agree.
    """
    from transformers import DynamicCache

    device, _ = model_device_dtype(model)
    prefix_ids, suffix_ids = list(prefix_ids), list(suffix_ids)
    all_ids = torch.tensor([prefix_ids + suffix_ids], device=device)  # (1, P+S)
    suf = torch.tensor([suffix_ids], device=device)  # (1, S)
    pos = torch.arange(len(prefix_ids), len(prefix_ids) + len(suffix_ids), device=device)[None]  # (1, S)
    prefix_cache = model(input_ids=torch.tensor([prefix_ids], device=device), use_cache=True).cache

    def full() -> torch.Tensor:
        return model(input_ids=all_ids, cache=DynamicCache(config=model.config), use_cache=True,
                     logits_to_keep=1).logits[0, -1]

    def cached(cache: Any) -> torch.Tensor:
        return model(input_ids=suf, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    full(), cached(copy.deepcopy(prefix_cache))  # warm-up
    t_full, t_cached, diff = [], [], 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = full()
        synchronize(device)
        t_full.append(time.perf_counter() - t0)
        fork = copy.deepcopy(prefix_cache)  # not timed: a paged cache would share, not copy
        t0 = time.perf_counter()
        b = cached(fork)
        synchronize(device)
        t_cached.append(time.perf_counter() - t0)
        diff = max(diff, float((a.float() - b.float()).abs().max()))
    f, c = statistics.median(t_full), statistics.median(t_cached)
    return {"prefix_tokens": len(prefix_ids), "suffix_tokens": len(suffix_ids), "full_s": f, "cached_s": c,
            "ratio": c / f, "ideal": len(suffix_ids) / (len(prefix_ids) + len(suffix_ids)),
            "max_abs_logit_diff": diff}


def decision_table(evidence: dict[int, str] | None = None):
    """The article's decision table as a DataFrame, with an ``evidence`` column (row index -> text)."""
    import pandas as pd

    evidence = evidence or {}
    rows = [{"condition": en, "article (zh)": zh, "share?": s, "isolate?": i, "evidence (measured here)": evidence.get(k, "")}
            for k, (en, zh, s, i) in enumerate(DECISION_ROWS)]
    return pd.DataFrame(rows)


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


GIB = 2**30


CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
             "SimHei", "Microsoft YaHei", "PingFang SC", "Heiti SC", "Arial Unicode MS")


def _find_cjk_font() -> str | None:
    """The first installed font that can draw Chinese, added as a fallback after the default font."""
    from matplotlib import font_manager, rcParams

    installed = {f.name for f in font_manager.fontManager.ttflist}
    found = next((name for name in CJK_FONTS if name in installed), None)
    if found and found not in rcParams["font.sans-serif"]:
        rcParams["font.sans-serif"] = [rcParams["font.sans-serif"][0], found, *rcParams["font.sans-serif"][1:]]
    return found


CJK_FONT = _find_cjk_font()


def label(text: str) -> str:
    """Text safe to draw: CJK characters become ``\\uXXXX`` escapes when no CJK font is installed."""
    if CJK_FONT:
        return text
    return "".join(c if ord(c) < 0x2E80 else f"\\u{ord(c):04x}" for c in text)


DECISION_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("prefix token sequences are identical", "前缀token序列完全一致", "yes", "no"),
    ("the prefix starts at the same position", "前缀起始位置相同", "yes", "no"),
    ("later generation does not modify shared blocks", "后续生成不修改共享块", "yes", "no"),
    ("position encodings agree", "位置编码一致", "yes", "no"),
    ("later contexts of the requests are independent", "不同请求的后续上下文独立", "yes", "no"),
    ("shared blocks may be written", "共享块可能被写入", "no", "yes"),
    ("prefixes overlap partly but start differently", "前缀有部分重叠但起始不同", "no", "yes"),
    ("requests must be fully isolated", "需要保证请求间完全隔离", "no", "yes"),
)
