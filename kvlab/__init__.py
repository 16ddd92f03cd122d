"""kvlab: when may LLM requests share the KV cache of a common prefix, and when must they be
isolated?

The package is layered; each layer imports only the ones above it:

- ``kvlab.cache``   pure Python, no torch, relative imports only: hashing, block pool, block
                    manager, metrics. Copy the folder alone and it works.
- ``kvlab.engine``  torch on any device: models, sequence, sampling, scheduler, paged K/V store,
                    paged attention, the engine, tenants, and ``reference`` (HF ``generate``, the
                    oracle).
                    Copy ``cache/`` + ``engine/`` together and they run any supported HF decoder.
- ``kvlab.prefix``  manual prefix reuse on HF models (``PrefixKV`` + a complete generation loop).
- ``kvlab.vllm``    the bridge to real vLLM in its own venv.
- ``kvlab.cluster`` engine replicas (Ray actors or model-free), a KV-event-fed router, a fleet
                    driver.
- ``kvlab.lessons`` one module per notebook: experiments, figures, exercise checkers.
- ``kvlab.cli``     the ``kvlab`` command (``kvlab doctor``, ``kvlab serve``, ``kvlab --version``).

The bundled model and the public configs ship in the top-level ``data/`` folder, which the wheel
carries as ``kvlab/data``.

``import kvlab`` stays torch-free; the torch-backed names below load on first use.
"""

from kvlab.cache import BlockManager, BlockPool, NoFreeBlocksError

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it (dynamic version)

_LAZY = {
    "load_model": "kvlab.engine.models",
    "seed_everything": "kvlab.engine.models",
    "resolve_device": "kvlab.engine.models",
    "BUNDLED_MODEL": "kvlab.engine.models",
    "Engine": "kvlab.engine.engine",
    "EngineConfig": "kvlab.engine.config",
    "RequestOutput": "kvlab.engine.engine",
    "RequestError": "kvlab.engine.intake",
    "SamplingParams": "kvlab.engine.sampling",
    "PrefixKV": "kvlab.prefix",
    "generate": "kvlab.prefix",
}


def __getattr__(name: str):
    """Import torch-backed names lazily so the pure-Python core never pulls in torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


__all__ = ["BlockManager", "BlockPool", "NoFreeBlocksError", *_LAZY]
