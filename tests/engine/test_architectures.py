"""Every causal LM in the installed transformers: token-identical to HF ``generate`` on the engine,
or refused.

Each architecture in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from its default config shrunk
to a tiny random model (2 layers, hidden 64, vocab 96, windows and chunks of 6 tokens so that short
prompts cross them). The engine either refuses it at construction (``NotImplementedError`` naming
the feature) or generates exactly HF's greedy tokens in float32, with prefix caching on and prompts
that share a prefix served from the paged cache. Nothing in between: no architecture may be accepted
and silently wrong.
"""

import random

import pytest
import torch

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.speed import SpeedPaths
from kvlab.engine.speed.fused_llama import fused_layers_available
from kvlab.engine.speed.packed_linear import packed_linear_available
from kvlab.engine.speed.paged_kernel import paged_kernel_available

VOCAB, NEW = 96, 8
# attribute -> tiny value, set wherever the default config has an int there
TINY = {
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "num_blocks": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "embedding_dim": 64,
    "attention_hidden_size": 64,
    "intermediate_size": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "n_inner": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_seq_len": 256,
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "n_mamba_heads": 4,
    "mamba_headdim": 32,
    "mamba_d_ssm": 128, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "sliding_window": 6, "attention_chunk_size": 6,  # short prompts cross windows and chunks
    # gemma: scores of unit-norm q, k not divided by 16 (else attention is uniform)
    "query_pre_attn_scalar": 1,
}
# weights 10x the usual: attention far from uniform, so a dropped window, mask or position changes
# the tokens (at 0.02 every query attends almost uniformly)
SHARP = {"initializer_range": 0.25, "init_std": 0.25}
# None there means "derive it": derive it from the tiny sizes
NONE_TO_TINY = ("head_dim", "num_key_value_heads")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
             "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")
OVERRIDES: dict[str, dict] = {  # what a generic shrink gets wrong, by model type
    "bamba": {"attn_layer_indices": [1]},  # hybrids: keep an attention layer among the two
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64,
                        "attention_window_size": 6},
    "zamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
              "attention_hidden_size": 128, "attention_head_dim": 32},
    "zamba2": {"hybrid_layer_ids": [1], "attention_head_dim": 32, "attention_hidden_size": 128},
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1]},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    # its defaults do not build in 5.24
    "dbrx": {"rope_theta": 1e4, "clip_qkv": 8.0, "kv_n_heads": 2},
    "gpt_bigcode": {"num_key_value_heads": 1},  # multi_query: the count follows from it
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "dory": {"sliding_window": 64},  # transformers' own sdpa path fails on it with a window of 6
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 8, "indexer_compress_ratio": 2},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": (16, 16),
                 "attention_head_size": 16, "attn_layers": ["local", "local"]},
    "xlstm": {"qk_dim_factor": 1.0},
    "mamba2": {"head_dim": 32, "n_groups": 1},
}
OVERRIDES["qwen4_exp"] = OVERRIDES["qwen4_exp_text"]
# model type -> why it cannot be built tiny and run alone on a token stream here
SKIP: dict[str, str] = {
    "blt": "transformers' own generate raises on it (its cache reads config.num_hidden_layers, "
           "which BltConfig lacks)",
    "gemma3n": "building it needs the timm package (its vision tower), which kvlab does not "
               "install; gemma3n_text, its language model, is covered",
    "gemma4_assistant": "a draft head that reads its target model's K/V in every layer: it cannot "
                        "run alone (its default config does not validate)",
    "gemma4_unified_assistant": "a draft head that reads its target model's K/V in every layer: it "
                                "cannot run alone (its default config does not validate)",
    "musicgen": "its input is one stream of audio codes per codebook, (batch * codebooks, T): not "
                "a token LM",
    "musicgen_melody": "its input is one stream of audio codes per codebook, (batch * codebooks, "
                       "T): not a token LM",
    "prophetnet": "transformers' own generate raises on it (its n-gram decoder's position_ids "
                  "check)",
}
# refusing one: a regression
MUST_RUN = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma3_text", "phi3",
            "gpt2", "gpt_neox", "olmo2", "starcoder2", "granite", "smollm3", "cohere2",
            "gpt_bigcode", "opt"]


def _architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(cfg, overrides: dict) -> None:
    """Shrink ``cfg`` and its sub-configs in place: tiny sizes, no special ids, per-layer lists cut
    to size."""
    if vars(cfg).get("_heterogeneity_spec") is not None and "per_layer_config" not in overrides:
        # per-layer sizes (gemma4, dots3): the tiny model has the global ones
        cfg.per_layer_config = {}
    layers = getattr(cfg, "num_hidden_layers", None)
    for name in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, name, None)
        if hasattr(sub, "to_dict"):
            _shrink(sub, overrides)
    for key, value in {**TINY, **overrides}.items():
        old = getattr(cfg, key, None)
        if key in overrides or (isinstance(old, int) and not isinstance(old, bool)) or (
                old is None and key in NONE_TO_TINY and hasattr(cfg, key)):
            try:
                setattr(cfg, key, value)
            except (
                AttributeError,
                TypeError,
                ValueError,
                NotImplementedError,
            ):  # a derived or fixed property
                pass
    for key, value in SHARP.items():
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, value)
    # a tied random head echoes the last input token
    if getattr(cfg, "tie_word_embeddings", None) is True:
        cfg.tie_word_embeddings = False
    for i, key in enumerate(TOKEN_IDS):
        if getattr(cfg, key, None) is not None:
            try:
                setattr(cfg, key, None if key in ("bos_token_id", "eos_token_id") else i)
            except Exception:  # a config that requires the id
                setattr(cfg, key, i)
    # multi-head latent attention
    if getattr(cfg, "kv_lora_rank", None) and "head_dim" not in overrides:
        cfg.head_dim = cfg.qk_rope_head_dim  # what its RoPE rotates
        cfg.num_key_value_heads = cfg.num_attention_heads
        if hasattr(cfg, "qk_head_dim"):
            cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    n = getattr(cfg, "num_hidden_layers", None)
    for key, value in (list(vars(cfg).items()) if isinstance(n, int) else ()):
        # one entry per layer
        if isinstance(value, list) and len(value) == layers and key not in overrides:
            # every kind of layer the model has, repeated to n layers
            kinds = list(dict.fromkeys(value))
            try:
                setattr(cfg, key, (kinds * n)[:n] if len(kinds) <= n else kinds)
            except (AttributeError, TypeError, ValueError):
                pass
    if isinstance(getattr(cfg, "layer_types", None), list) and isinstance(n, int):
        try:
            cfg.num_hidden_layers = len(cfg.layer_types)
        except (AttributeError, TypeError, ValueError):
            pass


def tiny_model(model_type: str):
    """A tiny random float32 causal LM of ``model_type`` from its default config."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    cfg = cls.config_class()  # the config the causal LM class takes (musicgen: its decoder's)
    _shrink(cfg, OVERRIDES.get(model_type, {}))
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    if getattr(cfg, "languages", None):  # X-MOD: one adapter per language
        model.set_default_language(cfg.languages[0])
    model.generation_config = transformers.GenerationConfig(
        max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return model


def _prompts() -> list[list[int]]:
    """A prompt, then four that share its first 12 tokens (three whole blocks of 4) and two that
    share nothing."""
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]  # longer than the windows and chunks of 6
    return ([shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 1, 9, 5, 13)]
            + [[5], [rng.randrange(3, VOCAB) for _ in range(10)]])


@pytest.mark.parametrize("model_type", _architectures())
@torch.no_grad()
def test_architecture_is_token_identical_to_hf_or_refused(model_type):
    if model_type in SKIP:
        pytest.skip(SKIP[model_type])
    model = tiny_model(model_type)
    try:
        engine = Engine(
            model, None, num_blocks=64, block_size=4, enable_prefix_caching=True, max_num_seqs=4
        )
    except NotImplementedError as e:
        assert model_type not in MUST_RUN, f"{model_type} refused: {e}"
        names = {model.config.model_type, model.config.get_text_config().model_type}
        assert "cannot run" in str(e) and any(repr(n) in str(e) for n in names), e
        return
    prompts = _prompts()
    want = [
        model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            generation_config=model.generation_config,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    sp = SamplingParams(max_tokens=NEW)
    # the rest reuse the first's blocks
    outs = engine.generate(prompts[:1], sp) + engine.generate(prompts[1:], sp)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12, 12, 12, 0, 0], (
        "the shared prefix missed the cache"
    )
    assert [o.output_ids for o in outs] == want, (
        f"{model_type} accepted but not token-identical to HF generate"
    )
    # oneDNN's prepacked linear layers (EngineConfig.packed_linear): other float32 rounding, the
    # same tokens
    if packed_linear_available(torch.device("cpu"), torch.float32) is None:
        engine = Engine(
            model,
            None,
            num_blocks=64,
            block_size=4,
            max_num_seqs=4,
            accelerator=SpeedPaths(packed_linear=True),
        )
        outs = engine.generate(prompts[:1], sp) + engine.generate(prompts[1:], sp)
        assert [o.output_ids for o in outs] == want, (
            f"{model_type}: packed_linear changed the tokens"
        )
        assert [o.num_cached_tokens for o in outs] == [0, 12, 12, 12, 12, 0, 0]
        # the model is the caller's own again: its layers run F.linear once the engine is idle
        assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)
    # the C++ paged-attention kernel for decodes (EngineConfig.paged_kernel): other float32
    # rounding, the same tokens on every architecture (30.2 s -> 34.0 s for this file in one
    # process, measured)
    if paged_kernel_available(torch.device("cpu"), torch.float32) is None:
        engine = Engine(
            model,
            None,
            num_blocks=64,
            block_size=4,
            max_num_seqs=4,
            accelerator=SpeedPaths(paged_kernel=True),
        )
        outs = engine.generate(prompts[:1], sp) + engine.generate(prompts[1:], sp)
        assert [o.output_ids for o in outs] == want, (
            f"{model_type}: paged_kernel changed the tokens"
        )
    # a Llama run with fused prepacked GEMMs (EngineConfig.fused_layers): transformers'
    # LlamaForCausalLM only
    if fused_layers_available(model) is None:
        engine = Engine(
            model,
            None,
            num_blocks=64,
            block_size=4,
            max_num_seqs=4,
            accelerator=SpeedPaths(fused_layers=True),
        )
        outs = engine.generate(prompts[:1], sp) + engine.generate(prompts[1:], sp)
        assert [o.output_ids for o in outs] == want, (
            f"{model_type}: fused_layers changed the tokens"
        )
