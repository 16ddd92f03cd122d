"""Every causal LM in the installed transformers: token-identical to HF ``generate`` on the engine, or refused.

Each architecture in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built from its default config shrunk to a
tiny random model (2 layers, hidden 64, vocab 96, windows and chunks of 6 tokens so that short prompts
cross them). The engine either refuses it at construction (``NotImplementedError`` naming the feature) or
generates exactly HF's greedy tokens in float32, with prefix caching on and prompts that share a prefix
served from the paged cache. Nothing in between: no architecture may be accepted and silently wrong.
"""

import random

import pytest
import torch

from kvlab.engine import Engine, SamplingParams

VOCAB, NEW = 96, 4
TINY = {  # attribute -> tiny value, set wherever the default config has an int there
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "n_inner": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_seq_len": 256,
    "vocab_size": VOCAB, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "rotary_dim": 8, "sliding_window": 6, "attention_chunk_size": 6,
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "unk_token_id")
OVERRIDES: dict[str, dict] = {  # settings a generic shrink misses
}
SKIP: dict[str, str] = {  # model type -> why no tiny random model of it can be built here
}
MUST_RUN = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma3_text", "phi3", "gpt2", "gpt_neox",
            "olmo2", "starcoder2", "granite", "smollm3", "cohere2"]  # refusing these would be a regression


def _architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(cfg, overrides: dict) -> None:
    """Shrink ``cfg`` (and its sub-configs) in place: tiny sizes, no special token ids, layer types cut to size."""
    for name in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, name, None)
        if hasattr(sub, "to_dict"):
            _shrink(sub, overrides)
    for key, value in {**TINY, **overrides}.items():
        old = getattr(cfg, key, None)
        if key in overrides or (isinstance(old, int) and not isinstance(old, bool)):
            try:
                setattr(cfg, key, value)
            except (AttributeError, TypeError, ValueError):  # a derived property
                pass
    for i, key in enumerate(TOKEN_IDS):
        if getattr(cfg, key, None) is not None:
            try:
                setattr(cfg, key, None if key in ("bos_token_id", "eos_token_id") else i)
            except Exception:  # a config that requires the id
                setattr(cfg, key, i)
    types, n = getattr(cfg, "layer_types", None), getattr(cfg, "num_hidden_layers", None)
    if isinstance(types, list) and isinstance(n, int) and "layer_types" not in overrides:
        kinds = list(dict.fromkeys(types))  # every kind of layer the model has, repeated to n layers
        try:
            cfg.layer_types = (kinds * n)[:n] if len(kinds) <= n else kinds
            cfg.num_hidden_layers = len(cfg.layer_types)
        except (AttributeError, TypeError, ValueError):
            pass


def tiny_model(model_type: str):
    """A tiny random float32 causal LM of ``model_type`` from its default config."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.for_model(model_type)
    _shrink(cfg, OVERRIDES.get(model_type, {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]  # three whole blocks of 4, longer than the windows
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 1, 9)] + [[5]]


@pytest.mark.parametrize("model_type", _architectures())
@torch.no_grad()
def test_architecture_is_token_identical_to_hf_or_refused(model_type):
    if model_type in SKIP:
        pytest.skip(SKIP[model_type])
    model = tiny_model(model_type)
    prompts = _prompts()
    want = [model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           generation_config=model.generation_config)[0, len(p):].tolist() for p in prompts]
    try:
        engine = Engine(model, None, num_blocks=64, block_size=4, enable_prefix_caching=True, max_num_seqs=4)
    except NotImplementedError as e:
        assert model_type not in MUST_RUN, f"{model_type} refused: {e}"
        assert "cannot run" in str(e) and model.config.get_text_config().model_type in str(e)
        return
    sp = SamplingParams(max_tokens=NEW)
    outs = engine.generate(prompts[:1], sp) + engine.generate(prompts[1:], sp)  # the rest reuse the first's blocks
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12, 0], "the shared prefix was not served from the cache"
    assert [o.output_ids for o in outs] == want, f"{model_type} accepted but not token-identical to HF generate"
