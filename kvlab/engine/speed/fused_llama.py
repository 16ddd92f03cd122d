"""A Llama decoder run layer by layer with fused GEMMs: an opt-in speed path
(``SpeedPaths.fused_layers``).

transformers' ``LlamaModel.forward`` makes seven ``F.linear`` calls per layer and a few dozen ATen
and Python calls around them. A decode step is bound by reading the weights: on this project's
2-core machine oneDNN's prepacked GEMM read them faster when q/k/v were one matrix and gate/up
another (one call each, the same bytes), and the calls around the GEMMs cost milliseconds a step
(A/B: ``scripts/profile_step.py`` with and without ``--fused-layers``). So this path runs the
model's own embedding and rotary embedding, kvlab's paged attention, four prepacked GEMMs per layer
(``[q; k; v]``, ``o``, ``[gate; up]``, ``down``) and, between them, one-pass C++ ops (``fused_ops``,
``csrc/fused_ops.cpp``) for RMSNorm with the residual sum before it, RoPE on q's and k's heads (HF's
formula, bit for bit) and SwiGLU, each with the module's own weight and epsilon. The MLP runs
``MLP_ROWS`` rows at a time. The model is not changed: the fused weights are packed copies beside
it, packed at construction and again when a weight or bias changed in place or was replaced.

An allow-list: exactly transformers' ``LlamaForCausalLM`` with its own layer classes and SiLU, no
forward hooks on any module, a CPU float32 model with oneDNN, and the C++ ops built. Anything else
is refused at construction with the reason. A forward hook registered later (on a module, or
globally) is seen at the next step: that step runs transformers' own layers, so the hook runs. The
float32 sums of a fused GEMM, of RMSNorm's squares, and SwiGLU's ``e^x`` round differently from
transformers' calls; the tests check hidden states to float32 rounding and that greedy tokens still
equal HF ``generate``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as nn_module

from ..paged_attention import paged_attention_forward
from . import fused_ops
from .cpp_build import build_failure
from .packed_linear import PackedWeight, pack, packed_gemm, packed_linear_available

__all__ = ["MLP_ROWS", "FusedLlama", "fused_layers_available"]

# rows the MLP runs at a time: its (rows, 2 x intermediate) GEMM output, SwiGLU's input, then stays
# in the CPU's caches. A 16 x 544-token prefill of SmolLM2's MLP shapes, median ms a layer (whole ->
# 1,024-row chunks): 266 -> 228 at 2 threads, 501 -> 436 at 1; chunks of 256 to 2,048 rows were
# within 4% of each other
MLP_ROWS = 1024


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
    from transformers.activations import ACT2FN

    causal, base, layer_cls, attn_cls, mlp_cls, norm_cls = _llama_classes()
    if type(model) is not causal or type(model.model) is not base:
        return f"it runs transformers' LlamaForCausalLM only (this is {type(model).__name__})"
    for i, layer in enumerate(model.model.layers):
        parts = ((layer, layer_cls), (layer.self_attn, attn_cls), (layer.mlp, mlp_cls),
                 (layer.input_layernorm, norm_cls), (layer.post_attention_layernorm, norm_cls))
        if any(type(m) is not cls for m, cls in parts):
            return f"layer {i} is not transformers' own Llama layer"
    if type(model.model.norm) is not norm_cls:
        return "its final norm is not transformers' LlamaRMSNorm"
    # the residual sums update the embedding's output in place: it must be a new tensor, as
    # nn.Embedding's is
    if type(model.model.embed_tokens) is not torch.nn.Embedding:
        return f"its embedding is a {type(model.model.embed_tokens).__name__}, not an nn.Embedding"
    silu = type(ACT2FN["silu"])
    for i, layer in enumerate(model.model.layers):
        if type(layer.mlp.act_fn) is not silu:
            return (
                f"its MLP runs SiLU only (layer {i}'s activation is "
                f"{type(layer.mlp.act_fn).__name__})"
            )
    failed = build_failure(fused_ops.load)
    if failed is not None:
        return f"no build of its C++ ops ({failed})"
    hooked = _hooked(list(model.named_modules()))
    return (
        None
        if hooked is None
        else f"forward hooks are registered on {hooked}, and this path would skip them"
    )


def _hooked(named: list[tuple[str, torch.nn.Module]]) -> str | None:
    """The first of ``named`` (name, module) with a forward hook ("every module": a global one), or
    None."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "every module (globally)"
    return next(
        (name or "the model" for name, m in named if m._forward_hooks or m._forward_pre_hooks), None
    )


class FusedLlama:
    """The decoder of a ``LlamaForCausalLM``, called as the runner calls ``model.base_model``."""

    # the runner need not send this decoder's F.linear calls to the packed GEMM (it makes none)
    packs_own_gemms = True

    def __init__(self, model: Any) -> None:
        why = fused_layers_available(model)
        if why is not None:
            raise ValueError(f"fused_layers: {why}")
        self.ops = fused_ops.load()
        self.decoder = model.model
        self.layers = list(self.decoder.layers[: model.config.num_hidden_layers])
        self.named_modules = list(model.named_modules())
        # each layer's GEMMs: part -> the linear layers stacked into it
        self.parts = [
            {
                "qkv": [a.q_proj, a.k_proj, a.v_proj],
                "o": [a.o_proj],
                "gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj],
                "down": [layer.mlp.down_proj],
            }
            for layer in self.layers
            for a in [layer.self_attn]
        ]
        self.linears = [m for parts in self.parts for mods in parts.values() for m in mods]
        # per layer, looked up once (a module attribute lookup is ~1 us, ~20 a layer): its
        # attention, the widths of q and k, the head dimension, its post-attention norm and the norm
        # after its MLP (the next layer's input norm; after the last, the final norm)
        after = [layer.input_layernorm for layer in self.layers[1:]] + [self.decoder.norm]
        self.plan = [
            (
                layer.self_attn,
                layer.self_attn.q_proj.out_features,
                layer.self_attn.k_proj.out_features,
                layer.self_attn.head_dim,
                layer.post_attention_layernorm,
                nxt,
            )
            for layer, nxt in zip(self.layers, after)
        ]
        # the (data_ptr, _version) of every weight and bias when packed (read through the modules,
        # so a parameter replaced or added since shows too)
        self.state: list[tuple[int, int]] = []
        # (layer, part) -> (packed weight, bias): all packed here, as a server packs at load (not in
        # its first step), and again at the first step after a weight or bias changed in place or
        # was replaced
        self._packed: dict[tuple[int, str], tuple[PackedWeight, torch.Tensor | None]] = {}
        self._pack_all()

    def _pack_all(self) -> None:
        """Pack every layer's stacked weights (and stack their biases) as they are now."""
        self.state = self._state()
        for i, parts in enumerate(self.parts):
            for part, mods in parts.items():
                w = (
                    torch.cat([m.weight.detach() for m in mods])
                    if len(mods) > 1
                    else mods[0].weight.detach()
                )
                biases = [m.bias for m in mods]
                bias = (
                    None
                    if all(b is None for b in biases)
                    else torch.cat(
                        [
                            b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                            for b, m in zip(biases, mods)
                        ]
                    )
                )
                self._packed[(i, part)] = pack(w), bias

    def _state(self) -> list[tuple[int, int]]:
        # through _parameters, not the modules' attribute lookup: a fifth of the time (~60 us a
        # step)
        return [(t.data_ptr(), t._version) for m in self.linears
                for t in (m._parameters["weight"], m._parameters.get("bias")) if t is not None]

    def _gemm(self, i: int, part: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` times layer ``i``'s stacked weights of ``part`` plus their biases (one prepacked
        GEMM)."""
        return packed_gemm(x, *self._packed[(i, part)])

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kvlab_batch: Any,
                 use_cache: bool = False) -> tuple[torch.Tensor]:
        """``(hidden,)``: the final-norm hidden states ``(1, T, hidden)`` of the packed step."""
        dec, ops = self.decoder, self.ops
        # a hook registered since construction: transformers' own layers run it (this loop would
        # skip it)
        if _hooked(self.named_modules) is not None:
            return (dec(input_ids=input_ids, position_ids=position_ids, kvlab_batch=kvlab_batch,
                        use_cache=use_cache)[0],)
        # a weight or bias changed in place, replaced or added since it was packed: pack them all
        # again
        if self._state() != self.state:
            self._pack_all()
        # (1, T, hidden): a new tensor, so the residual sums below update it in place
        x = dec.embed_tokens(input_ids)
        t = x.shape[1]
        cos, sin = dec.rotary_emb(x, position_ids=position_ids)
        # (T, D) each; x (T, hidden) and the normed h
        cos, sin, x = cos[0].contiguous(), sin[0].contiguous(), x.view(t, -1)
        norm = self.layers[0].input_layernorm
        h = ops.rms_norm(x, norm.weight, norm.variance_epsilon)
        for i, (attn, nq, nk, d, post, after) in enumerate(self.plan):
            qkv = self._gemm(i, "qkv", h)
            # RoPE in place on q's and k's heads: every value what apply_rotary_pos_emb gives
            # (fused_ops)
            ops.rope(qkv, cos, sin, (nq + nk) // d, d)
            # (1, heads or kv_heads, T, D) views of qkv
            q, k, v = (qkv[:, a:b].view(1, t, -1, d).transpose(1, 2) for a, b in
                       ((0, nq), (nq, nq + nk), (nq + nk, qkv.shape[1])))
            o, _ = paged_attention_forward(
                attn, q, k, v, None, scaling=attn.scaling, kvlab_batch=kvlab_batch
            )
            # x += o_proj(o); h = the post-attention norm of x
            h = ops.add_rms_norm(x, self._gemm(i, "o", o.reshape(t, -1).contiguous()), post.weight,
                                 post.variance_epsilon)
            # x += down(silu(gate) * up); h = the next layer's input norm of x (after the last: the
            # final norm)
            h = self._mlp(i, x, h, after)
        return (h.view(1, t, -1),)

    def _mlp(self, i: int, x: torch.Tensor, h: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """``x += down(silu(gate) * up)`` of layer ``i`` on ``h`` (T, hidden), ``MLP_ROWS`` rows at
        a time; returns ``norm(x)``."""
        ops, outs = self.ops, []
        for a in range(0, x.shape[0], MLP_ROWS):
            rows = slice(a, a + MLP_ROWS)
            down = self._gemm(i, "down", ops.silu_mul(self._gemm(i, "gate_up", h[rows])))
            outs.append(ops.add_rms_norm(x[rows], down, norm.weight, norm.variance_epsilon))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
