"""Load the bundled passphrase model or any Hugging Face causal LM; pick a device; size a KV cache.

``load_model()`` with no argument loads the tiny Qwen2 model committed under ``data/models`` (no
network). Any Hugging Face id or local folder works too, e.g. ``load_model("Qwen/Qwen2.5-0.5B-Instruct",
device="cuda")`` on a workshop GPU with the model already downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = ROOT / "data" / "models" / "kvlab-passphrase-qwen2"
CONFIGS_DIR = ROOT / "data" / "configs"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def seed_everything(seed: int) -> None:
    """Seed Python's, and torch's (every device's) random generators."""
    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device that is not available is an error."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {str(device)!r} was requested but this torch ({torch.__version__}) sees no CUDA GPU; "
            "use DEVICE='auto' or 'cpu', or install a CUDA build of torch on a GPU machine"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise RuntimeError(f"device {str(device)!r} was requested but MPS is not available here")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map 'float32' / 'bf16' / torch.float16 ... to a torch dtype; None stays None (model default)."""
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
                f"the bundled model is missing at {BUNDLED_MODEL}; it is committed to the repository "
                "(retrain it with `python scripts/train_passphrase_model.py`)"
            )
        return str(BUNDLED_MODEL), True
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} exists but is not a model folder (no config.json in it)")
        return str(path), True
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text
    if looks_like_path:
        raise FileNotFoundError(f"model path {text!r} does not exist")
    return text, False


def load_model(model: str | os.PathLike | None = None, device: str | torch.device = "auto",
               dtype: str | torch.dtype | None = None) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``: the bundled model by default, or any HF causal-LM id or folder.

    The model is in eval mode on ``device`` (cuda -> mps -> cpu for "auto") in ``dtype``
    (float32 by default for the bundled model, the checkpoint's own dtype otherwise).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    source, local = _resolve_source(model)
    if torch_dtype is None:
        torch_dtype = torch.float32 if model is None else "auto"
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


def model_fingerprint(model: Any, tokenizer: Any | None = None, *, every_weight: bool = True) -> str:
    """A short id of the weights and the tokenizer's vocabulary.

    Two caches may only be mixed when their fingerprints are equal. It hashes the config, the
    parameter names/shapes/dtypes, **every byte of every parameter** (sha256), and the tokenizer's
    vocabulary and chat template, so changing any single weight (in place, through ``.data``, or in a
    copy) changes it. Cost, measured on one CPU core: about 6 ms for the bundled model (2.9 MB of
    weights; 4 ms with ``every_weight=False``); sha256 runs at about 1 GB/s here, so roughly 1 s per
    GB of weights (a GPU model is copied to the CPU parameter by parameter).

    ``every_weight=False`` hashes 64 sampled values per parameter instead: cheap, but blind to most
    single-weight changes; enough to tell different models apart, as the engine does for its own blocks.
    """
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            flat = p.detach().reshape(-1)
            if every_weight:
                h.update(flat.contiguous().view(torch.uint8).cpu().numpy())  # the raw bytes, any dtype
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
    cfg = _cfg(config, "text_config") or config  # multimodal configs nest the LM
    layers = _cfg(cfg, "num_hidden_layers")
    heads = _cfg(cfg, "num_attention_heads")
    kv_heads = _cfg(cfg, "num_key_value_heads") or heads
    head_dim = _cfg(cfg, "head_dim") or _cfg(cfg, "hidden_size") // heads
    return {"layers": int(layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim)}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype given by name or as a torch dtype."""
    return torch.empty((), dtype=resolve_dtype(dtype)).element_size()


def kv_bytes_per_token(config: Any, dtype: str | torch.dtype = "float32") -> int:
    """KV-cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    s = kv_shape(config)
    return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * dtype_bytes(dtype)


def load_public_config(name: str) -> dict:
    """A public model's config.json shipped in ``data/configs`` (e.g. 'Qwen1.5-7B-Chat')."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no shipped config {name!r}; known: {known}")
    return json.loads(path.read_text())
