"""The model side of an engine step (torch): pack the scheduled tokens, run the model once, LM head,
sample.

``forward`` packs every scheduled request's new tokens into one ``(1, T)`` row with its
``PagedBatch`` and runs the decoder inside ``paged_step()``. Only each request's last position
reaches the LM head, which the runner computes itself (the **head seam**, ``lm_head``); a probe at
construction checks that the seam gives exactly the model's own logits, else each step runs the
whole forward with ``logits_to_keep``. The model is switched to the paged attention by ``attach``
(``set_attn_implementation``, when a step has work) and given back by ``detach`` (when the engine is
idle). No object of transformers' is patched. Reference: nano-vllm's ``model_runner.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import paged_attention
from .accelerator import BoundAccelerator
from .admission import admit
from .hooks import checked_positions
from .kv_store import PagedKVStore
from .logprobs import record_prompt_logprobs
from .paged_attention import build_batch, paged_step
from .recovery import describe, recover
from .sampling import sample
from .scheduler import ScheduledSeq

__all__ = ["ModelRunner", "describe"]


class ModelRunner:
    """One HF causal LM switched to kvlab's paged attention: batches in, last-position logits and
    tokens out."""

    # the model's eos ids, which a request's min_tokens holds back (set by the engine)
    eos_ids: frozenset[int] = frozenset()

    def __init__(self, model: Any, store: PagedKVStore) -> None:
        """Attach the paged attention and probe one token through it; refuse a model it does not
        fully serve.

        The allow-list and the probe are ``admission.admit``: transformers can switch its attention,
        its forward takes ``position_ids``, its config has an int ``vocab_size``, the paged
        attention runs once per layer and is asked for nothing beyond causal SDPA with a scale and
        an optional window. A refused model gets its own attention back.
        """
        self.model, self.store, self.device = model, store, store.device
        # the speed paths (EngineConfig.accelerator, bound), set by ``accelerate`` after the probe
        self.accelerator: BoundAccelerator | None = None
        self.head, self.decoder = model.get_output_embeddings(), model.base_model
        cfg = model.config
        self.text_config = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        # the probe checks the seam through the head module itself
        self.fast_head = False
        # sets own_attention and attention (switched by attach() / detach())
        self.head_seam = admit(self, paged_attention)
        self.fast_head = type(self.head) is torch.nn.Linear
        # given back until the engine has work
        self.detach()

    def accelerate(self, accelerator: BoundAccelerator) -> None:
        """Run each step through ``accelerator``'s speed paths (its decoder, if it brings one,
        replaces the model's)."""
        self.accelerator = accelerator
        if accelerator.decoder is not None:
            self.decoder = accelerator.decoder

    def attach(self) -> bool:
        """Switch the model to the paged attention (``set_attn_implementation``) unless it is;
        whether it is now."""
        if self.model.config._attn_implementation != self.attention:
            # a no-op where transformers cannot switch it
            self.model.set_attn_implementation(self.attention)
        return self.model.config._attn_implementation == self.attention

    def detach(self) -> None:
        """Give the model back its own attention (HF's ``generate_batch`` and others check the
        name)."""
        if self.model.config._attn_implementation == self.attention:
            self.model.set_attn_implementation(self.own_attention)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head seam: ``(N, hidden)`` final hidden states -> ``(N, vocab)`` logits,
        post-processed as the model does.

        ``W @ x.T`` for a plain ``nn.Linear``: it measured faster than ``F.linear`` for a few rows
        of a large head (commit 91fc554).
        """
        head, logits = self.head, None
        # the accelerator's GEMM for the head (e.g. a prepacked one), where it has one
        if self.fast_head and self.accelerator is not None:
            logits = self.accelerator.head(hidden, head)
        if logits is None and self.fast_head:
            # (vocab, hidden) @ (hidden, N) -> (N, vocab)
            logits = (head.weight @ hidden.T).T
            logits = (logits if head.bias is None else logits + head.bias).contiguous()
        elif logits is None:
            logits = head(hidden)
        cfg = self.text_config
        # e.g. Cohere
        if getattr(cfg, "logit_scale", None) is not None:
            logits = logits * cfg.logit_scale
        # e.g. Granite
        if getattr(cfg, "logits_scaling", None) is not None:
            logits = logits / cfg.logits_scaling
        # e.g. Gemma 2
        cap = getattr(cfg, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # no autograd graph: it would chain every step through the K/V store and keep it all alive
    @torch.no_grad()
    def forward(
        self,
        items: list[ScheduledSeq],
        tables: list[list[int]],
        positions: list[Any] | None = None,
    ) -> tuple[torch.Tensor, list[int], list[bool]]:
        """One packed forward of the scheduled tokens: ``(logits, greedy token per row, row's top
        logit is NaN)``.

        ``tables[i]`` is item i's block table, ``positions[i]`` what a positions hook gave it (None:
        each token at its place in the sequence). The logits are ``(number of sampling items,
        vocab)``: a prompt chunk (it ends before its sequence) only writes its K/V and gets no row.
        ``argmax`` treats NaN as the largest, so a row with a NaN points at one.
        """
        ids, pos, last, end = [], [], [], 0
        for i, it in enumerate(items):
            seq, s, e, p = it.seq, it.start, it.end, len(it.seq.prompt_ids)
            ids += seq.prompt_ids[s:e] + seq.output_ids[max(s - p, 0) : max(e - p, 0)]
            pos += range(s, e) if positions is None else checked_positions(positions[i], it)
            end += e - s
            if it.samples:
                last.append(end - 1)
        batch = build_batch(self.store, [(it.start, it.end, t) for it, t in zip(items, tables)])
        accel = self.accelerator
        batch.kernel = None if accel is None else accel.plan(batch)
        dev = self.device
        last = torch.tensor(last, dtype=torch.long, device=dev)
        # input_ids and position_ids (1, T)
        kwargs = dict(input_ids=torch.tensor([ids], device=dev), use_cache=False, kvlab_batch=batch)
        kwargs["position_ids"] = torch.tensor([pos], device=dev)
        # e.g. F.linear sent to prepacked GEMMs, unless the accelerator's decoder (which runs under
        # the head seam) packs its own
        linear = contextlib.nullcontext() if accel is None else accel.linear(self.head_seam)
        with paged_step(), linear:
            if self.head_seam:
                # hidden (1, T, H) -> (num_sampling, vocab)
                hidden = self.decoder(**kwargs)[0][0]
                logits = self.lm_head(hidden[last])
            else:
                logits = self.model(**kwargs, logits_to_keep=last).logits[0]
        # a request that asks for prompt log-probabilities: every prompt position's
        # (kvlab.engine.logprobs)
        if self.head_seam and any(it.seq.sampling.prompt_logprobs is not None for it in items):
            record_prompt_logprobs(self, items, hidden)
        top = logits.argmax(-1)
        return logits, top.tolist(), logits.gather(-1, top[:, None])[:, 0].isnan().tolist()

    def compute(
        self,
        items: list[ScheduledSeq],
        tables: list[list[int]],
        positions: list[Any] | None = None,
    ) -> tuple[list[int | None], dict[int, str], set[int]]:
        """One token per scheduled item that samples, without letting one request's failure reach
        the others.

        Returns ``(tokens, errors, untrusted)``: ``tokens[i]`` None where item i got no token (a
        prompt chunk, or an error), ``errors[i]`` why, ``untrusted`` the items whose K/V of this
        step must never be read. When the packed forward raises or gives NaN,
        ``kvlab.engine.recovery.recover`` finds the culprits. ``tables[i]`` and ``positions[i]`` are
        item i's block table and positions (``forward``). The model is switched to the paged
        attention first, once per busy period (``attach``).
        """
        self.attach()
        try:
            packed = self.forward(items, tables, positions)
        # broad on purpose: one request's failure (any error of the model's forward) must not reach
        # the others
        except Exception:  # noqa: BLE001
            packed = None
        if packed is None or any(packed[2]):
            return recover(self, items, tables, positions, packed if len(items) == 1 else None)
        (logits, top, _), tokens, errors, row = packed, [None] * len(items), {}, -1
        for i, it in enumerate(items):
            # a prompt chunk that ends before its sequence samples nothing and has no row
            if it.samples:
                row += 1
                try:
                    tokens[i] = sample(it.seq, logits[row], top[row], self.eos_ids)
                # broad on purpose: its K/V is fine, only its sampling failed; it ends with this
                # error
                except Exception as e:  # noqa: BLE001
                    errors[i] = describe(e)
        return tokens, errors, set()
