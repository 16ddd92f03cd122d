"""What the engine accepts: the allow-list.

kvlab serves a model only where it is sure its paged attention computes exactly what the model's own
attention does; anything else is refused by name with ``NotImplementedError`` (docs/engine.md). This
file is the allow-list checked once, when a ``ModelRunner`` is built (``admit``):

- the model's config has an int ``vocab_size`` (a multimodal wrapper does not: load its language
  model);
- transformers can switch its attention (``AttentionInterface``), and one probe token (token 0 at
  position 0) runs the paged attention once per layer, with the ``kvlab_batch`` keyword passed down;
- its forward takes ``position_ids`` (a packed step gives each token its place in its sequence);
- its config asks nothing beyond causal SDPA with a scale and an optional window (``check_config``).

The per-call half of the allow-list (``IMPLEMENTED_KWARGS``, ``METADATA_KWARGS``) lives beside the
attention it guards: ``paged_attention.check_call`` runs at every call of a step; this file runs
once, at construction (the runner hands ``admit`` the ``paged_attention`` module to probe with).
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import torch

from .paged_attention import IMPLEMENTED_KWARGS, METADATA_KWARGS, refuse_feature

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "IMPLEMENTED_KWARGS",
    "METADATA_KWARGS",
    "admit",
    "check_config",
]

# the config.layer_types it implements
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def check_config(config: Any, windows_run: dict[int, int | None]) -> None:
    """Raise ``NotImplementedError`` naming a config feature beyond causal (+window) SDPA (windows:
    a probe's)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    if types is not None and set(types) - ATTENTION_LAYER_TYPES:
        refuse_feature(
            f"layers of type {sorted(set(types) - ATTENTION_LAYER_TYPES)} (only "
            f"{sorted(ATTENTION_LAYER_TYPES)})"
        )
    if getattr(cfg, "attention_chunk_size", None) is not None:
        refuse_feature(f"chunked attention (attention_chunk_size={cfg.attention_chunk_size})")
    if getattr(cfg, "use_bidirectional_attention", None):
        refuse_feature(
            "bidirectional attention "
            f"(use_bidirectional_attention={cfg.use_bidirectional_attention!r})"
        )
    # the window the config asks of each layer (None: full causal)
    window = getattr(cfg, "sliding_window", None)
    if types is not None:
        want = [window if t == "sliding_attention" else None for t in types]
    else:
        want = [None if getattr(cfg, "use_sliding_window", True) is False else window] * len(
            windows_run
        )
    # a window the model applies only in its own mask would be lost
    for layer, got in sorted(windows_run.items()):
        if layer < len(want) and want[layer] != got:
            raise NotImplementedError(
                f"layer {layer}'s sliding window is {want[layer]} in the config but its "
                "attention call was given "
                f"{got}: the model applies the window in its own mask, which kvlab's paged "
                "attention does not build"
            )


def admit(runner: Any, pa: ModuleType) -> bool:
    """Switch ``runner``'s model to the paged attention and probe it; refuse a model it does not
    fully serve.

    ``runner`` is the ``ModelRunner`` being built, ``pa`` the ``kvlab.engine.paged_attention``
    module. Sets ``runner.own_attention`` and ``runner.attention`` (``pa.register``) and returns
    whether the head seam holds (``_probe``). A refused model gets its own attention back.
    """
    model = runner.model
    name = getattr(model.config, "model_type", None) or type(model).__name__

    def refuse(why: str) -> None:
        raise NotImplementedError(f"kvlab's paged attention cannot run {name!r}: {why}")

    if not isinstance(getattr(model.config, "vocab_size", None), int):
        refuse(
            "its config has no int vocab_size (a multimodal wrapper? load its language model alone)"
        )
    # once; switched by attach() / detach()
    runner.own_attention, runner.attention = pa.register(model)
    try:
        if not runner.attach():
            refuse(
                "its attention does not go through transformers' AttentionInterface (transformers "
                "cannot switch it), so the paged attention would never run and its K/V never reach "
                "the paged store"
            )
        return _probe(runner, pa, refuse)
    except BaseException:
        # also the sub-configs a refused switch changed
        model.set_attn_implementation(runner.own_attention)
        raise


@torch.no_grad()
def _probe(runner: Any, pa: ModuleType, refuse: Any) -> bool:
    """Run token 0 at position 0 through the model; check what it ran; return whether the head seam
    holds."""
    model, store = runner.model, runner.store
    zero = torch.zeros((1, 1), dtype=torch.long, device=runner.device)
    run = dict(input_ids=zero, position_ids=zero, use_cache=False)
    batch = pa.build_batch(store, [(0, 1, [0])])
    try:
        with pa.paged_step():
            want = model(**run, kvlab_batch=batch, logits_to_keep=zero[0]).logits[0]
    except pa.MissingBatchError:
        refuse(
            "its layers do not pass the forward keyword kvlab_batch down to the attention function"
        )
    except NotImplementedError as e:
        refuse(str(e))
    except torch.OutOfMemoryError:
        # a full device says nothing about the model: not a refusal
        raise
    # broad on purpose: whatever the model's own forward raises under the paged attention (a shape
    # it does not expect, a keyword it rejects, ...) means kvlab cannot serve it, said by name
    # (NotImplementedError)
    except Exception as e:  # noqa: BLE001
        refuse(f"its forward failed under the paged attention ({type(e).__name__}: {e})")
    finally:
        store.clear_blocks([0])
    layers = list(range(store.num_layers))
    if sorted(batch.layers_run) != layers:
        refuse(
            f"it never ran for layers {sorted(set(layers) - set(batch.layers_run))} of "
            f"{len(layers)} "
            f"(calls: {batch.layers_run}); the model's attention does not go through transformers' "
            "AttentionInterface (e.g. ALiBi or custom attention code), so its K/V would never "
            "reach the "
            "paged store and the outputs would be wrong"
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        refuse(
            "its forward takes no position_ids, so the tokens of a packed step would get "
            "positions from "
            "their place in the step instead of their place in the sequence"
        )
    try:
        check_config(model.config, dict(zip(batch.layers_run, batch.windows_run)))
    except NotImplementedError as e:
        refuse(str(e))
    # the head seam: the decoder's last hidden state through lm_head() gives exactly the model's
    # logits?
    try:
        with pa.paged_step():
            again = pa.build_batch(store, [(0, 1, [0])])
            # the last hidden state (1, hidden) -> (1, vocab)
            got = runner.lm_head(runner.decoder(**run, kvlab_batch=again)[0][0]).float()
        return runner.decoder is not model and torch.equal(got, want.float())
    except torch.OutOfMemoryError:
        # a RuntimeError, but no answer about the seam
        raise
    # The decoder's output does not go through the head as the model's own forward does: no seam,
    # every step runs the model's whole forward (its output is no tensor of hidden states, or the
    # head does not take it: torch's shape and dtype errors are RuntimeErrors, e.g. mllama's decoder
    # output vs its head). Anything else (an AssertionError, a NameError in kvlab) is a bug and
    # propagates instead of quietly costing speed.
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError):
        return False
    finally:
        store.clear_blocks([0])
