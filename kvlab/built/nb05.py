"""What notebook 05_shared_vs_isolated.ipynb writes (its ``#| export`` cells), GENERATED
by scripts/export_notebooks.py: do not edit; edit the cell named above each block and re-run it."""

from __future__ import annotations

import hashlib
from array import array
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

from kvlab.cache.block_manager import BlockManager
from kvlab.cache.block_pool import BlockPool
from kvlab.engine import Engine


# --- 05_shared_vs_isolated.ipynb, cell 13 ---
def new_pages(model, num_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged K/V store: K and V, (layers, num_blocks * block_size, kv_heads, head_dim)."""
    cfg, p = model.config, next(model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, num_blocks * block_size, cfg.num_key_value_heads, head_dim)
    return p.new_zeros(shape), p.new_zeros(shape)   # p's dtype and device


@contextmanager
def capstone_attention(model):
    """The model's attention is paged_attention (below) inside the with-block, its own after."""
    own = model.config._attn_implementation
    model.set_attn_implementation("kvlab_capstone")
    try:
        yield
    finally:
        model.set_attn_implementation(own)


# --- 05_shared_vs_isolated.ipynb, cell 14 ---
def paged_attention(module, query, key, value, attention_mask, scaling=None, step=None, **kwargs):
    """One layer: write new K/V to slots step.write, gather the sequence's at step.read, attend."""
    # query (1, heads, T, D); key, value (1, kv_heads, T, D), RoPE applied
    k_pages, v_pages = step.k[module.layer_idx], step.v[module.layer_idx]   # (slots, kv_heads, D)
    k_pages[step.write] = key[0].transpose(0, 1)              # (T, kv_heads, D) into their slots
    v_pages[step.write] = value[0].transpose(0, 1)
    k, v = k_pages[step.read], v_pages[step.read]             # gather: (end, kv_heads, D) in order
    group = query.shape[1] // k.shape[1]                      # query heads per K/V head
    k = k.transpose(0, 1).repeat_interleave(group, 0)[None]   # (1, heads, end, D)
    v = v.transpose(0, 1).repeat_interleave(group, 0)[None]
    end, t, dev = k.shape[2], query.shape[2], query.device
    causal = torch.arange(end, device=dev)[None] <= torch.arange(end - t, end, device=dev)[:, None]
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None             # (1, T, heads, D) for transformers


AttentionInterface.register("kvlab_capstone", paged_attention)
AttentionMaskInterface.register("kvlab_capstone", lambda *a, **kw: None)  # the mask is built above


# --- 05_shared_vs_isolated.ipynb, cell 16 ---
def paged_generate(model, prompts, cache, slot_mapping, max_tokens: int, eos: set = frozenset()):
    """Greedy decoding, request by request, via cache's block tables: (new tokens, cached) each."""
    (k, v), bs, results = new_pages(model, cache.num_blocks, cache.block_size), cache.block_size, []
    with torch.no_grad(), capstone_attention(model):
        for seq_id, prompt in enumerate(prompts):
            tokens, new = list(prompt), []
            start = cached = cache.allocate(seq_id, tokens)  # the cached prefix: not recomputed
            while True:
                table, end = cache.block_table(seq_id), len(tokens)
                step = SimpleNamespace(k=k, v=v, write=slot_mapping(table, bs, start, end),
                                       read=slot_mapping(table, bs, 0, end))
                ids, pos = torch.tensor([tokens[start:end]]), torch.arange(start, end)[None]
                out = model(input_ids=ids.to(k.device), position_ids=pos.to(k.device),
                            step=step, use_cache=False)  # ids, pos: (1, T) each
                new.append(int(out.logits[0, -1].argmax()))
                if len(new) == max_tokens or new[-1] in eos:
                    break
                cache.append(seq_id, new[-1])                # its K/V: written by the next forward
                tokens.append(new[-1])
                start = end
            cache.free(seq_id)                               # its full blocks stay cached
            results.append((new, cached))
    return results


# --- 05_shared_vs_isolated.ipynb, cell 25 ---
def restart_positions(item) -> range:
    """The bug: the tokens an item computes are numbered from 0, as if no prefix were cached."""
    skipped = item.seq.num_cached_tokens or 0           # prompt tokens served from the cache
    return range(item.start - skipped, item.end - skipped)   # right: range(item.start, item.end)


# --- 05_shared_vs_isolated.ipynb, cell 27 ---
def content_hash(parent, token_ids, extra_keys=()) -> bytes:
    """The bug's block key: the block's own token ids; no parent hash, so no position, no model."""
    return hashlib.sha256(array("q", token_ids).tobytes()).digest()


class ContentKeyedPool(BlockPool):
    """A pool whose lookup trusts equal token ids alone (kvlab's also checks the block's parent)."""

    def lookup(self, block_hash, ids, parent_serial, *args, **kwargs):
        return next((b for b in self.cached.get(block_hash, ()) if b.token_ids == list(ids)), None)


class ContentKeyedBlockManager(BlockManager):
    """kvlab's BlockManager with the two changes above: the same text anywhere is a hit."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, hash_fn=content_hash)
        self.pool = ContentKeyedPool(num_blocks, block_size)


# --- 05_shared_vs_isolated.ipynb, cell 29 ---
def prompts_for(workload, group: int, mode: str) -> list[list[int]]:
    """A row's prompts: in group 3's wrong row, B's question appended to A's cached conversation."""
    if group == 3 and mode == "shared (wrong)":
        return [m.get("beyond_prompt", p) for p, m in zip(workload.prompts, workload.meta)]
    return workload.prompts


# --- 05_shared_vs_isolated.ipynb, cell 31 ---
def make_engine(model, tok, group: int, mode: str, num_blocks: int, block_size: int) -> Engine:
    """The engine of one row of table 3.6: prefix caching off, on, or on with the group's bug."""
    kw = dict(max_num_batched_tokens=4096)   # every prompt of a group is admitted in the first step
    if mode == "shared (wrong)" and group == 2:
        return Engine(model, tok, cache=ContentKeyedBlockManager(num_blocks, block_size), **kw)
    kw.update(num_blocks=num_blocks, block_size=block_size)
    if mode == "isolated":
        return Engine(model, tok, enable_prefix_caching=False, **kw)
    if mode == "shared (wrong)" and group == 1:
        return Engine(model, tok, positions=restart_positions, **kw)
    return Engine(model, tok, **kw)   # shared (correct), and group 3's wrong row (a wrong prompt)
