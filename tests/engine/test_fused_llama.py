"""EngineConfig.fused_layers: a Llama decoder run with four fused prepacked GEMMs a layer
(kvlab.engine.speed.fused_llama).

Greedy tokens under it are HF's (here on a tiny Llama with biases, in test_architectures.py on the
default Llama, in test_smollm2.py on SmolLM2 with every server speed path on); the hidden states
match HF's decoder to float32 rounding; a weight changed in place is packed again; anything but
transformers' own Llama with SiLU, a model with forward hooks, or another dtype is refused at
construction, naming why. Its C++ ops against transformers' own: tests/engine/test_fused_ops.py."""

import copy

import pytest
import torch
import transformers

from kvlab.engine import Engine, SamplingParams
from kvlab.engine.speed import SpeedPaths, fused_llama
from kvlab.engine.speed.fused_llama import FusedLlama, fused_layers_available
from kvlab.engine.speed.packed_linear import packed_linear_available

pytestmark = pytest.mark.skipif(
    packed_linear_available(torch.device("cpu"), torch.float32) is not None,
    reason="this torch build has no oneDNN",
)

NEW = 8


@pytest.fixture(scope="module")
def llama():
    """A tiny random Llama with biases on every projection (the fused GEMMs stack them too) and
    GQA."""
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    for name, p in model.named_parameters():  # biases start at zero: make them count
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)
    model.generation_config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False,
                                                            eos_token_id=None, pad_token_id=0)
    return model


def _prompts():
    shared = list(range(3, 23))
    return [shared + [40, 41, 42], shared + [50], [7, 8, 9, 10, 11], shared + list(range(100, 130))]


def _hf(model, prompts):
    return [
        model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            generation_config=model.generation_config,
        )[0, len(p) :].tolist()
        for p in prompts
    ]


def test_fused_engine_gives_hf_greedy_tokens_and_shares_the_prefix(llama):
    prompts = _prompts()
    want = _hf(llama, prompts)
    engine = Engine(
        llama,
        None,
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        accelerator=SpeedPaths(fused_layers=True),
    )
    assert isinstance(engine.runner.decoder, FusedLlama)
    outs = engine.generate(prompts[:1], SamplingParams(max_tokens=NEW))
    outs += engine.generate(prompts[1:], SamplingParams(max_tokens=NEW))
    assert [o.output_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 20, 0, 20]
    # nothing of the model was replaced, and it runs its own layers outside the engine
    assert not any("forward" in vars(m) for m in llama.modules())


@pytest.mark.parametrize(
    "mlp_rows", [fused_llama.MLP_ROWS, 4]
)  # 4: the prompt's MLP in chunks, the last short
def test_fused_hidden_states_match_hf_and_a_weight_changed_in_place_is_packed_again(
    llama, mlp_rows, monkeypatch
):
    monkeypatch.setattr(fused_llama, "MLP_ROWS", mlp_rows)
    model = copy.deepcopy(llama)
    prompt = _prompts()[3]
    engine = Engine(
        model,
        None,
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        accelerator=SpeedPaths(fused_layers=True),
    )

    def both():
        fused = engine.runner.decoder
        ids = torch.tensor([prompt])
        pos = torch.arange(len(prompt))[None]
        # a fresh engine step's batch for this prompt alone, through the engine's own builder
        from kvlab.engine.paged_attention import build_batch, paged_step

        table = list(range(len(prompt) // 4 + 1))
        engine.runner.attach()
        try:
            with paged_step():
                got = fused(input_ids=ids, position_ids=pos, kvlab_batch=build_batch(
                    engine.store, [(0, len(prompt), table)]))[0]
        finally:
            engine.runner.detach()
        with torch.no_grad():
            want = model.model(input_ids=ids).last_hidden_state
        return got, want

    got, want = both()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(3)  # in place: the fused copy is stale
        model.model.layers[2].mlp.up_proj.bias.add_(1)
    got2, want2 = both()
    assert not torch.allclose(want2, want, atol=1e-3)
    torch.testing.assert_close(got2, want2, rtol=1e-4, atol=1e-4)
    down = model.model.layers[0].mlp.down_proj  # replaced, not changed in place: packed again too
    down.weight = torch.nn.Parameter(down.weight.detach() * 2)
    got3, want3 = both()
    assert not torch.allclose(want3, want2, atol=1e-3)
    torch.testing.assert_close(got3, want3, rtol=1e-4, atol=1e-4)


def test_fused_layers_are_refused_where_they_cannot_run_naming_why(llama, lm):
    qwen, tok = lm  # the bundled model is a Qwen2
    with pytest.raises(
        ValueError, match="fused_layers: it runs transformers' LlamaForCausalLM only .*Qwen2"
    ):
        Engine(qwen, tok, num_blocks=16, accelerator=SpeedPaths(fused_layers=True))
    other = copy.deepcopy(llama).to(torch.float64)
    with pytest.raises(ValueError, match="fused_layers: it is wired for float32 only"):
        Engine(other, None, num_blocks=16, accelerator=SpeedPaths(fused_layers=True))
    hooked = copy.deepcopy(llama)
    hooked.model.layers[2].mlp.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(
        ValueError, match=r"fused_layers: forward hooks are registered on model\.layers\.2\.mlp"
    ):
        Engine(hooked, None, num_blocks=16, accelerator=SpeedPaths(fused_layers=True))
    gelu = copy.deepcopy(llama)
    gelu.model.layers[1].mlp.act_fn = transformers.activations.ACT2FN["gelu"]
    with pytest.raises(
        ValueError,
        match="fused_layers: its MLP runs SiLU only .layer 1's activation is GELUActivation",
    ):
        Engine(gelu, None, num_blocks=16, accelerator=SpeedPaths(fused_layers=True))
    other_embedding = copy.deepcopy(llama)
    other_embedding.model.embed_tokens = torch.nn.Sequential(other_embedding.model.embed_tokens)
    with pytest.raises(
        ValueError, match="fused_layers: its embedding is a Sequential, not an nn.Embedding"
    ):
        Engine(other_embedding, None, num_blocks=16, accelerator=SpeedPaths(fused_layers=True))
    assert fused_layers_available(llama) is None
    with pytest.raises(TypeError, match="fused_layers must be a bool"):
        SpeedPaths(fused_layers=1)


def test_a_failed_build_of_the_ops_is_refused_naming_why(llama, monkeypatch):
    def broken():
        raise RuntimeError("Error building extension 'kvlab_fused_ops': no compiler")

    # the ops' own loader, not the model: a machine without a compiler
    monkeypatch.setattr(fused_llama.fused_ops, "load", broken)
    with pytest.raises(
        ValueError, match=r"fused_layers: no build of its C\+\+ ops \(RuntimeError: .*no compiler"
    ):
        Engine(llama, None, num_blocks=16, accelerator=SpeedPaths(fused_layers=True))


def test_a_hook_registered_after_construction_runs_through_transformers_own_layers(llama):
    model = copy.deepcopy(llama)
    prompts = _prompts()
    engine = Engine(
        model,
        None,
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        accelerator=SpeedPaths(fused_layers=True),
    )
    calls = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        outs = engine.generate(prompts[:2], SamplingParams(max_tokens=NEW))
    finally:
        handle.remove()
    assert [o.output_ids for o in outs] == _hf(llama, prompts[:2])
    assert calls, "the hook did not run: the fused loop skipped it"
    seen = len(calls)
    # removed: the fused loop again
    outs = engine.generate(prompts[2:3], SamplingParams(max_tokens=NEW))
    assert len(calls) == seen and [o.output_ids for o in outs] == _hf(llama, prompts[2:3])
