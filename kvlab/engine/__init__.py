"""A small paged inference engine on Hugging Face weights (torch, any device).

A request's path: ``Engine.add_request`` (``engine``) -> ``Scheduler.schedule`` (``scheduler``, which asks
``kvlab.cache.BlockManager`` for blocks and prefix hits) -> ``Engine._forward`` packs the scheduled tokens
into one batch -> ``paged_attention`` reads and writes each sequence's K/V in ``PagedKVStore`` (``kv_store``)
through its block table -> ``sampling`` picks one token per sequence -> ``RequestOutput``.

``models`` loads the bundled model, SmolLM2 or any HF causal LM and builds random test models;
``reference`` is the HF ``generate`` oracle; ``tenants`` derives cache salts.
"""

from .engine import Engine, RequestOutput, UnknownRequestError
from .models import load_model, random_model, resolve_device, seed_everything
from .sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "UnknownRequestError", "load_model", "random_model",
           "resolve_device", "seed_everything"]
