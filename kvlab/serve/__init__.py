"""``kvlab serve``: an OpenAI-compatible HTTP server over kvlab's ``Engine`` (FastAPI + uvicorn).

    python -m kvlab.serve                       # the bundled model on 127.0.0.1:8000
    python -m kvlab.serve --model smollm2 --isolation tenant --api-keys keys.json

Files: ``app`` (the FastAPI app factory and endpoints), ``runner`` (the engine's one background
thread), ``generation`` (one request on the event loop), ``text`` (incremental detokenizing, stop
strings), ``protocol`` (request bodies, errors), ``tenancy`` (API keys -> tenants), ``metrics``
(Prometheus, vLLM's names under ``kvlab:``), ``debug`` (invariants and leaked blocks for load
tests), ``guard`` (head and body deadlines, the JSON content type, /metrics behind the keys),
``budget`` (the device-sized token budget a step).
Needs the ``serve`` extra: ``pip install -e '.[serve]'``.
"""

from .app import ServeConfig, create_app

__all__ = ["ServeConfig", "create_app"]
