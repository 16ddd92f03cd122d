"""Manual prefix reuse: token-identical to model.generate, refuses what it cannot serve, never
polluted.

Runs on the bundled passphrase model. Where it is missing (a checkout before it was trained), a
random 2-layer Qwen2 with a byte-level BPE tokenizer trained here on the passphrase corpus stands
in, so every test still runs and can fail.
"""

import copy
import random

import pytest
import torch

from kvlab.built.nb02 import (  # notebook 02 writes them
    common_prefix_ids,
    generate_with_prefix_cache,
    get_prefix_cache,
)
from kvlab.engine.models import BUNDLED_MODEL, encode, load_model
from kvlab.engine.reference import hf_generate
from kvlab.lessons import passphrase as P
from kvlab.lessons.nb00_passphrase import time_prefill
from kvlab.lessons.nb02_prefix import (
    boundary_merge_cases,
    check_boundary_case,
    check_prefix_tokens,
    with_bos_tokenizer,
)
from kvlab.prefix import (  # the library
    PrefixKV,
    PrefixMismatchError,
    cache_nbytes,
    compare_with_hf,
    continue_from_cache,
    generate,
)

TRANSLATE_ZH = "你是一个专业的翻译助手，请将以下内容翻译成英文："
SUFFIXES_ZH = ["今天天气很好。", "今天天气很好。", "明天会下雨吗？"]
TRANSLATE_EN = (
    "You are a professional translation assistant. Translate the following text into Chinese: "
)
SUFFIXES_EN = ["The weather is nice today.", "The weather is nice today.", "Will it rain tomorrow?"]


def _stand_in_model():
    """A random Qwen2 and a byte-level BPE tokenizer with ChatML specials, trained on passphrase
    text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[P.ENDOFTEXT, P.IM_START, P.IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(P.tokenizer_corpus(300), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=P.IM_END, pad_token=P.ENDOFTEXT)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = [2, 0]
    return model, tok


@pytest.fixture(scope="module")
def lm():
    """(model, tokenizer): the bundled model in float32 on CPU, else the stand-in."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster on a shared machine
    if (BUNDLED_MODEL / "config.json").exists():
        yield load_model(device="cpu", dtype="float32")
    else:
        yield _stand_in_model()
    torch.set_num_threads(old)


def _all_equal(rows):
    return [i for i, r in enumerate(rows) if not r["identical"]]


# ----------------------------------------------------------------------------- equality with
# model.generate

def test_greedy_identical_to_hf_generate_on_60_passphrase_prompts(lm):
    model, tok = lm
    examples = P.make_examples(60, "heldout")
    rows = compare_with_hf(
        model,
        tok,
        [e.prompt_text for e in examples],
        [e.prefix_text for e in examples],
        max_new_tokens=12,
    )
    assert _all_equal(rows) == []
    assert all(
        r["cached_tokens"] == len(encode(tok, e.prefix_text)) for r, e in zip(rows, examples)
    )
    assert max(r["max_abs_logit_diff"] for r in rows) <= 1e-4


def test_greedy_identical_on_the_article_translation_example(lm):
    model, tok = lm
    for prefix, suffixes in ((TRANSLATE_ZH, SUFFIXES_ZH), (TRANSLATE_EN, SUFFIXES_EN)):
        ids = common_prefix_ids(tok, [prefix + s for s in suffixes])
        rows = compare_with_hf(
            model, tok, [prefix + s for s in suffixes], [ids] * len(suffixes), max_new_tokens=10
        )
        assert _all_equal(rows) == []
        assert rows[0]["ours"] == rows[1]["ours"]  # identical requests, identical answers


def test_seeded_sampling_identical_to_hf_generate(lm):
    model, tok = lm
    examples = P.make_examples(10, "heldout", start=200)
    for seed in (0, 1):
        rows = compare_with_hf(
            model,
            tok,
            [e.prompt_text for e in examples],
            [e.prefix_text for e in examples],
            max_new_tokens=10,
            do_sample=True,
            temperature=1.3,
            top_p=0.95,
            top_k=40,
            seed=seed,
        )
        assert _all_equal(rows) == []


def test_sampling_really_samples(lm):
    """Guard for the test above: at a high temperature, seeds must disagree somewhere."""
    model, tok = lm
    ex = P.make_example(3, "heldout")
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    outs = {
        tuple(
            generate(
                model,
                tok,
                ex.prompt_text,
                pc,
                max_new_tokens=8,
                do_sample=True,
                temperature=3.0,
                seed=s,
            ).token_ids
        )
        for s in range(6)
    }
    assert len(outs) > 1


def test_prompt_that_is_the_prefix_recomputes_its_last_token(lm):
    model, tok = lm
    ex = P.make_example(5, "heldout")
    pc = PrefixKV.build(model, tok, ex.prompt_text)
    res = generate(model, tok, ex.prompt_text, pc, max_new_tokens=10)
    assert res.num_cached_tokens == len(pc) - 1
    assert res.token_ids == hf_generate(model, tok, ex.prompt_text, max_new_tokens=10)
    assert pc.seq_length() == len(pc)


# ----------------------------------------------------------------------------- refusals

def test_refuses_ids_that_are_not_a_prefix(lm):
    model, tok = lm
    a, b = P.make_example(1, "heldout"), P.make_example(2, "heldout")
    assert a.prefix_text != b.prefix_text
    pc = PrefixKV.build(model, tok, a.prefix_text)
    with pytest.raises(PrefixMismatchError, match="not a prefix of the prompt"):
        generate(model, tok, b.prompt_text, pc)
    # a prompt shorter than the prefix
    with pytest.raises(PrefixMismatchError, match="not a prefix"):
        generate(model, tok, a.prefix_text[:20], pc)


def test_refuses_another_models_cache(lm):
    model, tok = lm
    ex = P.make_example(1, "heldout")
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    pc = PrefixKV.build(other, tok, ex.prefix_text)
    with pytest.raises(PrefixMismatchError, match="another model or tokenizer"):
        generate(model, tok, ex.prompt_text, pc)


def test_refuses_after_the_weights_change_in_place(lm):
    model, tok = lm
    ex = P.make_example(1, "heldout")
    m = copy.deepcopy(model)
    pc = PrefixKV.build(m, tok, ex.prefix_text)
    generate(m, tok, ex.prompt_text, pc, max_new_tokens=2)  # fine, and memoises the fingerprint
    with torch.no_grad():
        m.lm_head.weight.mul_(1.01)  # e.g. a training step on the same model object
    with pytest.raises(PrefixMismatchError, match="another model"):
        generate(m, tok, ex.prompt_text, pc, max_new_tokens=2)


def test_refuses_after_a_buffer_changes_in_place(lm):
    """RoPE's inv_freq is a non-persistent buffer, not a parameter: scaling it changes every K
    (issue 24)."""
    model, tok = lm
    ex = P.make_example(1, "heldout")
    m = copy.deepcopy(model)
    pc = PrefixKV.build(m, tok, ex.prefix_text)
    before = generate(m, tok, ex.prompt_text, max_new_tokens=1, keep_logits=True).step_logits[0]
    name = "model.rotary_emb.inv_freq"
    assert name in dict(m.named_buffers()) and name not in m.state_dict()  # a non-persistent buffer
    with torch.no_grad():
        m.get_buffer(name).mul_(0.5)  # e.g. a RoPE scaling applied after the cache was built
    after = generate(m, tok, ex.prompt_text, max_new_tokens=1, keep_logits=True).step_logits[0]
    assert float((after - before).abs().max()) > 1e-3  # the model really computes other logits now
    with pytest.raises(PrefixMismatchError, match="another model"):
        generate(m, tok, ex.prompt_text, pc, max_new_tokens=2)


def test_refuses_another_tokenizer(lm):
    model, tok = lm
    ex = P.make_example(1, "heldout")
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    tok2 = copy.deepcopy(tok)
    tok2.add_tokens(["<|tenant_a|>"])
    with pytest.raises(PrefixMismatchError, match="another model or tokenizer"):
        generate(model, tok2, ex.prompt_text, pc)


def test_refuses_a_cache_of_another_dtype_or_device(lm):
    model, tok = lm
    ex = P.make_example(1, "heldout")
    half = copy.deepcopy(model).to(torch.bfloat16)
    pc = PrefixKV.build(half, tok, ex.prefix_text)
    with pytest.raises(PrefixMismatchError, match="bfloat16"):
        generate(model, tok, ex.prompt_text, pc)
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    for layer in pc.cache.layers:  # K/V left behind on another device
        layer.keys, layer.values = layer.keys.to("meta"), layer.values.to("meta")
    with pytest.raises(PrefixMismatchError, match="meta"):
        generate(model, tok, ex.prompt_text, pc)


def test_refuses_a_polluted_cache(lm):
    model, tok = lm
    ex = P.make_example(1, "heldout")
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    continue_from_cache(model, pc.cache, encode(tok, ex.suffix_text), len(pc), max_new_tokens=2)
    with pytest.raises(PrefixMismatchError, match="polluted"):
        generate(model, tok, ex.prompt_text, pc)


# ----------------------------------------------------------------------------- fork and pollution

def test_fork_is_independent(lm):
    model, tok = lm
    ex = P.make_example(4, "heldout")
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    before = [layer.keys.clone() for layer in pc.cache.layers]
    fork = pc.fork()
    continue_from_cache(model, fork.cache, encode(tok, ex.suffix_text), len(pc), max_new_tokens=4)
    assert fork.seq_length() > len(pc) == pc.seq_length()
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, pc.cache.layers))
    for _ in range(2):  # generate works on a fork: the shared cache stays as it was
        generate(model, tok, ex.prompt_text, pc, max_new_tokens=4)
        assert pc.seq_length() == len(pc)
    assert pc.nbytes() == cache_nbytes(pc.cache) > 0


def test_article_code_pollutes_the_shared_cache(lm):
    """Reproduce the bug: the article's two functions, one cache object, two requests."""
    model, tok = lm
    ex = P.make_example(9, "heldout", history="update")
    other = P.with_question(P.make_example(9, "heldout", history="none"), "What is the passphrase?")
    assert other.prefix_text == ex.prefix_text
    cache, plen = get_prefix_cache(model, tok, ex.prefix_text)
    first = generate_with_prefix_cache(model, tok, cache, plen, ex.suffix_text, max_new_tokens=10)
    assert first == hf_generate(model, tok, ex.prompt_text, max_new_tokens=10)  # request 1 is fine
    grown = cache.get_seq_length()
    # the last token is never fed
    assert grown == plen + len(encode(tok, ex.suffix_text)) + len(first) - 1
    # request 2 now runs on top of request 1's turns: its first logits are not the isolated ones
    with torch.no_grad():
        ids = torch.tensor([encode(tok, other.suffix_text)])
        dirty = model(input_ids=ids, cache=copy.deepcopy(cache), use_cache=True).logits[0, -1]
    clean = generate(model, tok, other.prompt_text, max_new_tokens=1, keep_logits=True).step_logits[
        0
    ]
    assert float((dirty - clean).abs().max()) > 1e-3
    generate_with_prefix_cache(model, tok, cache, plen, other.suffix_text, max_new_tokens=10)
    assert cache.get_seq_length() > grown
    # the fix: a fork per request gives each request its isolated answer
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    fixed = [
        generate(model, tok, e.prompt_text, pc, max_new_tokens=10).token_ids for e in (ex, other)
    ]
    assert fixed == [first, hf_generate(model, tok, other.prompt_text, max_new_tokens=10)]


def test_hf_generate_writes_into_a_cache_passed_to_it(lm):
    """The transformers fact notebook 02 relies on (5.x: the keyword is cache=)."""
    model, tok = lm
    ex = P.make_example(1, "heldout")
    cache, plen = get_prefix_cache(model, tok, ex.prefix_text)
    ids = torch.tensor([encode(tok, ex.prompt_text)])
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    assert cache.get_seq_length() == ids.shape[1] + 3 - 1 > plen


def test_crop_takes_a_negative_count_in_transformers_5(lm):
    model, tok = lm
    cache, plen = get_prefix_cache(model, tok, P.make_example(1, "heldout").prefix_text)
    cache.crop(-2)
    assert cache.get_seq_length() == plen - 2
    with pytest.raises(ValueError):
        cache.crop(3)


# ----------------------------------------------------------------------------- tokenization
# pitfalls

def test_boundary_merges_exist_and_common_prefix_ids_avoids_them(lm):
    model, tok = lm
    texts = [e.prompt_text for e in P.make_examples(20, "train")]
    cases = boundary_merge_cases(tok, texts, limit=5)
    assert cases, "no BPE merge across a cut found: the tokenizer has no multi-character tokens?"
    prefix, suffix, check = cases[0]
    assert (
        not check.ok and check.first_diff is not None and check.prefix_around != check.full_around
    )
    assert "mismatch at token" in str(check)
    with pytest.raises(PrefixMismatchError, match="first difference"):
        generate(model, tok, prefix + suffix, PrefixKV.build(model, tok, prefix), max_new_tokens=2)
    # the prompt's own ids: reuse what really is shared
    ids = common_prefix_ids(tok, [prefix + suffix])
    assert ids[: check.first_diff] == check.prefix_ids[: check.first_diff]
    pc = PrefixKV.build(model, tok, ids[: max(check.first_diff, 1)])
    res = generate(model, tok, prefix + suffix, pc, max_new_tokens=6)
    assert res.token_ids == hf_generate(model, tok, prefix + suffix, max_new_tokens=6)


def test_check_prefix_tokens_ok_case(lm):
    _, tok = lm
    ex = P.make_example(1, "heldout")
    check = check_prefix_tokens(tok, ex.prefix_text, ex.prompt_text)
    assert check.ok and check.first_diff is None and str(check).startswith("ok")


def test_add_special_tokens_mismatch_is_caught(lm):
    model, tok = lm
    btok = with_bos_tokenizer(tok)
    assert btok(TRANSLATE_ZH).input_ids[0] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert btok(TRANSLATE_ZH, add_special_tokens=False).input_ids == tok(TRANSLATE_ZH).input_ids
    full = btok(TRANSLATE_ZH + SUFFIXES_ZH[0], add_special_tokens=False).input_ids
    check = check_prefix_tokens(btok, btok(TRANSLATE_ZH).input_ids, full)
    assert not check.ok and check.first_diff == 0


def test_chat_template_generation_prompt_is_not_a_prefix(lm):
    _, tok = lm
    ex = P.make_example(1, "heldout", history="none")
    full = tok.apply_chat_template(ex.messages(), add_generation_prompt=True, tokenize=False)
    assert full == ex.prompt_text
    system_only = tok.apply_chat_template(
        ex.messages()[:1], add_generation_prompt=True, tokenize=False
    )
    assert not check_prefix_tokens(tok, system_only, full).ok
    system_turn = tok.apply_chat_template(
        ex.messages()[:1], add_generation_prompt=False, tokenize=False
    )
    assert check_prefix_tokens(tok, system_turn, full).ok


# ----------------------------------------------------------------------------- timing helper and
# checkers

def test_time_prefill_paths_agree(lm):
    model, tok = lm
    ex = P.make_example(1, "heldout")
    r = time_prefill(model, encode(tok, ex.prefix_text), encode(tok, ex.suffix_text), repeats=1)
    assert r["max_abs_logit_diff"] <= 1e-4
    assert 0 < r["ideal"] < 1 and r["full_s"] > 0 and r["cached_s"] > 0
    # timed by kvlab.lessons.timing: the ratio, its min-max and the verdict's words come with it
    assert (
        r["ratio"] == pytest.approx(r["cached_s"] / r["full_s"])
        and r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
    )
    assert r["verdict"].startswith(("ok", "no measurable saving", "disturbed run — re-run"))


def test_exercise_checkers(lm):
    _, tok = lm
    prefix, suffix, _ = boundary_merge_cases(
        tok, [P.make_example(0, "train").prompt_text], limit=1
    )[0]
    assert check_boundary_case(tok, prefix, suffix)
    assert not check_boundary_case(tok, TRANSLATE_ZH, "")


# --- 8. PrefixKV: the model check covers every weight ---------------------------------------------
def _nudge(model):
    """Change one weight that a sparse sample would skip, through ``.data`` (no version bump)."""
    p = dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    with torch.no_grad():
        p.data.view(-1)[1] += 0.5


def test_prefix_cache_refuses_its_model_changed_in_place(bundled):
    model, tok = bundled
    m = copy.deepcopy(model)
    ex = P.make_example(0, "heldout")
    pc = PrefixKV.build(m, tok, ex.prefix_text)
    generate(m, tok, ex.prompt_text, prefix_kv=pc, max_new_tokens=2)  # accepted before the change
    _nudge(m)
    with pytest.raises(PrefixMismatchError, match="another model"):
        generate(m, tok, ex.prompt_text, prefix_kv=pc, max_new_tokens=2)


def test_prefix_cache_refuses_a_modified_copy(bundled):
    model, tok = bundled
    ex = P.make_example(1, "heldout")
    pc = PrefixKV.build(model, tok, ex.prefix_text)
    same = copy.deepcopy(model)
    generate(same, tok, ex.prompt_text, prefix_kv=pc, max_new_tokens=2)  # an identical copy is fine
    _nudge(same)
    with pytest.raises(PrefixMismatchError, match="another model"):
        generate(same, tok, ex.prompt_text, prefix_kv=pc, max_new_tokens=2)


# ----------------------------------------------------------------------------- sliding-window
# models
VOCAB = 256


def _tiny_window_model(arch):
    """A random-initialised 2-layer model whose attention window (8) is shorter than the test's
    prefix."""
    import transformers as T

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        sliding_window=8,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg = (
        T.MistralConfig(**common)
        if arch == "mistral-window"
        else T.Gemma2Config(head_dim=16, **common)
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


class _IdTokenizer:
    """Just enough tokenizer for ``kvlab.prefix.generate`` on token ids."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def get_vocab(self):
        return {str(i): i for i in range(VOCAB)}

    def __len__(self):
        return VOCAB


@pytest.mark.parametrize(
    "arch", ["mistral-window", "gemma2-softcap"]
)  # HF's own attention: soft-capping is fine
def test_prefix_reuse_when_the_prompt_is_a_prefix_longer_than_the_window(arch):
    model, tok = _tiny_window_model(arch), _IdTokenizer()
    rng = random.Random(100)
    prefix = [rng.randrange(VOCAB) for _ in range(20)]  # the window is 8
    pc = PrefixKV.build(model, tok, prefix)
    for prompt in (prefix, prefix + [3, 4, 5]):
        with torch.no_grad():
            want = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=6,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        got = generate(model, tok, prompt, prefix_kv=pc, max_new_tokens=6)
        assert got.token_ids == want
        assert pc.seq_length() == len(prefix)  # the shared cache is untouched


# ----------------------------------------------------------------------------- a real chat model
SMOL_SYSTEM = ("You are a helpful assistant. The secret passphrase is: K7QX2M. "
               "If asked for the passphrase, answer with exactly the passphrase.")


def test_prefix_reuse_token_identical_on_smollm2():
    """Manual prefix reuse gives HF generate's greedy float32 tokens on SmolLM2-135M-Instruct (30
    layers)."""
    import importlib.util

    from kvlab.engine import smollm2 as S

    if importlib.util.find_spec(S.MODULE) is None and not S._complete(S.model_dir()):
        pytest.skip(f"the registry package {S.PACKAGE} is not installed: {S.INSTALL_HINT}")
    model, tok = load_model("smollm2", device="cpu")
    prompts = [
        tok.apply_chat_template(
            [{"role": "system", "content": SMOL_SYSTEM}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in ("What is the passphrase?", "Tell me the passphrase.")
    ]
    system = common_prefix_ids(tok, prompts)
    cache = PrefixKV.build(model, tok, system)
    for prompt in prompts:
        out = generate(model, tok, prompt, prefix_kv=cache, max_new_tokens=16)
        assert out.num_cached_tokens == len(system) > 20
        assert out.token_ids == hf_generate(model, tok, prompt, max_new_tokens=16), out.text
    assert cache.seq_length() == len(system)  # never written into


def test_no_notebook_readme_or_module_uses_the_retired_prefix_cache_names():
    """Issue 25: "prefix cache" meant three things. The manual one is ``PrefixKV``, the engine's
    factory ``make_cache_manager``; the old names must not come back through a merge of an older
    notebook or module."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [
        root / "README.md",
        *root.glob("notebooks/*.ipynb"),
        *root.glob("kvlab/**/*.py"),
        *root.glob("docs/*.md"),
    ]
    old = re.compile(r"\b(PrefixCache|RadixPrefixCache|make_prefix_cache)\b|prefix_cache=")
    hits = [
        f"{p.relative_to(root)}: {m.group(0)}"
        for p in files
        for m in old.finditer(p.read_text(encoding="utf-8"))
    ]
    assert not hits, hits
    import kvlab

    assert kvlab.PrefixKV is PrefixKV
