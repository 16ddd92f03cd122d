"""What notebook 00_passphrase_experiment.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import time

import httpx

from kvlab.doctor.vllm_metrics import parse_metrics
from kvlab.engine.models import encode, eos_ids
from kvlab.prefix import PrefixKV, continue_from_cache


# --- 00_passphrase_experiment.ipynb, cell 7 ---
def ask(client, model: str, system: str, user: str, max_tokens: int = 16) -> dict:
    """One streamed chat request: its text, the client's TTFT, the server's prompt/cached tokens."""
    t0, ttft, text, usage = time.perf_counter(), None, "", None
    stream = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0   # the first text arrived
            text += chunk.choices[0].delta.content
        usage = chunk.usage if chunk.usage is not None else usage  # the last chunk: token counts
    if usage is None:
        raise RuntimeError("the server sent no usage: it must support "
                           "stream_options={'include_usage': True}")
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    return {"text": text, "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached}


def cache_counters(base_url: str, http=httpx) -> dict[str, float]:
    """The /metrics prefix-cache counters: prompt tokens looked up (queries) and found (hits)."""
    m = parse_metrics(http.get(base_url.removesuffix("/v1") + "/metrics").text)
    return {"queries": m["queries"] or 0.0, "hits": m["hits"] or 0.0}


# --- 00_passphrase_experiment.ipynb, cell 29 ---
def answer_with_swapped_prefix(model, tokenizer, example, donor, max_new_tokens: int = 16) -> str:
    """``example``'s user turn served on ``donor``'s system-prompt K/V: a wrong share, for real."""
    prefix = PrefixKV.build(model, tokenizer, donor.prefix_text)   # the donor's system turn, cached
    suffix = encode(tokenizer, example.suffix_text)
    ids, *_ = continue_from_cache(model, prefix.cache, suffix, len(prefix),
                                  max_new_tokens=max_new_tokens, stop_ids=eos_ids(model, tokenizer))
    return tokenizer.decode(ids, skip_special_tokens=True)
