"""A small paged inference engine on Hugging Face weights (torch, any device).

A request's path: ``Engine.add_request`` (``engine``; checked and built as a ``Request`` by
``intake``, ``sequence``) -> ``Scheduler.schedule`` (``scheduler``, which asks the
``kvlab.cache.CacheManager`` for blocks and prefix hits) -> ``ModelRunner.forward`` (``runner``)
packs the scheduled tokens into one batch -> ``paged_attention`` reads and writes each request's K/V
in ``PagedKVStore`` (``kv_store``) through its block table -> the runner's LM head and ``sampling``
pick one token per request -> ``RequestOutput``.

``models`` loads the bundled model, SmolLM2 or any HF causal LM and builds random test models;
``reference`` is the HF ``generate`` oracle; ``tenants`` derives cache salts. Plug-ins a default
step never runs: ``hooks`` (a positions hook, step observers, KV-event batches), ``fork``
(``Engine.fork``), ``invariants`` (``debug=True``), ``offload`` (the host tier).

Importing the package loads no torch: the names below load on first use, so
``kvlab.engine.scheduler``, ``sequence`` and ``sampling_params`` stay pure Python.
"""

import importlib

_LAZY = {
    "Engine": "engine",
    "RequestOutput": "engine",
    "StepRecord": "engine",
    "UnknownRequestError": "engine",
    "EngineConfig": "config",
    "load_model": "models",
    "random_model": "models",
    "resolve_device": "models",
    "seed_everything": "models",
    "SamplingParams": "sampling_params",
}


def __getattr__(name: str):
    """Import a torch-backed name on first use (``from kvlab.engine import Engine`` still works)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
