"""What notebook 02_manual_prefix_reuse.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import torch

from kvlab.engine.models import encode, eos_ids


# --- 02_manual_prefix_reuse.ipynb, cell 5 ---
@torch.no_grad()
def get_prefix_cache(model, tokenizer, prefix):
    """The article's get_prefix_cache: one forward pass over the prefix -> (cache, prefix_len)."""
    inputs = tokenizer(prefix, return_tensors="pt").to(model.device)  # default add_special_tokens
    outputs = model(**inputs, use_cache=True)
    return outputs.cache, inputs.input_ids.shape[1]


@torch.no_grad()
def generate_with_prefix_cache(model, tokenizer, prefix_cache, prefix_len, suffix,
                               max_new_tokens=20):
    """The article's generate_with_prefix_cache, "后续生成逻辑略" written the obvious way (greedy).
    transformers counts the cached tokens for positions; each new token goes into prefix_cache."""
    dev = model.device
    suffix_ids = tokenizer(suffix, return_tensors="pt", add_special_tokens=False).input_ids.to(dev)
    out = model(input_ids=suffix_ids, cache=prefix_cache, use_cache=True)
    generated = []
    for _ in range(max_new_tokens):
        tok = int(out.logits[0, -1].argmax())   # greedy
        generated.append(tok)
        if tok in eos_ids(model, tokenizer) or len(generated) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=dev), cache=prefix_cache, use_cache=True)
    return generated


# --- 02_manual_prefix_reuse.ipynb, cell 30 ---
def common_prefix_ids(tokenizer, prompts):
    """The longest run of ids all prompts start with, each encoded whole: no merge across a cut."""
    seqs = [encode(tokenizer, p) for p in prompts]
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return seqs[0][:n]
