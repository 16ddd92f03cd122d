"""The oracle: transformers' own ``model.generate`` on the same token ids.

kvlab's engine and ``kvlab.prefix`` are checked against these, token for token in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .models import encode, eos_ids, model_device_dtype


def _hf_generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    seed: int | None,
    **kwargs: Any,
) -> tuple[Any, int]:
    """``model.generate`` on the prompt's ids (eos and pad from the model); its output and the
    prompt length."""
    device, _ = model_device_dtype(model)
    # (1, T)
    ids = torch.tensor([encode(tokenizer, prompt)], device=device)
    if kwargs.get("do_sample"):
        torch.manual_seed(0 if seed is None else seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_ids(model, tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    return out, ids.shape[1]


@torch.no_grad()
def hf_generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
) -> list[int]:
    """The reference: transformers' own ``model.generate`` on the same ids, new tokens only."""
    kwargs: dict[str, Any] = {"do_sample": do_sample}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    out, n = _hf_generate(model, tokenizer, prompt, max_new_tokens, seed, **kwargs)
    return out[0, n:].tolist()


@torch.no_grad()
def hf_generate_with_logits(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    max_new_tokens: int = 32,
    **sampling: Any,
) -> tuple[list[int], list[torch.Tensor]]:
    """``hf_generate`` that also returns the raw (vocab,) logits of every step, before any
    warper."""
    seed = sampling.pop("seed", None)
    sampling.setdefault("do_sample", False)
    out, n = _hf_generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens,
        seed,
        return_dict_in_generate=True,
        output_logits=True,
        **sampling,
    )
    return out.sequences[0, n:].tolist(), [step[0].float().cpu() for step in out.logits]
