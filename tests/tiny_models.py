"""Small random models that several test files share (not a test module: imported by them)."""


def tiny_qwen2(seed: int = 0):
    """A random-initialised 2-layer Qwen2 (vocabulary 256, 512 positions), float32, no eos: every
    K/V it reads moves its argmax (the trained bundled model often answers the same from wrong
    K/V). Tests take token ids only."""
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model
