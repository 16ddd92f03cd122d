"""A Llama decoder run layer by layer with fused GEMMs: an opt-in speed path (``EngineConfig.fused_layers``).

transformers' ``LlamaModel.forward`` makes seven ``F.linear`` calls per layer and a few dozen Python calls
around them. A decode step is bound by reading the weights: on this project's 2-core machine oneDNN's
prepacked GEMM read them faster when q/k/v were one matrix and gate/up another (one call each, the same
bytes), and the Python around the layers cost a few milliseconds a step (A/B: ``scripts/profile_step.py``
with and without ``--fused-layers``). So this path runs the model's own modules where they are cheap (the
embedding, RMSNorm, the rotary embedding, the activation, the final norm), HF's RoPE formula (its
``rotate_half``) on q's and k's heads at once, kvlab's paged attention, and four prepacked GEMMs per
layer: ``[q; k; v]``, ``o``, ``[gate; up]``, ``down``. The model is not changed: the fused weights are
packed copies beside it, packed again when a weight or bias changed in place.

An allow-list: exactly transformers' ``LlamaForCausalLM`` with its own layer classes, no forward hooks on
any module, a CPU float32 model with oneDNN. Anything else is refused at construction with the reason. A
forward hook registered later (on a module, or globally) is seen at the next step: that step runs
transformers' own layers, so the hook runs.
The float32 sums of a fused GEMM may round differently from three separate ones; the tests check that
greedy tokens still equal HF ``generate``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as nn_module

from .packed_linear import packed_linear_available
from .paged_attention import paged_attention_forward

__all__ = ["FusedLlama", "fused_layers_available"]


def _llama_classes() -> tuple[type, ...]:
    from transformers.models.llama import modeling_llama as m

    return (m.LlamaForCausalLM, m.LlamaModel, m.LlamaDecoderLayer, m.LlamaAttention, m.LlamaMLP,
            m.LlamaRMSNorm)


def fused_layers_available(model: Any) -> str | None:
    """None when ``FusedLlama`` can run ``model``, else why not (a sentence)."""
    p = next(model.parameters())
    why = packed_linear_available(p.device, p.dtype)
    if why is not None:
        return why
    causal, base, layer_cls, attn_cls, mlp_cls, norm_cls = _llama_classes()
    if type(model) is not causal or type(model.model) is not base:
        return f"it runs transformers' LlamaForCausalLM only (this is {type(model).__name__})"
    for i, layer in enumerate(model.model.layers):
        parts = ((layer, layer_cls), (layer.self_attn, attn_cls), (layer.mlp, mlp_cls),
                 (layer.input_layernorm, norm_cls), (layer.post_attention_layernorm, norm_cls))
        if any(type(m) is not cls for m, cls in parts):
            return f"layer {i} is not transformers' own Llama layer"
    hooked = _hooked(list(model.named_modules()))
    return None if hooked is None else f"forward hooks are registered on {hooked}, and this path would skip them"


def _hooked(named: list[tuple[str, torch.nn.Module]]) -> str | None:
    """The first of ``named`` (name, module) with a forward hook ("every module": a global one), or None."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "every module (globally)"
    return next((name or "the model" for name, m in named if m._forward_hooks or m._forward_pre_hooks), None)


class FusedLlama:
    """The decoder of a ``LlamaForCausalLM``, called as the runner calls ``model.base_model``."""

    # the runner need not send this decoder's F.linear calls to the packed GEMM (it makes none)
    packs_own_gemms = True

    def __init__(self, model: Any) -> None:
        why = fused_layers_available(model)
        if why is not None:
            raise ValueError(f"fused_layers: {why}")
        self.decoder = model.model
        self.layers = list(self.decoder.layers[: model.config.num_hidden_layers])
        self.named_modules = list(model.named_modules())
        # (layer, part) -> (the weights' and biases' (data_ptr, _version), packed weight, bias)
        self._packed: dict[tuple[int, str], tuple[tuple, torch.Tensor, torch.Tensor | None]] = {}

    def _gemm(self, i: int, part: str, mods: list[torch.nn.Linear], x: torch.Tensor) -> torch.Tensor:
        """``x`` times the stacked weights of ``mods`` plus their biases (one prepacked GEMM), packed again if
        a weight or bias changed in place."""
        key = tuple((t.data_ptr(), t._version) for m in mods for t in (m.weight, m.bias) if t is not None)
        got = self._packed.get((i, part))
        if got is None or got[0] != key:
            w = torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()
            biases = [m.bias for m in mods]
            bias = None if all(b is None for b in biases) else torch.cat([
                b.detach() if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(biases, mods)
            ])
            got = key, torch.ops.mkldnn._reorder_linear_weight(w, None), bias
            self._packed[(i, part)] = got
        return torch.ops.mkldnn._linear_pointwise(x, got[1], got[2], "none", [], "")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kvlab_batch: Any,
                 use_cache: bool = False) -> tuple[torch.Tensor]:
        """``(hidden,)``: the final-norm hidden states ``(1, T, hidden)`` of the packed step."""
        from transformers.models.llama.modeling_llama import rotate_half

        dec = self.decoder
        # a hook registered since construction: transformers' own layers run it (this loop would skip it)
        if _hooked(self.named_modules) is not None:
            return (dec(input_ids=input_ids, position_ids=position_ids, kvlab_batch=kvlab_batch,
                        use_cache=use_cache)[0],)
        # (1, T, hidden)
        x = dec.embed_tokens(input_ids)
        t = x.shape[1]
        cos, sin = dec.rotary_emb(x, position_ids=position_ids)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = self._gemm(i, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj], layer.input_layernorm(x))
            nq, nk = attn.q_proj.out_features, attn.k_proj.out_features
            # RoPE on q's and k's heads at once, (1, T, heads + kv_heads, D): HF's elementwise formula, so
            # every element is what apply_rotary_pos_emb gives it, in half the calls
            qk = qkv[..., : nq + nk].view(1, t, -1, attn.head_dim)
            qk = qk * cos[:, :, None] + rotate_half(qk) * sin[:, :, None]
            # (1, heads or kv_heads, T, D) each
            q, k = qk[:, :, : nq // attn.head_dim].transpose(1, 2), qk[:, :, nq // attn.head_dim :].transpose(1, 2)
            v = qkv[..., nq + nk :].view(1, t, -1, attn.head_dim).transpose(1, 2)
            o, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling, kvlab_batch=kvlab_batch)
            x = x + self._gemm(i, "o", [attn.o_proj], o.reshape(1, t, -1).contiguous())
            gate, up = self._gemm(i, "gate_up", [mlp.gate_proj, mlp.up_proj], layer.post_attention_layernorm(x)
                                  ).chunk(2, -1)
            x = x + self._gemm(i, "down", [mlp.down_proj], mlp.act_fn(gate) * up)
        return (dec.norm(x),)
