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
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvlab.models import model_fingerprint


def _fingerprint(model: Any, tokenizer: Any) -> str:
    """Fingerprint memoised on the model object (hashing weights on every call would be slow)."""
    memo = model.__dict__.setdefault("_kvlab_fingerprints", {})
    key = id(tokenizer)
    if key not in memo:
        memo[key] = model_fingerprint(model, tokenizer)
    return memo[key]


def encode(tokenizer: Any, text_or_ids: str | Sequence[int]) -> list[int]:
    """Token ids of a text (no special tokens added: ChatML markup is spelled out in the text)."""
    if isinstance(text_or_ids, str):
        return list(tokenizer(text_or_ids, add_special_tokens=False)["input_ids"])
    return [int(t) for t in text_or_ids]


def model_device_dtype(model: Any) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of a model's parameters."""
    p = next(model.parameters())
    return p.device, p.dtype


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
    def build(cls, model: Any, tokenizer: Any, prefix: str | Sequence[int]) -> "PrefixCache":
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

    def fork(self) -> "PrefixCache":
        """An independent copy: writing into the fork never changes this cache."""
        with torch.no_grad():
            return PrefixCache(self.token_ids, copy.deepcopy(self.cache), self.fingerprint,
                               self.device, self.dtype, self.build_seconds)

    def seq_length(self) -> int:
        """How many tokens the underlying K/V tensors hold now (grows if someone writes into it)."""
        return int(self.cache.get_seq_length())

    def nbytes(self) -> int:
        """Bytes of K and V held by the cache."""
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def check_compatible(self, model: Any, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        """Raise ``PrefixMismatchError`` unless this cache can serve ``prompt_ids`` on this model."""
        fp = _fingerprint(model, tokenizer)
        if fp != self.fingerprint:
            raise PrefixMismatchError(
                f"this prefix cache was built by another model or tokenizer (fingerprint {self.fingerprint}, "
                f"this model/tokenizer is {fp}); build a new PrefixCache with this model")
        device, dtype = model_device_dtype(model)
        if device != self.device or dtype != self.dtype:
            raise PrefixMismatchError(
                f"prefix cache is on {self.device}/{self.dtype} but the model is on {device}/{dtype}")
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
    least one token) so seeded sampling reproduces ``model.generate`` token for token.
    """
    if not do_sample:
        return int(torch.argmax(logits))
    scores = logits.float() / temperature
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
    recomputed, because its logits are needed for the first new token (vLLM does the same).
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
            cache.crop(n_cached)
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
