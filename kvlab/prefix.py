"""Manual prefix reuse on Hugging Face models, with a complete and readable generation loop.

The article's ``get_prefix_cache`` / ``generate_with_prefix_cache`` stop at "the generation logic is
omitted". Here the loop is finished:

1. ``PrefixKV.build`` runs the prefix once and keeps its K/V (a transformers ``DynamicCache``),
   its token ids and a fingerprint of the model and tokenizer that built it.
2. ``generate`` checks that the cache belongs to this model/tokenizer and that its ids are a prefix
   of the prompt's ids, forks it (a request must never write into a shared cache), prefills only the
   remaining tokens at positions ``len(prefix) ..``, then decodes one token per step.

``continue_from_cache`` is the unchecked core. The notebooks call it directly to run the *mistakes*
(another request's prefix, wrong positions) so the wrong outputs are measured, not asserted. The
article's two functions, written the naive way that pollutes the shared cache, are notebook 02's
cells (``kvlab.built.nb02``). Also here: ``compare_with_hf`` (token and logit equality with
``model.generate``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.engine.models import (
    cache_nbytes,
    encode,
    eos_ids,
    model_device_dtype,
    model_fingerprint,
    synchronize,
)
from kvlab.engine.reference import hf_generate_with_logits
from kvlab.engine.sampling import sample_next


def _fingerprint(model: Any, tokenizer: Any) -> str:
    """The fingerprint of every weight and the tokenizer, computed afresh on each call (never
    memoised).

    A memo cannot be trusted: a write through ``p.data`` does not bump ``p._version``, and a
    modified copy has weights a sparse sample may skip. ``PrefixKV.build`` hashes once; each
    ``generate`` with a ``PrefixKV`` hashes the model it is given again and compares. Measured on
    the bundled model (0.72 M float32 parameters, one CPU core): about 6 ms per call; for larger
    models about 1 s per GB of weights (sha256 at about 1 GB/s).
    """
    return model_fingerprint(model, tokenizer)


class PrefixMismatchError(ValueError):
    """A ``PrefixKV`` cannot serve this prompt (other ids, other model/tokenizer, other
    device/dtype)."""


@dataclass
class PrefixKV:
    """The K/V of one prefix, computed once, with what is needed to reuse it safely.

    Notebook 02's manual reuse on an HF model; not the engine's block cache
    (``kvlab.cache.BlockManager``).
    """

    token_ids: tuple[int, ...]
    cache: Any  # transformers DynamicCache, layers of (1, kv_heads, len(token_ids), head_dim)
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    build_seconds: float = 0.0

    @classmethod
    @torch.no_grad()
    def build(cls, model: Any, tokenizer: Any, prefix: str | Sequence[int]) -> PrefixKV:
        """Run the prefix through the model once and keep its K/V."""
        ids = encode(tokenizer, prefix)
        if not ids:
            raise ValueError("the prefix is empty: nothing to cache")
        device, dtype = model_device_dtype(model)
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        synchronize(device)
        return cls(tuple(ids), out.cache, _fingerprint(model, tokenizer), device, dtype,
                   time.perf_counter() - t0)

    def __len__(self) -> int:
        return len(self.token_ids)

    def fork(self) -> PrefixKV:
        """An independent copy: writing into the fork never changes this cache."""
        with torch.no_grad():
            return PrefixKV(self.token_ids, copy.deepcopy(self.cache), self.fingerprint,
                               self.device, self.dtype, self.build_seconds)

    def seq_length(self) -> int:
        """How many tokens the underlying K/V tensors hold now (grows if someone writes into it)."""
        return int(self.cache.get_seq_length())

    def nbytes(self) -> int:
        """Bytes of K and V held by the cache."""
        return cache_nbytes(self.cache)

    def check_compatible(self, model: Any, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        """Raise ``PrefixMismatchError`` unless this cache can serve ``prompt_ids`` on this
        model."""
        device, dtype = model_device_dtype(model)
        k = self.cache.layers[0].keys  # (1, kv_heads, seq, head_dim)
        if k.device != device or k.dtype != dtype:
            raise PrefixMismatchError(
                f"the PrefixKV's K/V are {k.device}/{k.dtype} but the model is on "
                f"{device}/{dtype}; "
                "build the PrefixKV after moving the model (`.to(...)`), not before"
            )
        fp = _fingerprint(model, tokenizer)
        if fp != self.fingerprint:
            raise PrefixMismatchError(
                "this PrefixKV was built by another model or tokenizer (fingerprint "
                f"{self.fingerprint}, this model/tokenizer is {fp}); "
                "build a new PrefixKV with this model"
            )
        if self.seq_length() != len(self.token_ids):
            raise PrefixMismatchError(
                f"the cache holds {self.seq_length()} tokens but its prefix has "
                f"{len(self.token_ids)}: "
                "it was written into (polluted); use fork() for each request"
            )
        n = len(self.token_ids)
        if tuple(prompt_ids[:n]) != self.token_ids:
            first = next((i for i, (a, b) in enumerate(zip(prompt_ids, self.token_ids)) if a != b),
                         min(n, len(prompt_ids)))
            raise PrefixMismatchError(
                f"the cached prefix ({n} tokens) is not a prefix of the prompt ({len(prompt_ids)} "
                f"tokens): first difference at token {first} "
                f"(prompt {list(prompt_ids[first : first + 3])} vs cache "
                f"{list(self.token_ids[first : first + 3])}); "
                "tokenize the full prompt once and cut the prefix from its ids (see "
                "check_prefix_tokens)"
            )


@dataclass
class GenerationResult:
    """What one call to ``generate`` produced, and what it cost."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, end-of-turn included when it was produced
    text: str
    num_cached_tokens: int  # prompt tokens whose K/V came from the PrefixKV
    prefill_seconds: float  # time to the first token's logits
    total_seconds: float
    step_logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # (vocab,) per step


@torch.no_grad()
def continue_from_cache(model: Any, cache: Any, input_ids: Sequence[int], start_pos: int, *,
                        max_new_tokens: int = 32, stop_ids: set[int] | None = None,
                        do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                        top_k: int = 0, seed: int | None = None, keep_logits: bool = False):
    """Unchecked core loop: prefill ``input_ids`` at positions ``start_pos ..`` on top of ``cache``,
    then decode.

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
    synchronize(device)
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
        out = model(
            input_ids=torch.tensor([[tok]], device=device),
            position_ids=torch.tensor([[next_pos]], device=device),
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[0, -1]
        next_pos += 1
    synchronize(device)
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


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    prefix_kv: PrefixKV | None = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    keep_logits: bool = False,
) -> GenerationResult:
    """Generate a completion, reusing ``prefix_kv`` for the prompt's leading tokens when given.

    Only the tokens after the cached prefix are prefilled. The ``PrefixKV`` itself is never
    modified (the loop works on a fork). When the prompt *is* the prefix, the last token is
    recomputed, because its logits are needed for the first new token (vLLM does the same). On a
    sliding-window model (Mistral, Gemma2 ...) whose window the prefix already fills, the cache
    cannot drop that token (it kept no earlier one), so such a prompt is computed without the cache
    (``num_cached_tokens == 0``); the tokens are the same.
    """
    _check_sampling(max_new_tokens, temperature, top_p, top_k)
    prompt_ids = encode(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's {limit} positions"
        )
    if prefix_kv is None:
        from transformers import DynamicCache

        cache, n_cached = DynamicCache(config=model.config), 0
    else:
        prefix_kv.check_compatible(model, tokenizer, prompt_ids)
        cache, n_cached = prefix_kv.fork().cache, len(prefix_kv)
        if n_cached == len(prompt_ids):  # keep one token to compute: its logits start the answer
            n_cached -= 1
            try:
                cache.crop(-1)  # transformers 5.x: a negative count removes that many tokens
            except RuntimeError:
                # a sliding-window layer that already holds a full window keeps no token before it,
                # so it cannot drop the last one: compute the whole prompt afresh (exact, nothing
                # reused)
                from transformers import DynamicCache

                cache, n_cached = DynamicCache(config=model.config), 0
    gen, prefill, total, kept = continue_from_cache(
        model,
        cache,
        prompt_ids[n_cached:],
        n_cached,
        max_new_tokens=max_new_tokens,
        stop_ids=eos_ids(model, tokenizer),
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        keep_logits=keep_logits,
    )
    text = tokenizer.decode(gen, skip_special_tokens=True)
    return GenerationResult(prompt_ids, gen, text, n_cached, prefill, total, kept)


def compare_with_hf(model: Any, tokenizer: Any, prompts: Sequence[str | Sequence[int]],
                    prefixes: Sequence[str | Sequence[int] | PrefixKV], max_new_tokens: int = 16,
                    **sampling: Any) -> list[dict[str, Any]]:
    """Run each prompt through ``generate`` with its ``PrefixKV`` and through HF ``generate``;
    compare.

    One row per prompt: cached tokens, whether the generated ids are identical, and the max abs
    difference between the two loops' logits over the steps both produced.
    """
    rows = []
    built: dict[Any, PrefixKV] = {}
    for prompt, prefix in zip(prompts, prefixes, strict=True):
        if not isinstance(prefix, PrefixKV):
            key = prefix if isinstance(prefix, str) else tuple(prefix)
            if key not in built:
                built[key] = PrefixKV.build(model, tokenizer, prefix)
            prefix = built[key]
        ours = generate(
            model,
            tokenizer,
            prompt,
            prefix,
            max_new_tokens=max_new_tokens,
            keep_logits=True,
            **sampling,
        )
        ref_ids, ref_logits = hf_generate_with_logits(
            model, tokenizer, prompt, max_new_tokens, **sampling
        )
        steps = min(len(ours.step_logits), len(ref_logits))
        diff = max(
            (
                float((a - b).abs().max())
                for a, b in zip(ours.step_logits[:steps], ref_logits[:steps])
            ),
            default=0.0,
        )
        rows.append({"prompt_tokens": len(ours.prompt_ids), "cached_tokens": ours.num_cached_tokens,
                     "identical": ours.token_ids == ref_ids, "new_tokens": len(ours.token_ids),
                     "max_abs_logit_diff": diff, "ours": ours.text,
                     "hf": tokenizer.decode(ref_ids, skip_special_tokens=True)})
    return rows
