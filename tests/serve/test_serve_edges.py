"""``kvlab serve`` at its edges (issue 37, S1-S3), in-process: no server subprocess, a few seconds
in all.

- S1: prompt text over ``max_prompt_bytes`` is refused (400 naming the field) before it reaches the
  tokenizer, and the tokenizer runs off the event loop, so /health answers while a big prompt is
  being tokenized.
- S2: ``GET /debug/engine`` needs an API key when keys are configured.
- S3: with API keys and no ``--isolation``, the server isolates tenants (``tenant``); ``shared``
  only by name.
"""

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from kvlab.engine import Engine  # noqa: E402
from kvlab.serve import ServeConfig, create_app  # noqa: E402
from kvlab.serve import app as app_module  # noqa: E402

MODEL = "kvlab-passphrase-qwen2"
KEYS = {"key-a": "acme", "key-b": "globex"}
ENGINE_KW = dict(num_blocks=64, block_size=16, max_num_seqs=4)


@pytest.fixture
def engine(bundled):
    """A fresh small engine on the bundled model (1,024 positions)."""
    model, tok = bundled
    return Engine(model, tok, **ENGINE_KW)


@pytest.fixture
def tokenized(monkeypatch):
    """Every text the server hands to the tokenizer (the real one still does the work)."""
    seen: list[str] = []
    real = app_module.encode

    def spy(tokenizer, prompt):
        if isinstance(prompt, str):
            seen.append(prompt)
        return real(tokenizer, prompt)
    monkeypatch.setattr(app_module, "encode", spy)
    return seen


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    )
    return err


# ----------------------------------------------------------------------------- S1: the byte limit
def test_prompt_text_over_the_byte_limit_is_refused_before_tokenizing(engine, tokenized):
    app = create_app(engine, ServeConfig(model_name=MODEL, max_prompt_bytes=1000))
    with TestClient(app) as http:
        # 600 characters, 1,200 UTF-8 bytes: the limit counts bytes
        err = _error(http.post("/v1/completions", json={"prompt": "é" * 600, "max_tokens": 2}))
        assert (
            err["param"] == "prompt" and "1200 bytes" in err["message"] and "1000" in err["message"]
        )
        messages = [
            {"role": "system", "content": "x" * 600},
            {"role": "user", "content": "y" * 401},
        ]
        err = _error(
            http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        )
        assert err["param"] == "messages" and "1001 bytes" in err["message"]
        assert tokenized == []  # neither reached the tokenizer
        ok = http.post(
            "/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 1, "temperature": 0}
        )
        assert ok.status_code == 200, ok.text  # at the limit: served
        assert tokenized == ["a" * 1000]


def test_the_default_byte_limit_follows_the_models_context(engine, tokenized):
    app = create_app(engine, ServeConfig(model_name=MODEL))
    limit = app_module.PROMPT_BYTES_PER_TOKEN * engine.max_model_len
    assert app.state.server.max_prompt_bytes == limit == 32 * 1024
    with TestClient(app) as http:
        err = _error(
            http.post("/v1/completions", json={"prompt": "hello " * 6000, "max_tokens": 2})
        )
        assert err["param"] == "prompt" and str(limit) in err["message"]
        assert tokenized == []
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        create_app(engine, ServeConfig(model_name=MODEL, max_prompt_bytes=0))


# ---------------------------------------------------------------------- S1: off the event loop
# how long the slow tokenizer holds a prompt at most (the old code stalled /health that long)
HOLD_S = 5.0


def test_health_answers_while_a_big_prompt_is_tokenized(engine, monkeypatch):
    """The tokenizer holds one (allowed) prompt for up to 5 s; /health must answer within 1 s of it
    starting."""
    real = app_module.encode
    entered, release = threading.Event(), threading.Event()
    marks: dict[str, float] = {}

    def slow_encode(tokenizer, prompt):
        if isinstance(prompt, str) and prompt.startswith("SLOW"):
            marks["entered"] = time.monotonic()
            entered.set()
            # on the event loop (the old code) this blocks every other request too
            release.wait(HOLD_S)
        return real(tokenizer, prompt)
    monkeypatch.setattr(app_module, "encode", slow_encode)
    app = create_app(engine, ServeConfig(model_name=MODEL))

    async def scenario() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://test", timeout=30
            ) as http:
                big = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": "SLOW " + "a b " * 100, "max_tokens": 1, "temperature": 0}))
                while not entered.is_set():  # the request has reached the tokenizer
                    await asyncio.sleep(0.005)
                    assert not big.done(), big.result().text
                health = await http.get("/health")
                marks["health"] = time.monotonic()
                release.set()
                return health.status_code, (await big).status_code

    try:
        health_status, big_status = asyncio.run(scenario())
    finally:
        release.set()
    assert health_status == 200 and big_status == 200
    waited = marks["health"] - marks["entered"]
    assert waited < 1.0, (
        f"/health took {waited:.2f} s while a prompt was tokenized: the event loop was blocked"
    )


# ----------------------------------------------------------------------------- S2: the debug
# endpoint
def test_debug_endpoint_needs_an_api_key_when_keys_are_configured(engine):
    app = create_app(engine, ServeConfig(model_name=MODEL, api_keys=KEYS, debug_endpoint=True))
    with TestClient(app) as http:
        for headers in ({}, {"Authorization": "Bearer key-z"}, {"Authorization": "key-a"}):
            r = http.get("/debug/engine", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (
                headers,
                r.text,
            )
        r = http.get("/debug/engine", headers={"Authorization": "Bearer key-b"})
        assert r.status_code == 200 and r.json()["leaked_blocks"] == 0
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL, debug_endpoint=True))) as http:
        assert http.get("/debug/engine").status_code == 200  # an open server: open for everyone


# ----------------------------------------------------------------------------- S3: the default
# isolation
@pytest.fixture
def started(bundled, monkeypatch, tmp_path):
    """Run ``python -m kvlab.serve``'s ``main`` up to ``uvicorn.run``: returns ``run(argv) -> (rc,
    app)``."""
    import uvicorn

    import kvlab.engine.models
    from kvlab.serve.__main__ import main

    apps = []
    monkeypatch.setattr(kvlab.engine.models, "load_model", lambda *a, **k: bundled)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.delenv("KVLAB_API_KEYS", raising=False)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))

    def run(*argv: str):
        argv = [a.replace("KEYS", str(keys)) for a in argv]
        rc = main(["--num-blocks", "64", *argv])
        return rc, (apps.pop() if apps else None)
    return run


def test_keys_without_isolation_isolate_tenants(started, capsys):
    rc, app = started("--api-keys", "KEYS")
    assert rc == 0 and app.state.server.engine.isolation == "tenant"
    assert "isolation tenant, 2 tenants" in capsys.readouterr().out
    # sharing across keys only by name
    rc, app = started("--api-keys", "KEYS", "--isolation", "shared")
    assert rc == 0 and app.state.server.engine.isolation == "shared"
    assert "--isolation shared with API keys" in capsys.readouterr().err  # and said at start
    rc, app = started()  # an open server: one anonymous tenant, nothing to keep apart
    assert rc == 0 and app.state.server.engine.isolation == "shared"
    rc, app = started("--max-prompt-bytes", "4096")
    assert rc == 0 and app.state.server.max_prompt_bytes == 4096
    assert started("--max-prompt-bytes", "0") == (2, None)


def test_chunked_prefill_is_on_unless_switched_off(started):
    rc, app = started()
    assert rc == 0 and app.state.server.engine.scheduler.enable_chunked_prefill is True
    rc, app = started("--no-chunked-prefill")
    assert rc == 0 and app.state.server.engine.scheduler.enable_chunked_prefill is False


def test_help_states_the_isolation_default(capsys):
    from kvlab.serve.__main__ import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "default: tenant when API keys are configured" in text and "--isolation shared" in text
    assert "--max-prompt-bytes" in text


# ----------------------------------------------------------------------------- tenancy in the
# engine (issue 37)
def test_serve_holds_no_secret_and_no_request_scope(engine):
    import dataclasses

    import kvlab.serve.tenancy as tenancy

    assert "secret" not in {f.name for f in dataclasses.fields(ServeConfig)}
    with pytest.raises(TypeError):
        ServeConfig(model_name=MODEL, secret=b"s" * 32)
    assert not hasattr(tenancy, "request_scope")
    assert not hasattr(create_app(engine, ServeConfig(model_name=MODEL)).state.server, "secret")


def test_a_salted_request_is_served_under_its_tenant(bundled):
    model, tok = bundled
    engine = Engine(model, tok, isolation="tenant", secret=b"s" * 32, **ENGINE_KW)
    added = []
    real = engine.add_request

    def spy(*args, **kwargs):
        added.append(kwargs)
        return real(*args, **kwargs)
    engine.add_request = spy
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL, api_keys=KEYS))) as http:
        body = {
            "prompt": "The passphrase is K7QX2M. " * 4,
            "max_tokens": 2,
            "temperature": 0,
            "cache_salt": "team",
        }
        for _ in range(2):
            r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-a"})
            assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert [(a["tenant"], a["cache_salt"]) for a in added] == [("acme", "team")] * 2
    assert "unsafe_salt" not in added[0]  # the server derives no salt: the engine does
    by = {row["tenant"]: row for row in engine.block_manager.metrics.tenant_table()}
    assert (
        set(by) == {"acme"}
        and by["acme"]["requests"] == 2
        and by["acme"]["hit_tokens"] == cached > 0
    )


def test_an_intake_error_names_the_param(bundled):
    model, tok = bundled
    engine = Engine(model, tok, num_blocks=4, block_size=16, max_num_seqs=4)  # a pool of 64 tokens
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as http:
        # the prompt alone needs 5 blocks: the prompt is at fault (the old text search said
        # max_tokens)
        err = _error(http.post("/v1/completions", json={"prompt": [5] * 70, "max_tokens": 2}))
        assert err["param"] == "prompt" and "pool" in err["message"]
        err = _error(http.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 40}))
        assert err["param"] == "max_tokens"
        err = _error(http.post("/v1/completions", json={"prompt": "hi", "top_p": 0}))
        assert err["param"] == "top_p"


def test_a_refusal_in_the_engine_thread_names_the_param(bundled):
    """A request the engine's intake refuses at ``add_request`` reaches the HTTP error with its
    field as param."""
    from kvlab.engine import SamplingParams
    from kvlab.serve.generation import Generation
    from kvlab.serve.metrics import ServeMetrics
    from kvlab.serve.protocol import ApiError
    from kvlab.serve.runner import EngineRunner, Job
    from kvlab.serve.text import TextStream

    model, tok = bundled
    engine = Engine(model, tok, **ENGINE_KW)

    async def scenario() -> list[ApiError]:
        runner = EngineRunner(engine)
        runner.start(asyncio.get_running_loop())
        errors = []
        try:
            for i, (ids, salt) in enumerate([([10 ** 9], None), ([5, 6], "")]):
                job = Job(f"r{i}", ids, SamplingParams(max_tokens=2), None, salt)
                runner.submit(job)
                gen = Generation(runner, ServeMetrics(MODEL), job, TextStream(tok), arrival=0.0)
                with pytest.raises(ApiError) as e:
                    await asyncio.wait_for(gen.first(), 30)
                errors.append(e.value)
        finally:
            runner.stop()
        return errors

    errors = asyncio.run(scenario())
    assert [(e.status, e.param) for e in errors] == [(400, "prompt"), (400, "cache_salt")]
