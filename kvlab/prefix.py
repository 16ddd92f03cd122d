"""Manual prefix reuse on Hugging Face models, with a complete and readable generation loop.

The article's ``get_prefix_cache`` / ``generate_with_prefix_cache`` stop at "the generation logic is
omitted". Here the loop is finished:

1. ``PrefixCache.build`` runs the prefix once and keeps its K/V (a transformers ``DynamicCache``),
   its token ids and a fingerprint of the model and tokenizer that built it.
2. ``generate`` checks that the cache belongs to this model/tokenizer and that its ids are a prefix
   of the prompt's ids, forks it (a request must never write into a shared cache), prefills only the
   remaining tokens at positions ``len(prefix) ..``, then decodes one token per step.

``continue_from_cache`` is the unchecked core. The notebooks call it directly to run the *mistakes*
(another request's prefix, wrong positions) so the wrong outputs are measured, not asserted.
``get_prefix_cache`` / ``generate_with_prefix_cache`` are the article's two functions with the loop
written the naive way: they write into the shared cache (the pollution that notebook 02 shows).

Also here: ``compare_with_hf`` (token and logit equality with ``model.generate``), ``time_prefill``
(prefill with vs without the cached prefix), the tokenization checks ``check_prefix_tokens``,
``boundary_merge_cases`` and ``common_prefix_ids``, and the checkers of notebook 02's exercises.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.models import model_fingerprint


def _fingerprint(model: Any, tokenizer: Any) -> str:
    """The fingerprint of every weight and the tokenizer, computed afresh on each call (never memoised).

    A memo cannot be trusted: a write through ``p.data`` does not bump ``p._version``, and a modified
    copy has weights a sparse sample may skip. ``PrefixCache.build`` hashes once; each ``generate``
    with a prefix cache hashes the model it is given again and compares. Measured on the bundled model
    (0.72 M float32 parameters, one CPU core): about 6 ms per call; for larger models about 1 s per
    GB of weights (sha256 at about 1 GB/s).
    """
    return model_fingerprint(model, tokenizer)


def encode(tokenizer: Any, text_or_ids: str | Sequence[int]) -> list[int]:
    """Token ids of a text (no special tokens added: ChatML markup is spelled out in the text).

    Ids pass through as Python ints when they are a sequence (list, tuple, range, 1-D numpy array or
    torch tensor) of real integers: Python or numpy ints, never bools, floats, strings or bytes. Anything
    else (bytes, a dict, a set, floats such as 1.7, digit strings such as "5") raises ``TypeError``
    instead of being coerced into other tokens.
    """
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise TypeError("a text prompt needs a tokenizer: pass token ids")
        return list(tokenizer(text_or_ids, add_special_tokens=False)["input_ids"])
    import numpy as np

    if isinstance(text_or_ids, (np.ndarray, torch.Tensor)):
        if isinstance(text_or_ids, torch.Tensor):
            integer = not (text_or_ids.is_floating_point() or text_or_ids.is_complex() or text_or_ids.dtype == torch.bool)
        else:
            integer = bool(np.issubdtype(text_or_ids.dtype, np.integer))
        if text_or_ids.ndim != 1 or not integer:
            raise TypeError(f"token ids must be a 1-D array of integers, got {text_or_ids.ndim}-D {text_or_ids.dtype}")
        return [int(t) for t in text_or_ids.tolist()]
    if not isinstance(text_or_ids, Sequence) or isinstance(text_or_ids, (bytes, bytearray)):
        raise TypeError(f"a prompt must be a str or a sequence of int token ids, got {type(text_or_ids).__name__}")
    ids = []
    for t in text_or_ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be ints, got {type(t).__name__} {t!r}")
        ids.append(int(t))
    return ids


def model_device_dtype(model: Any) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of a model's parameters."""
    p = next(model.parameters())
    return p.device, p.dtype


def cache_nbytes(cache: Any) -> int:
    """Bytes of all K and V tensors in a transformers cache (every layer)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class PrefixMismatchError(ValueError):
    """A prefix cache cannot serve this prompt (other ids, other model/tokenizer, other device/dtype)."""


@dataclass
class PrefixCache:
    """The K/V of a prefix, computed once, with what is needed to reuse it safely."""

    token_ids: tuple[int, ...]
    cache: Any  # transformers DynamicCache, layers of (1, kv_heads, len(token_ids), head_dim)
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    build_seconds: float = 0.0

    @classmethod
    @torch.no_grad()
    def build(cls, model: Any, tokenizer: Any, prefix: str | Sequence[int]) -> PrefixCache:
        """Run the prefix through the model once and keep its K/V."""
        ids = encode(tokenizer, prefix)
        if not ids:
            raise ValueError("the prefix is empty: nothing to cache")
        device, dtype = model_device_dtype(model)
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        _sync(device)
        return cls(tuple(ids), out.cache, _fingerprint(model, tokenizer), device, dtype,
                   time.perf_counter() - t0)

    def __len__(self) -> int:
        return len(self.token_ids)

    def fork(self) -> PrefixCache:
        """An independent copy: writing into the fork never changes this cache."""
        with torch.no_grad():
            return PrefixCache(self.token_ids, copy.deepcopy(self.cache), self.fingerprint,
                               self.device, self.dtype, self.build_seconds)

    def seq_length(self) -> int:
        """How many tokens the underlying K/V tensors hold now (grows if someone writes into it)."""
        return int(self.cache.get_seq_length())

    def nbytes(self) -> int:
        """Bytes of K and V held by the cache."""
        return cache_nbytes(self.cache)

    def check_compatible(self, model: Any, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        """Raise ``PrefixMismatchError`` unless this cache can serve ``prompt_ids`` on this model."""
        device, dtype = model_device_dtype(model)
        k = self.cache.layers[0].keys  # (1, kv_heads, seq, head_dim)
        if k.device != device or k.dtype != dtype:
            raise PrefixMismatchError(
                f"the prefix cache's K/V are {k.device}/{k.dtype} but the model is on {device}/{dtype}; "
                "build the PrefixCache after moving the model (`.to(...)`), not before")
        fp = _fingerprint(model, tokenizer)
        if fp != self.fingerprint:
            raise PrefixMismatchError(
                f"this prefix cache was built by another model or tokenizer (fingerprint {self.fingerprint}, "
                f"this model/tokenizer is {fp}); build a new PrefixCache with this model")
        if self.seq_length() != len(self.token_ids):
            raise PrefixMismatchError(
                f"the cache holds {self.seq_length()} tokens but its prefix has {len(self.token_ids)}: "
                "it was written into (polluted); use fork() for each request")
        n = len(self.token_ids)
        if tuple(prompt_ids[:n]) != self.token_ids:
            first = next((i for i, (a, b) in enumerate(zip(prompt_ids, self.token_ids)) if a != b),
                         min(n, len(prompt_ids)))
            raise PrefixMismatchError(
                f"the cached prefix ({n} tokens) is not a prefix of the prompt ({len(prompt_ids)} tokens): "
                f"first difference at token {first} "
                f"(prompt {list(prompt_ids[first:first + 3])} vs cache {list(self.token_ids[first:first + 3])}); "
                "tokenize the full prompt once and cut the prefix from its ids (see check_prefix_tokens)")


@dataclass
class GenerationResult:
    """What one call to ``generate`` produced, and what it cost."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, end-of-turn included when it was produced
    text: str
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    prefill_seconds: float  # time to the first token's logits
    total_seconds: float
    step_logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # (vocab,) per step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a turn: the generation config's eos ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    out = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return out


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> int:
    """Pick the next token from (vocab,) logits: argmax, or temperature/top-k/top-p sampling.

    The filters follow transformers' logits warpers (temperature, then top-k, then top-p keeping at
    least one token) so seeded sampling reproduces ``model.generate`` token for token. A temperature
    so small that ``logits / temperature`` overflows (about 1e-38 and below in float32) would make
    every probability NaN; then the maximum is subtracted first, in float64, which gives the limit
    as the temperature goes to 0: the most likely tokens keep all the probability.
    """
    if not do_sample:
        return int(torch.argmax(logits))
    scores = logits.float() / temperature
    if bool(scores.isnan().any() or scores.isposinf().any()):  # overflowed: sample the t -> 0 limit stably
        shifted = logits.double() - logits.double().max()
        scores = (shifted / temperature).float()  # 0 at the maximum, -inf (or very negative) elsewhere
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def continue_from_cache(model: Any, cache: Any, input_ids: Sequence[int], start_pos: int, *,
                        max_new_tokens: int = 32, stop_ids: set[int] | None = None,
                        do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                        top_k: int = 0, seed: int | None = None, keep_logits: bool = False):
    """Unchecked core loop: prefill ``input_ids`` at positions ``start_pos ..`` on top of ``cache``, then decode.

    ``cache`` is written into (pass a fork unless pollution is the point). Returns
    ``(generated ids, prefill seconds, total seconds, per-step logits)``.
    """
    device, _ = model_device_dtype(model)
    generator = None
    if do_sample:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    stop_ids = stop_ids or set()
    ids = torch.tensor([list(input_ids)], device=device)  # (1, T)
    pos = torch.arange(start_pos, start_pos + ids.shape[1], device=device)[None]  # (1, T)
    t0 = time.perf_counter()
    out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1]  # (vocab,)
    _sync(device)
    prefill = time.perf_counter() - t0
    generated: list[int] = []
    kept: list[torch.Tensor] = []
    next_pos = start_pos + ids.shape[1]
    for _ in range(max_new_tokens):
        if keep_logits:
            kept.append(logits.detach().float().cpu())
        tok = sample_next(logits, do_sample, temperature, top_p, top_k, generator)
        generated.append(tok)
        if tok in stop_ids:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device),
                    position_ids=torch.tensor([[next_pos]], device=device), cache=cache, use_cache=True)
        logits = out.logits[0, -1]
        next_pos += 1
    _sync(device)
    return generated, prefill, time.perf_counter() - t0, kept


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def generate(model: Any, tokenizer: Any, prompt: str | Sequence[int], prefix_cache: PrefixCache | None = None,
             max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, keep_logits: bool = False) -> GenerationResult:
    """Generate a completion, reusing ``prefix_cache`` for the prompt's leading tokens when given.

    Only the tokens after the cached prefix are prefilled. The prefix cache itself is never
    modified (the loop works on a fork). When the prompt *is* the prefix, the last token is
    recomputed, because its logits are needed for the first new token (vLLM does the same). On a
    sliding-window model (Mistral, Gemma2 ...) whose window the prefix already fills, the cache cannot
    drop that token (it kept no earlier one), so such a prompt is computed without the cache
    (``num_cached_tokens == 0``); the tokens are the same.
    """
    _check_sampling(max_new_tokens, temperature, top_p, top_k)
    prompt_ids = encode(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {limit} positions")
    if prefix_cache is None:
        from transformers import DynamicCache

        cache, n_cached = DynamicCache(config=model.config), 0
    else:
        prefix_cache.check_compatible(model, tokenizer, prompt_ids)
        cache, n_cached = prefix_cache.fork().cache, len(prefix_cache)
        if n_cached == len(prompt_ids):  # keep one token to compute: its logits start the answer
            n_cached -= 1
            try:
                cache.crop(-1)  # transformers 5.x: a negative count removes that many tokens
            except RuntimeError:
                # a sliding-window layer that already holds a full window keeps no token before it, so
                # it cannot drop the last one: compute the whole prompt afresh (exact, nothing reused)
                from transformers import DynamicCache

                cache, n_cached = DynamicCache(config=model.config), 0
    gen, prefill, total, kept = continue_from_cache(
        model, cache, prompt_ids[n_cached:], n_cached, max_new_tokens=max_new_tokens,
        stop_ids=eos_ids(model, tokenizer), do_sample=do_sample, temperature=temperature, top_p=top_p,
        top_k=top_k, seed=seed, keep_logits=keep_logits)
    text = tokenizer.decode(gen, skip_special_tokens=True)
    return GenerationResult(prompt_ids, gen, text, n_cached, prefill, total, kept)


@torch.no_grad()
def hf_generate(model: Any, tokenizer: Any, prompt: str | Sequence[int], max_new_tokens: int = 32,
                do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None) -> list[int]:
    """The reference: transformers' own ``model.generate`` on the same ids, new tokens only."""
    device, _ = model_device_dtype(model)
    ids = torch.tensor([encode(tokenizer, prompt)], device=device)
    kwargs: dict[str, Any] = {"do_sample": do_sample}
    if do_sample:
        torch.manual_seed(0 if seed is None else seed)
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=sorted(eos_ids(model, tokenizer)), pad_token_id=tokenizer.pad_token_id,
                         **kwargs)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def hf_generate_with_logits(model: Any, tokenizer: Any, prompt: str | Sequence[int], max_new_tokens: int = 32,
                            **sampling: Any) -> tuple[list[int], list[torch.Tensor]]:
    """``hf_generate`` that also returns the raw (vocab,) logits of every step, before any warper."""
    device, _ = model_device_dtype(model)
    ids = torch.tensor([encode(tokenizer, prompt)], device=device)  # (1, T)
    do_sample = sampling.pop("do_sample", False)
    seed = sampling.pop("seed", None)
    if do_sample:
        torch.manual_seed(0 if seed is None else seed)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=sorted(eos_ids(model, tokenizer)), pad_token_id=tokenizer.pad_token_id,
                         do_sample=do_sample, return_dict_in_generate=True, output_logits=True, **sampling)
    return out.sequences[0, ids.shape[1]:].tolist(), [step[0].float().cpu() for step in out.logits]


def compare_with_hf(model: Any, tokenizer: Any, prompts: Sequence[str | Sequence[int]],
                    prefixes: Sequence[str | Sequence[int] | PrefixCache], max_new_tokens: int = 16,
                    **sampling: Any) -> list[dict[str, Any]]:
    """Run each prompt through ``generate`` with its prefix cache and through HF ``generate``; compare.

    One row per prompt: cached tokens, whether the generated ids are identical, and the max abs
    difference between the two loops' logits over the steps both produced.
    """
    rows = []
    built: dict[Any, PrefixCache] = {}
    for prompt, prefix in zip(prompts, prefixes, strict=True):
        if not isinstance(prefix, PrefixCache):
            key = prefix if isinstance(prefix, str) else tuple(prefix)
            if key not in built:
                built[key] = PrefixCache.build(model, tokenizer, prefix)
            prefix = built[key]
        ours = generate(model, tokenizer, prompt, prefix, max_new_tokens=max_new_tokens, keep_logits=True,
                        **sampling)
        ref_ids, ref_logits = hf_generate_with_logits(model, tokenizer, prompt, max_new_tokens, **sampling)
        steps = min(len(ours.step_logits), len(ref_logits))
        diff = max((float((a - b).abs().max()) for a, b in zip(ours.step_logits[:steps], ref_logits[:steps])),
                   default=0.0)
        rows.append({"prompt_tokens": len(ours.prompt_ids), "cached_tokens": ours.num_cached_tokens,
                     "identical": ours.token_ids == ref_ids, "new_tokens": len(ours.token_ids),
                     "max_abs_logit_diff": diff, "ours": ours.text,
                     "hf": tokenizer.decode(ref_ids, skip_special_tokens=True)})
    return rows


# ----------------------------------------------------------------------------- the article's code, finished naively

@torch.no_grad()
def get_prefix_cache(model: Any, tokenizer: Any, prefix: str) -> tuple[Any, int]:
    """The article's ``get_prefix_cache``: one forward pass over the prefix; returns (cache, prefix_len)."""
    inputs = tokenizer(prefix, return_tensors="pt").to(model.device)  # add_special_tokens left at its default
    outputs = model(**inputs, use_cache=True)
    return outputs.cache, inputs.input_ids.shape[1]


@torch.no_grad()
def generate_with_prefix_cache(model: Any, tokenizer: Any, prefix_cache: Any, prefix_len: int, suffix: str,
                               max_new_tokens: int = 20) -> list[int]:
    """The article's ``generate_with_prefix_cache`` with its elided loop written the obvious way.

    Greedy; positions are left to transformers (it counts the tokens already in the cache). It
    writes into ``prefix_cache``: the mistake notebook 02 runs on purpose (cache pollution).
    """
    suffix_ids = tokenizer(suffix, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    out = model(input_ids=suffix_ids, cache=prefix_cache, use_cache=True)
    stop = eos_ids(model, tokenizer)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())
        generated.append(tok)
        if tok in stop or len(generated) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=model.device), cache=prefix_cache, use_cache=True)
    return generated


@torch.no_grad()
def stepwise_logits(model: Any, ids: Sequence[int], use_cache: bool = True) -> torch.Tensor:
    """(T, vocab) logits of an HF model fed one token at a time: with its cache, or forgetting it each step."""
    from transformers import DynamicCache

    device, _ = model_device_dtype(model)
    cache = DynamicCache(config=model.config)
    rows = []
    for t, tok in enumerate(ids):
        step_cache = cache if use_cache else DynamicCache(config=model.config)  # a fresh one = no memory
        out = model(input_ids=torch.tensor([[tok]], device=device), position_ids=torch.tensor([[t]], device=device),
                    cache=step_cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def pollution_pairs(model: Any, tokenizer: Any, n: int, start: int = 0, max_new_tokens: int = 16
                    ) -> list[dict[str, Any]]:
    """Run request A (the passphrase was changed in its history) then request B on one shared cache.

    B asks for the system prompt's passphrase. Per pair: B's answer isolated, B's answer after A
    polluted the shared cache (the article's code), and the cache length at each stage.
    """
    from kvlab.passphrase import make_example, normalize_answer, with_question

    rows = []
    for seed in range(start, start + n):
        a = make_example(seed, "heldout", history="update")
        b = with_question(make_example(seed, "heldout", history="none"), "What is the passphrase?")
        cache, plen = get_prefix_cache(model, tokenizer, a.prefix_text)
        a_ids = generate_with_prefix_cache(model, tokenizer, cache, plen, a.suffix_text, max_new_tokens)
        after_a = int(cache.get_seq_length())
        b_ids = generate_with_prefix_cache(model, tokenizer, cache, plen, b.suffix_text, max_new_tokens)
        isolated = hf_generate(model, tokenizer, b.prompt_text, max_new_tokens)
        dec = lambda ids: normalize_answer(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
        rows.append({"seed": seed, "prefix_tokens": plen, "cache_after_A": after_a,
                     "cache_after_B": int(cache.get_seq_length()), "A_answer": dec(a_ids), "A_expected": a.answer,
                     "B_expected": b.answer, "B_isolated": dec(isolated), "B_polluted": dec(b_ids)})
    return rows


# ----------------------------------------------------------------------------- tokenization pitfalls

@dataclass
class TokenCheck:
    """Is the prefix's own tokenization a prefix of the full text's tokenization? Where does it break?"""

    ok: bool
    prefix_ids: list[int]
    full_ids: list[int]
    first_diff: int | None  # first token index where they differ (None when ok)
    prefix_around: list[str]  # decoded tokens around first_diff, prefix tokenized alone
    full_around: list[str]  # the same positions, full text tokenized

    def __str__(self) -> str:
        if self.ok:
            return f"ok: the prefix's {len(self.prefix_ids)} tokens are the first tokens of the full text"
        return (f"mismatch at token {self.first_diff} of {len(self.prefix_ids)}: "
                f"prefix alone {self.prefix_around} vs inside the full text {self.full_around}")


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token as the text it stands for (bytes that are not whole characters shown as escapes)."""
    pieces = []
    for t in ids:
        text = tokenizer.decode([t])
        pieces.append(text if "\ufffd" not in text else tokenizer.convert_ids_to_tokens(t))
    return pieces


def check_prefix_tokens(tokenizer: Any, prefix: str | Sequence[int], full: str | Sequence[int],
                        context: int = 2) -> TokenCheck:
    """Report whether ``prefix`` tokenized alone is a token prefix of ``full``, and the first difference."""
    p, f = encode(tokenizer, prefix), encode(tokenizer, full)
    first = next((i for i, (a, b) in enumerate(zip(p, f)) if a != b), None)
    if first is None and len(p) > len(f):
        first = len(f)
    if first is None:
        return TokenCheck(True, p, f, None, [], [])
    lo = max(0, first - context)
    return TokenCheck(False, p, f, first, token_pieces(tokenizer, p[lo:first + context + 1]),
                      token_pieces(tokenizer, f[lo:first + context + 1]))


def boundary_merge_cases(tokenizer: Any, texts: Sequence[str], limit: int = 10, stride: int = 1
                         ) -> list[tuple[str, str, TokenCheck]]:
    """Cut points in ``texts`` where the prefix tokenized alone is *not* a prefix of the whole text's tokens.

    Returns up to ``limit`` triples ``(prefix, suffix, check)`` with distinct merged pieces: real
    cases where BPE merges characters across the boundary of a text split.
    """
    cases, seen = [], set()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {t.content for t in added.values()} | set(tokenizer.all_special_tokens)
    for text in texts:
        full_ids = encode(tokenizer, text)
        inside = {i for s in specials for start in _find_all(text, s) for i in range(start + 1, start + len(s))}
        for cut in range(1, len(text), stride):
            if cut in inside:  # cutting a special token in half is not a tokenization subtlety
                continue
            check = check_prefix_tokens(tokenizer, text[:cut], full_ids)
            if not check.ok:
                key = tuple(check.full_around)
                if key not in seen:
                    seen.add(key)
                    cases.append((text[:cut], text[cut:], check))
                    if len(cases) >= limit:
                        return cases
    return cases


def _find_all(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i != -1:
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def common_prefix_ids(tokenizer: Any, prompts: Sequence[str | Sequence[int]]) -> list[int]:
    """The longest run of token ids that every prompt starts with, each prompt tokenized whole.

    Building the prefix cache from these ids (not from the prefix text tokenized alone) can never
    hit a BPE merge across the boundary.
    """
    seqs = [encode(tokenizer, p) for p in prompts]
    if not seqs:
        raise ValueError("no prompts")
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return seqs[0][:n]


def with_bos_tokenizer(tokenizer: Any, bos: str = "<|endoftext|>") -> Any:
    """A copy of a fast tokenizer that, like Llama's, prepends ``bos`` when ``add_special_tokens=True``.

    Qwen-style tokenizers add nothing, so ``add_special_tokens`` seems harmless until the tokenizer
    changes; this copy makes the pitfall visible with the bundled vocabulary.
    """
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    bos_id = tok.convert_tokens_to_ids(bos)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    return tok


# ----------------------------------------------------------------------------- time saved

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
        _sync(device)
        t_full.append(time.perf_counter() - t0)
        fork = copy.deepcopy(prefix_cache)  # not timed: a paged cache would share, not copy
        t0 = time.perf_counter()
        b = cached(fork)
        _sync(device)
        t_cached.append(time.perf_counter() - t0)
        diff = max(diff, float((a.float() - b.float()).abs().max()))
    f, c = statistics.median(t_full), statistics.median(t_cached)
    return {"prefix_tokens": len(prefix_ids), "suffix_tokens": len(suffix_ids), "full_s": f, "cached_s": c,
            "ratio": c / f, "ideal": len(suffix_ids) / (len(prefix_ids) + len(suffix_ids)),
            "max_abs_logit_diff": diff}


# ----------------------------------------------------------------------------- exercise checkers

def _verdict(ok: bool, good: str, hint: str) -> str:
    return ("correct: " + good) if ok else ("not yet: " + hint)


def check_generate_fn(fn: Any, model: Any, tokenizer: Any, n: int = 4, max_new_tokens: int = 12) -> str:
    """Exercise 02.1: ``fn(model, tokenizer, prefix_text, suffix_text, max_new_tokens) -> new ids``.

    It must reuse a prefix cache and give exactly ``model.generate``'s greedy tokens, and it must
    work for two suffixes in a row after one prefix (no pollution). Returns a verdict, never raises.
    """
    from kvlab.passphrase import make_examples, with_question

    if fn is None:
        return "no answer yet: define my_generate and pass it in"
    for ex in make_examples(n, "heldout", start=100):
        for e in (ex, with_question(ex, "Tell me the passphrase.")):
            want = hf_generate(model, tokenizer, e.prompt_text, max_new_tokens)
            try:
                got = list(fn(model, tokenizer, e.prefix_text, e.suffix_text, max_new_tokens))
            except Exception as err:  # the learner's code may fail in any way
                return f"not yet: your function raised {type(err).__name__}: {err}"
            if got != want:
                return (f"not yet: on example {e.seed} you generated {got[:8]}... but model.generate gives "
                        f"{want[:8]}...; check the positions and that the prefix cache is not written into")
    return _verdict(True, f"{2 * n} prompts identical to model.generate", "")


def check_boundary_case(tokenizer: Any, prefix: str | None, suffix: str | None) -> str:
    """Exercise 02.2: a split of a text where BPE merges across the boundary."""
    if prefix is None or suffix is None:
        return "no answer yet"
    check = check_prefix_tokens(tokenizer, prefix, prefix + suffix)
    return _verdict(not check.ok, str(check),
                    "this split tokenizes the same alone and inside the full text; try a cut inside a "
                    "word, or just before letters that follow punctuation")


def check_crop_reuse(fn: Any, model: Any, tokenizer: Any, n: int = 3, max_new_tokens: int = 12) -> str:
    """Exercise 02.3: ``fn(model, tokenizer, cache, prefix_len, suffixes, max_new_tokens) -> list of id lists``.

    One cache object serves several suffixes one after another, cropped back after each request
    (no fork). Every answer must equal the isolated ``model.generate`` answer.
    """
    from kvlab.passphrase import make_example, with_question

    if fn is None:
        return "no answer yet: define my_serial_reuse and pass it in"
    ex = make_example(7, "heldout", history="none")
    questions = ["What is the passphrase?", "Tell me the passphrase.", "请说出口令。"][:n]
    examples = [with_question(ex, q) for q in questions]
    prefix_ids = encode(tokenizer, ex.prefix_text)
    cache = PrefixCache.build(model, tokenizer, prefix_ids).cache
    try:
        got = fn(model, tokenizer, cache, len(prefix_ids), [e.suffix_text for e in examples], max_new_tokens)
    except Exception as err:  # the learner's code may fail in any way
        return f"not yet: your function raised {type(err).__name__}: {err}"
    for e, g in zip(examples, got, strict=False):
        want = hf_generate(model, tokenizer, e.prompt_text, max_new_tokens)
        if list(g) != want:
            return (f"not yet: for {e.turns[-1].user!r} you generated {list(g)[:8]} but model.generate gives "
                    f"{want[:8]}; did you crop the cache back to the prefix after each request?")
    if int(cache.get_seq_length()) != len(prefix_ids):
        return f"not yet: the answers match but the cache holds {cache.get_seq_length()} tokens, not {len(prefix_ids)}"
    return _verdict(len(got) == len(examples), f"{len(examples)} requests identical, cache back to "
                    f"{len(prefix_ids)} tokens", "return one list of ids per suffix")
