"""Reliability III (issue 53): streams equal their text, every input bounded, no request stalls
another."""

import os
import random

import pytest

from kvlab.serve.text import TextStream


# --- N3: the streamed text equals the non-streamed text, for every stop string --------------------
class ByteTokenizer:
    """A byte-level tokenizer stand-in: each id is a run of UTF-8 bytes; ``decode`` replaces what is
    incomplete."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


ALPHABET = "ab #\n实中文🙂é😀"  # 1-, 2-, 3- and 4-byte characters


def _case(rng: random.Random) -> tuple[ByteTokenizer, list[int], list[str], list[int]]:
    """Random text cut into byte tokens anywhere (inside characters too), random stops, random push
    sizes."""
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))
    data = text.encode("utf-8")
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, len(data)))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    stops = []
    for _ in range(rng.randint(1, 3)):
        # a piece of the text (it may match), else random characters (it may not)
        if rng.random() < 0.7:
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        else:
            stops.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))))
    sizes, left = [], len(pieces)
    while left:
        sizes.append(min(left, rng.randint(1, 3)))
        left -= sizes[-1]
    return ByteTokenizer(pieces), list(range(len(pieces))), stops, sizes


def test_streamed_text_equals_the_text_for_random_stops_and_multibyte_text():
    """>= 500 random cases: the pieces a stream sends join to exactly the answer's text (and that
    text is the full decode, cut where a stop string begins)."""
    rng = random.Random(53)
    differences = []
    for n in range(800):
        tok, ids, stops, sizes = _case(rng)
        ts, sent, at = TextStream(tok, stops), [], 0
        for k, size in enumerate(sizes):
            sent.append(ts.push(ids[at:at + size], final=k == len(sizes) - 1))
            at += size
        full, text = tok.decode(ids), ts.text
        # the answer is the full decode, cut where a stop string begins once one appeared (the first
        # to be complete)
        ok = full.startswith(text) and (
            any(full.startswith(s, len(text)) for s in stops)
            if ts.stopped
            else text == full and not any(s in full for s in stops)
        )
        if "".join(sent) != text or not ok:
            differences.append((n, full, stops, "".join(sent), ts.text))
    assert differences == []


def test_the_smollm2_case_a_stop_string_completed_by_a_multibyte_character():
    """'\\n\\n## ' then the first bytes of 实: the '# ' before U+FFFD may start the stop '# 实' (was
    sent early)."""
    data = "\n\n## 实".encode()
    pieces = [b"\n\n", b"##", b" ", data[-3:-1], data[-1:]]
    tok = ByteTokenizer(pieces)
    ts = TextStream(tok, ["# 实"])
    sent = "".join(ts.push([i]) for i in range(len(pieces)))
    assert ts.text == "\n\n#"
    assert sent == "\n\n#"


# --- N13, N9: kvlab serve's arguments and its key file, each refused in one line before the model l
@pytest.fixture
def serve_main(monkeypatch):
    """``python -m kvlab.serve``'s ``main`` with a model loader that records whether it was
    called."""
    import kvlab.engine.models
    from kvlab.serve.__main__ import main

    loads = []

    def no_load(*args, **kwargs):
        loads.append(args)
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(kvlab.engine.models, "load_model", no_load)
    monkeypatch.delenv("KVLAB_API_KEYS", raising=False)
    return main, loads


@pytest.mark.parametrize("argv, named", [
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--block-size", "0"], "--block-size"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--port", "99999"], "--port"),
    (["--port", "-1"], "--port"),
    (["--model", "/nonexistent"], "/nonexistent"),
    (["--model", "./no/such/model"], "./no/such/model"),
    (["--api-keys", "/dev/zero"], "character device"),
])
def test_bad_serve_arguments_are_one_line_before_the_model_loads(serve_main, capsys, argv, named):
    main, loads = serve_main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "\n" not in err and "Traceback" not in err, err
    assert loads == []


def test_api_keys_that_are_not_a_regular_file_or_too_big_are_refused(serve_main, capsys, tmp_path):
    main, loads = serve_main
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "keys.json"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse
    for path, words in [(tmp_path, "a folder"), (fifo, "a FIFO"), (big, "bytes")]:
        assert main(["--api-keys", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert str(path) in err and words in err and "\n" not in err, err
    assert loads == []


# --- N16: slow clients, cross-site simple POSTs, /metrics behind the keys -------------------------
KEYS = {"key-a": "tenant-a"}


@pytest.fixture(scope="module")
def engine(bundled):
    from kvlab.engine import Engine

    model, tok = bundled
    return Engine(model, tok, num_blocks=64, block_size=16)


def _client(engine, **config):
    from starlette.testclient import TestClient

    from kvlab.serve import ServeConfig, create_app

    return TestClient(create_app(engine, ServeConfig(model_name="m", **config)))


BODY = {"prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize(
    "ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", None]
)
def test_a_post_that_is_not_json_by_its_content_type_is_refused_with_415(engine, ctype):
    import json

    headers = {} if ctype is None else {"Content-Type": ctype}
    with _client(engine) as c:
        r = c.post("/v1/completions", content=json.dumps(BODY), headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = c.post("/v1/completions", content=json.dumps(BODY),
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200, r.text


def test_metrics_need_a_key_when_keys_are_configured_unless_opened(engine):
    with _client(engine, api_keys=KEYS) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer key-a"}).status_code == 200
        assert c.get("/health").status_code == 200  # liveness stays open
    with _client(engine, api_keys=KEYS, metrics_open=True) as c:
        assert c.get("/metrics").status_code == 200
    with _client(engine) as c:  # an open server: open metrics
        assert c.get("/metrics").status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_refused_with_408():
    """The guard in front of the app: one chunk, then nothing; the app is never called."""
    import asyncio

    from kvlab.serve.guard import RequestGuard
    from kvlab.serve.tenancy import KeyTable

    called, sent = [], []

    async def app(scope, receive, send):
        called.append(scope)

    async def receive():
        if not sent and not called and not getattr(receive, "gave", False):
            receive.gave = True
            return {"type": "http.request", "body": b'{"prompt":', "more_body": True}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    guard = RequestGuard(app, KeyTable({}), max_body_bytes=1 << 20, body_timeout=0.05)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(guard(scope, receive, send))
    assert called == [] and sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]


def test_a_request_head_sent_byte_by_byte_is_cut_off():
    """A slowloris connection (a head that never ends) is closed by the server; a whole request is
    served."""
    import socket
    import threading

    import uvicorn

    from kvlab.serve.guard import head_timeout_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="error",
            lifespan="off",
            http=head_timeout_protocol(0.3),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            s.sendall(b"X-a: b\r\n")  # ... and never the blank line
            # closed by the server (the 20 s socket timeout would raise instead)
            assert s.recv(100) == b""
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := s.recv(100):  # until the server closes the kept-alive, idle connection
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
    finally:
        server.should_exit = True
        thread.join(10)


def test_serve_runs_uvicorn_with_the_head_timeout_and_the_metrics_flag(
    bundled, monkeypatch, capsys, tmp_path
):
    import json

    import uvicorn

    import kvlab.engine.models
    from kvlab.serve.__main__ import main

    runs = []
    monkeypatch.setattr(kvlab.engine.models, "load_model", lambda *a, **k: bundled)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    monkeypatch.delenv("KVLAB_API_KEYS", raising=False)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    assert main(["--num-blocks", "64", "--api-keys", str(keys)]) == 0
    app, kw = runs.pop()
    assert kw["http"].__name__ == "HeadTimeoutH11Protocol" and kw["timeout_keep_alive"] <= 5
    assert app.state.server.config.metrics_open is False
    assert main(["--num-blocks", "64", "--api-keys", str(keys), "--open-metrics"]) == 0
    assert runs.pop()[0].state.server.config.metrics_open is True
    assert main(["--num-blocks", "64", "--head-timeout", "0"]) == 2


# --- N1: big bodies are bounded before the tokenizer, and parsed off the event loop ---------------
@pytest.fixture
def encoded(monkeypatch):
    """Every prompt (text or ids) the server hands to ``encode`` (the real one still does the
    work)."""
    from kvlab.serve import app as app_module

    seen = []
    real = app_module.encode

    def spy(tokenizer, prompt):
        seen.append(prompt)
        return real(tokenizer, prompt)
    monkeypatch.setattr(app_module, "encode", spy)
    return seen


def test_a_token_id_prompt_longer_than_the_context_is_refused_before_tokenizing(engine, encoded):
    limit = engine.max_model_len
    with _client(engine) as c:
        r = c.post("/v1/completions", json={**BODY, "prompt": [5] * (limit + 1)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["param"] == "prompt"
            and err["code"] == "context_length_exceeded"
            and str(limit) in err["message"]
        )
        assert encoded == []
        # the issue's ~1 MB body
        r = c.post("/v1/completions", json={**BODY, "prompt": [5] * 330000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert encoded == []


def test_more_messages_than_the_context_holds_are_refused_before_the_template(
    engine, encoded, monkeypatch
):
    rendered = []
    real = engine.tokenizer.apply_chat_template

    def spy(*args, **kwargs):
        rendered.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", spy)
    limit = engine.max_model_len
    with _client(engine) as c:
        for content in ("", "x"):
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}] * 30000, "max_tokens": 2},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages" and str(limit) in err["message"]
        assert rendered == [] and encoded == []


def test_the_templated_chat_is_held_to_the_byte_limit_before_tokenizing(engine, encoded):
    """20 one-character messages: 20 bytes of contents, several hundred once templated."""
    with _client(engine, max_prompt_bytes=200) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}] * 20, "max_tokens": 2},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["param"] == "messages"
            and err["code"] == "context_length_exceeded"
            and "template" in err["message"]
        )
        assert encoded == []


def test_json_parsing_and_validation_run_off_the_event_loop(engine, monkeypatch):
    import asyncio

    from kvlab.serve import protocol

    on_loop = []
    real = protocol.CompletionRequest.model_validate.__func__

    def spy(cls, obj, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # a worker thread: no running loop
            on_loop.append(False)
        return real(cls, obj, *args, **kwargs)
    monkeypatch.setattr(protocol.CompletionRequest, "model_validate", classmethod(spy))
    with _client(engine) as c:
        assert c.post("/v1/completions", json=BODY).status_code == 200
    assert on_loop == [False]


# --- N7: --public-prefix shares a chat's system turn, as the chat template renders it -------------
SYSTEM = (
    "You are the help desk of a large hardware store. Answer in one short paragraph, "
    "be polite, never invent prices, and point the customer to the right aisle when you know it."
)


def test_a_public_prefix_is_shared_by_chats_with_that_system_message(
    bundled, monkeypatch, tmp_path
):
    import json

    import uvicorn
    from starlette.testclient import TestClient

    import kvlab.engine.models
    from kvlab.serve.__main__ import main

    runs = []
    monkeypatch.setattr(kvlab.engine.models, "load_model", lambda *a, **k: bundled)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(app))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    assert main(["--num-blocks", "64", "--api-keys", str(keys), "--isolation", "public-prefix",
                 "--public-prefix", SYSTEM]) == 0

    def chat(c, key, question):
        r = c.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 1,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def complete(c, key, text):
        r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"prompt": text, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with TestClient(runs.pop()) as c:
        assert chat(c, "key-a", "Where are the screws?") == 0
        # tenant b shares tenant a's system turn
        assert chat(c, "key-b", "Do you sell paint?") >= 16
        assert complete(c, "key-a", SYSTEM + " Where are the nails?") == 0
        assert complete(c, "key-b", SYSTEM + " Ladders?") >= 16  # the raw text still shares too


# --- N6: the default token budget is sized to the device ------------------------------------------
def test_budget_for_rate_is_a_block_multiple_between_the_batch_and_2048():
    from kvlab.serve.budget import MAX_BUDGET, budget_for_rate

    assert budget_for_rate(1000.0, 64, target_s=0.25) == 240
    assert budget_for_rate(150.0, 64) == 64  # a slow CPU: one token per running sequence at least
    assert budget_for_rate(1e9, 64) == MAX_BUDGET
    # a step of 4 x 0.5 s: 1.5 s of tokens
    assert budget_for_rate(1000.0, 64, target_s=0.25, fixed_s=0.5) == 1488
    with pytest.raises(ValueError):
        budget_for_rate(0.0, 64)


def test_prefill_rate_is_measured_on_the_model(bundled):
    from kvlab.serve.budget import prefill_rate

    rate, fixed = prefill_rate(bundled[0], tokens=16)
    assert rate > 0 and fixed > 0


def test_serve_sizes_the_token_budget_to_the_device_unless_given(bundled, monkeypatch, capsys):
    import uvicorn

    import kvlab.engine.models
    import kvlab.serve.budget
    from kvlab.serve.__main__ import main

    runs = []
    monkeypatch.setattr(kvlab.engine.models, "load_model", lambda *a, **k: bundled)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(app))
    monkeypatch.setattr(kvlab.serve.budget, "prefill_rate", lambda model, tokens=64: (4000.0, 0.01))
    monkeypatch.delenv("KVLAB_API_KEYS", raising=False)
    assert main(["--num-blocks", "64"]) == 0
    assert runs.pop().state.server.engine.scheduler.max_num_batched_tokens == 960
    assert "token budget 960" in capsys.readouterr().err
    # a slow probe: the CPU floor, said in the line
    monkeypatch.setattr(kvlab.serve.budget, "prefill_rate", lambda model, tokens=64: (150.0, 0.01))
    assert main(["--num-blocks", "64"]) == 0
    assert runs.pop().state.server.engine.scheduler.max_num_batched_tokens == 256
    assert "at least 256" in capsys.readouterr().err
    assert main(["--num-blocks", "64", "--max-num-batched-tokens", "512"]) == 0
    assert runs.pop().state.server.engine.scheduler.max_num_batched_tokens == 512
    assert main(["--num-blocks", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "4"]) == 2


def test_the_default_body_limit_follows_the_context_and_refuses_before_reading(
    bundled, monkeypatch
):
    import uvicorn
    from starlette.testclient import TestClient

    import kvlab.engine.models
    from kvlab.serve.__main__ import main
    from kvlab.serve.guard import default_body_limit

    assert default_body_limit(None) == 1 << 20
    assert default_body_limit(1024) == 3 * 32 * 1024 + 16 * 1024 + (64 << 10)
    assert default_body_limit(1024, max_prompt_bytes=1000) == 3000 + 16 * 1024 + (64 << 10)
    assert default_body_limit(131072) == 1 << 20
    runs = []
    monkeypatch.setattr(kvlab.engine.models, "load_model", lambda *a, **k: bundled)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(app))
    monkeypatch.delenv("KVLAB_API_KEYS", raising=False)
    assert main(["--num-blocks", "64", "--max-num-batched-tokens", "256"]) == 0
    app = runs.pop()
    limit = app.state.server.config.max_body_bytes
    assert limit == default_body_limit(app.state.server.engine.max_model_len)
    with TestClient(app) as c:  # the issue's ~1 MB token-id body: 413 before a byte of it is parsed
        r = c.post("/v1/completions", json={"prompt": [5] * 330000, "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert c.post("/v1/completions", json=BODY).status_code == 200
    assert (
        main(
            ["--num-blocks", "64", "--max-num-batched-tokens", "256", "--max-body-bytes", "4000000"]
        )
        == 0
    )
    assert runs.pop().state.server.config.max_body_bytes == 4000000
