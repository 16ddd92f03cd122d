"""kvlab: when may LLM requests share the KV cache of a common prefix, and when must they be isolated?

The package is layered (each layer imports only the ones above it):

1. pure Python, no torch: ``hashing``, ``block_pool``, ``block_manager``, ``metrics``, ``scheduler``,
   ``sequence``, ``workloads``, ``passphrase``
2. torch on any device: ``models``, ``attention``, ``rope``, ``prefix``, ``kv_store``, ``paged_attention``
3. the engine: ``engine``, ``sampling``
4. experiments and teaching helpers: ``experiments``, ``evaluation``, ``viz``, ...

``import kvlab`` stays torch-free; the torch-backed names below load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "load_model": "kvlab.models",
    "resolve_device": "kvlab.models",
    "kv_bytes_per_token": "kvlab.models",
    "seed_everything": "kvlab.models",
    "BUNDLED_MODEL": "kvlab.models",
    "model_fingerprint": "kvlab.models",
    "PrefixCache": "kvlab.prefix",
    "random_model": "kvlab.attention",
    "Engine": "kvlab.engine",
    "SamplingParams": "kvlab.sampling",
}


def __getattr__(name: str):
    """Import torch-backed helpers lazily so the pure-Python core never pulls in torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


__all__ = list(_LAZY)
