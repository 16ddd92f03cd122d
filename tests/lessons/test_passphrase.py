import pytest

from kvlab.lessons import passphrase as P


def test_examples_are_a_pure_function_of_split_and_seed():
    a = P.make_examples(20, "train", start=7)
    b = P.make_examples(20, "train", start=7)
    assert a == b
    assert [x.prompt_text for x in a] != [
        x.prompt_text for x in P.make_examples(20, "train", start=8)
    ]


def test_heldout_passphrases_never_appear_in_training():
    train = {ex.answer for ex in P.make_examples(3000, "train")} | {
        ex.passphrase for ex in P.make_examples(3000, "train")
    }
    held = {ex.passphrase for ex in P.make_examples(300, "heldout")}
    assert held and not (train & held)
    assert all(P.is_heldout_passphrase(p) for p in held)
    assert not any(P.is_heldout_passphrase(p) for p in train)


def test_passphrase_formats():
    for ex in P.make_examples(200, "train"):
        p = ex.passphrase
        if "-" in p:
            w1, w2 = p.split("-")
            assert w1 in P.WORDS and w2 in P.WORDS
        else:
            assert len(p) == 6 and set(p) <= set(P.ALPHABET)
        assert p in ex.system


def test_prompt_structure_is_chatml_with_the_prefix_first():
    ex = P.make_example(3, "heldout", n_filler=5, lang="zh", history="none")
    assert ex.prompt_text == ex.prefix_text + ex.suffix_text
    assert ex.prefix_text.startswith("<|im_start|>system\n") and ex.prefix_text.endswith(
        "<|im_end|>\n"
    )
    assert ex.suffix_text.endswith("<|im_start|>assistant\n")
    assert ex.system.count("\n") == 5  # five filler lines + the passphrase line
    assert ex.target_text == "「" + ex.passphrase + "」<|im_end|>"
    assert (
        P.make_example(3, "heldout", lang="en", history="none").target_text.endswith('"') is False
    )


def test_update_history_changes_the_answer():
    ex = P.make_example(11, "train", history="update")
    assert ex.answer != ex.passphrase and ex.answer in ex.suffix_text
    assert (
        P.make_example(11, "train", history="chat").answer
        == P.make_example(11, "train", history="chat").passphrase
    )


def test_filler_counts_cover_0_to_20():
    counts = {ex.system.count("\n") for ex in P.make_examples(400, "train")}
    assert min(counts) == 0 and max(counts) == 20


def test_recall_scoring():
    assert P.recalled("K7QX2M<|im_end|>", "K7QX2M")
    assert P.recalled(" amber-falcon\nmore", "amber-falcon")
    assert P.recalled("「K7QX2M」<|im_end|>", "K7QX2M")
    assert P.recalled("「K7QX2M", "K7QX2M")  # an unclosed bracket does not hide the answer
    assert not P.recalled("「K7QX2MA", "K7QX2M") and not P.recalled("K7QX2M is it", "K7QX2M")
    assert not P.recalled("K7QX2N", "K7QX2M")
    assert P.recall_rate(["A", "B"], ["A", "C"]) == 0.5
    with pytest.raises(ValueError):
        P.recall_rate(["A"], [])


@pytest.mark.parametrize(
    "kwargs", [{"split": "test"}, {"n_filler": 21}, {"lang": "fr"}, {"history": "x"}]
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        P.make_example(0, **kwargs)


@pytest.mark.parametrize(
    "completion",
    [
        "「K7QX2M",
        "K7QX2M」",
        "「K7QX2M」。<|im_end|>",
        '"K7QX2M".',
        "“K7QX2M”",
        "  K7QX2M!\nmore",
        "『K7QX2M』",
        "(K7QX2M)",
        "【K7QX2M】<|endoftext|>",
        "K7QX2M。",
        "'K7QX2M'",
    ],
)
def test_recall_ignores_surrounding_quotes_brackets_and_punctuation(completion):
    assert P.normalize_answer(completion) == "K7QX2M"
    assert P.recalled(completion, "K7QX2M")
    assert P.recalled(completion.replace("K7QX2M", "amber-falcon"), "amber-falcon")


def test_recall_is_not_fooled_by_a_longer_or_different_answer():
    for completion in ("K7QX2MX", "「K7QX2", "XK7QX2M", "amber-falconry", "K7QX2M K7QX2M"):
        assert not P.recalled(completion, "K7QX2M") and not P.recalled(completion, "amber-falcon")
    assert P.mentions("The passphrase is: X5DUXP.", "X5DUXP") and not P.recalled(
        "The passphrase is: X5DUXP.", "X5DUXP"
    )
    assert not P.mentions("The passphrase is: X5DUXQ.", "X5DUXP")


def _engine_prompts():
    """tests/engine/passphrase_prompts.py, loaded by path (the engine tests' copy of these
    prompts)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "engine" / "passphrase_prompts.py"
    spec = importlib.util.spec_from_file_location("engine_passphrase_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_engine_tests_stored_prompts_are_these_prompts():
    """The engine tests read prompts from a JSON file (no lessons import); it must render exactly
    these.

    On a failure, rewrite the file with ``python scripts/make_engine_test_prompts.py``.
    """
    E = _engine_prompts()
    assert len(E.DATA["examples"]) == 45
    for key in E.DATA["examples"]:
        _, seed, *filler = key.split(":")
        ex = P.make_example(int(seed), "heldout", **({"n_filler": 20} if filler else {}))
        for q in P.ASK_EN + P.ASK_ZH + P.CHAT_EN + P.CHAT_ZH:
            assert E.prompt(key, q) == P.with_question(ex, q).prompt_text, (key, q)
        assert E.prefix(key) == ex.prefix_text
    for args in [(), (1, 1), (2, 2), (1, 2), (4, 2, 1)]:
        assert E.question_prompts(*args) == P.question_prompts(*args)
    assert E.ASK_EN == list(P.ASK_EN) and E.ASK_ZH == list(P.ASK_ZH)


def test_param_count_matches_a_real_qwen2_and_llama_model():
    """The count from config.json equals the parameters transformers builds from the same (tiny)
    config."""
    import transformers

    from kvlab.lessons.passphrase import param_count

    for cls, extra in (
        (transformers.Qwen2Config, {"model_type": "qwen2"}),
        (transformers.LlamaConfig, {}),
    ):
        cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
        model = transformers.AutoModelForCausalLM.from_config(cls(**cfg))
        assert param_count({**cfg, **extra}) == sum(p.numel() for p in model.parameters()), (
            cls.__name__
        )
        tied = transformers.AutoModelForCausalLM.from_config(
            cls(**{**cfg, "tie_word_embeddings": True})
        )
        assert param_count({**cfg, **extra, "tie_word_embeddings": True}) == sum(
            p.numel() for p in tied.parameters()
        )


def test_memory_column_states_one_reading_from_the_config():
    from kvlab.lessons.passphrase import memory_column

    m = memory_column("Qwen1.5-7B-Chat")
    assert m.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2          # no GQA: 32 KV heads of 128, fp16
    assert m.weights_bytes == 2 * m.parameters and m.weights_exceed_total
    assert m.drop_tokens == pytest.approx(0.4e9 / m.kv_bytes_per_token)
    assert m.sharing_saves_bytes == 15 * 512 * m.kv_bytes_per_token
    text = str(m)
    assert (
        "whole GPU" in text
        and "cannot be reproduced" in text
        and f"{m.drop_tokens:.0f} tokens" in text
    )
    # a model with GQA reads differently from the same claims: more tokens in the same 0.4 GB
    assert memory_column("Qwen2.5-7B-Instruct").drop_tokens > 5 * m.drop_tokens
    small = memory_column("Qwen2.5-0.5B-Instruct")
    assert not small.weights_exceed_total and "leaving" in str(small)
