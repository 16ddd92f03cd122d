"""``kvlab serve`` over HTTP with the real ``openai`` client, against the engine run in-process.

One server subprocess per module (bundled model, isolation "tenant", three API keys of two tenants,
a small batch and wait queue) on a free loopback port. Greedy answers must equal ``Engine.generate``
token for token (completions and chat, streamed and not); ``cached_tokens`` must equal the engine's
``num_cached_tokens`` when the same requests run in-process in the same order; /metrics counters
must equal the sums over the responses; bad input gets OpenAI's error object; a client that
disconnects frees its blocks. The "shared" policy runs in-process through Starlette's TestClient (no
second start).
"""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvlab.engine import Engine, SamplingParams  # noqa: E402
from kvlab.engine.models import encode  # noqa: E402
from kvlab.lessons import passphrase as P  # noqa: E402
from kvlab.serve import ServeConfig, create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"kvlab-test-secret-0123456789"
KEYS = {"key-a": "acme", "key-a2": "acme", "key-b": "globex"}
MODEL = "kvlab-passphrase-qwen2"
ENGINE_KW = dict(num_blocks=512, block_size=16, max_num_seqs=8)  # what the server runs with
MAX_WAITING = 4  # so 8 + 4 requests fill the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """Base URL of a `python -m kvlab.serve` subprocess; stopped after the module."""
    keys = tmp_path_factory.mktemp("serve") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "KVLAB_SERVER_SECRET": SECRET.decode(),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("KVLAB_API_KEYS", None)
    cmd = [
        sys.executable,
        "-m",
        "kvlab.serve",
        "--port",
        str(port),
        "--isolation",
        "tenant",
        "--api-keys",
        str(keys),
        "--max-num-seqs",
        "8",
        "--max-waiting",
        str(MAX_WAITING),
        "--enable-debug-endpoint",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        request.getfixturevalue("bundled")  # load the in-process reference while the server starts
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited: {proc.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not become healthy in 120 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def client(base: str, key: str = "key-a") -> "openai.OpenAI":
    """The real openai client; no retries (a 503 must reach the test)."""
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def debug(base: str) -> dict:
    return httpx.get(
        base + "/debug/engine", headers={"Authorization": "Bearer key-a"}, timeout=30
    ).json()


def wait_drained(base: str) -> dict:
    """The engine report once no request is in flight (polls; fails after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        rep = debug(base)
        if rep["server_in_flight"] == 0 and rep["live_requests"] == 0:
            return rep
        assert time.monotonic() < deadline, f"requests still in flight: {rep}"
        time.sleep(0.05)


def metrics(base: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of the /metrics text, the model_name label left out."""
    out = {}
    for line in httpx.get(
        base + "/metrics", timeout=30, headers={"Authorization": "Bearer key-a"}
    ).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            kept = [
                lab
                for lab in labels.rstrip("}").split(",")
                if lab and not lab.startswith("model_name=")
            ]
            out[name + (f"{{{','.join(kept)}}}" if kept else "")] = float(value)
    return out


@pytest.fixture(scope="module")
def reference(bundled):
    """A fresh in-process engine factory with the server's settings."""
    model, tok = bundled

    def make(isolation: str = "tenant") -> Engine:
        return Engine(model, tok, isolation=isolation, secret=SECRET, **ENGINE_KW)
    return make


def _prompts(n: int, start: int = 0) -> list[str]:
    return [
        P.with_question(ex, P.ASK_EN[0]).prompt_text
        for ex in P.make_examples(n, "heldout", start=start)
    ]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_greedy_completions_equal_engine_generate(server, reference, bundled):
    prompts = _prompts(3, start=100)
    ref = reference().generate(prompts, SamplingParams(max_tokens=12))
    c = client(server)
    for prompt, r in zip(prompts, ref):
        full = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
        assert _ids(full.choices[0]) == r.output_ids and full.choices[0].text == r.text
        assert full.choices[0].finish_reason == r.finish_reason
        assert full.usage.prompt_tokens == len(
            r.prompt_ids
        ) and full.usage.completion_tokens == len(r.output_ids)
        chunks = list(
            c.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
        )
        assert sum((_ids(ch.choices[0]) for ch in chunks), []) == r.output_ids
        assert "".join(ch.choices[0].text for ch in chunks) == r.text
        # the first chunk carries the first token
        assert chunks[0].choices[0].model_extra["token_ids"]
        assert chunks[-1].choices[0].finish_reason == r.finish_reason


def test_greedy_chat_equals_engine_generate(server, reference, bundled):
    _, tok = bundled
    ex = P.make_example(7, "heldout")
    messages = ex.messages()
    ids = encode(tok, tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    r = reference().generate([ids], SamplingParams(max_tokens=12))[0]
    c = client(server)
    full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert full.model_extra["prompt_token_ids"] == ids
    assert _ids(full.choices[0]) == r.output_ids and full.choices[0].message.content == r.text
    stream = list(
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert sum((_ids(ch.choices[0]) for ch in stream if ch.choices), []) == r.output_ids
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == r.text
    assert stream[-1].usage.completion_tokens == len(r.output_ids)


def test_seeded_sampling_equals_engine(server, reference):
    prompt = _prompts(1, start=120)[0]
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    r = reference().generate([prompt], sp)[0]
    out = client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert _ids(out.choices[0]) == r.output_ids


def test_stop_strings_cut_the_text_streamed_or_not(server, reference):
    prompt = _prompts(1, start=130)[0]
    r = reference().generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = r.text[2:4]  # inside the answer
    c = client(server)
    full = c.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert (
        full.choices[0].text == r.text[: r.text.index(stop)]
        and full.choices[0].finish_reason == "stop"
    )
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert full.usage.completion_tokens < 12
    assert wait_drained(server)["leaked_blocks"] == 0  # the stopped request was aborted and freed


# (key, cache_salt, question index): one conversation's requests, in order
SHARING = [
    ("key-a", None, 0),
    ("key-a2", None, 1),
    ("key-b", None, 1),
    ("key-a", "s1", 0),
    ("key-a", "s1", 1),
    ("key-b", "s1", 0),
    ("key-b", "s2", 1),
    ("key-b", None, 0),
]


def _sharing_run(c_for, engine: Engine, system: str) -> tuple[list[int], list[int]]:
    """cached_tokens over HTTP and num_cached_tokens in-process for the SHARING sequence."""
    http, local = [], []
    for key, salt, q in SHARING:
        prompt = (
            P.chatml("system", system) + P.chatml("user", P.ASK_EN[q]) + "<|im_start|>assistant\n"
        )
        extra = {} if salt is None else {"cache_salt": salt}
        out = c_for(key).completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra
        )
        http.append(out.usage.prompt_tokens_details.cached_tokens)
        local.append(engine.generate([prompt], SamplingParams(max_tokens=4), tenants=[KEYS[key]],
                                     cache_salts=[salt])[0].num_cached_tokens)
    return http, local


def _system() -> str:
    return "\n".join(
        [f"Session {uuid.uuid4().hex}."] + [P.FILLER_EN[i % len(P.FILLER_EN)] for i in range(6)]
    )


def test_tenants_and_salts_share_exactly_as_the_engine(server, reference):
    http, local = _sharing_run(lambda key: client(server, key), reference("tenant"), _system())
    assert http == local
    # acme's two keys share; globex does not; a salt opens a scope of its own, per tenant
    assert (
        http[0] == 0
        and http[1] > 0
        and http[2] == 0
        and http[3] == 0
        and http[4] > 0
        and http[5] == 0
    )
    assert http[7] > 0  # globex's own unsalted cache from request 3


@pytest.mark.parametrize("isolation", ["shared", "public-prefix"])
def test_other_policies_in_process_match_the_engine(bundled, reference, isolation):
    from starlette.testclient import TestClient

    model, tok = bundled
    system = _system()
    engine, local_engine = (
        Engine(model, tok, isolation=isolation, secret=SECRET, **ENGINE_KW),
        reference(isolation),
    )
    if isolation == "public-prefix":  # the operator shares the system prompt with every tenant
        for e in (engine, local_engine):
            e.add_public_prefix(P.chatml("system", system))
    app = create_app(engine, ServeConfig(model_name=MODEL, api_keys=KEYS))
    with TestClient(app) as http_client:
        def c_for(key):
            return openai.OpenAI(
                base_url="http://testserver/v1", api_key=key, max_retries=0, http_client=http_client
            )

        http, local = _sharing_run(c_for, local_engine, system)
    assert http == local
    if isolation == "shared":
        # everyone shares the unsalted cache; equal salts share across tenants (vLLM)
        assert http[0] == 0 and http[2] > 0 and http[3] == 0 and http[5] > 0 and http[6] == 0
    else:
        # the public system prompt's whole blocks are shared by every tenant and salt, nothing past
        # them
        public = (
            len(encode(tok, P.chatml("system", system)))
            // ENGINE_KW["block_size"]
            * ENGINE_KW["block_size"]
        )
        assert http[0] == 0 and http[2] == http[3] == http[5] == http[6] == public > 0


def test_metrics_counters_equal_the_sums_over_responses(server):
    before = metrics(server)
    c = client(server, "key-b")
    prompts = _prompts(4, start=140)
    usages, reasons = [], []
    for i, prompt in enumerate(prompts + prompts[:2]):  # the repeats hit the cache
        if i % 2:
            chunks = list(
                c.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usages.append(chunks[-1].usage)
            reasons.append(
                next(
                    ch.choices[0].finish_reason
                    for ch in chunks
                    if ch.choices and ch.choices[0].finish_reason
                )
            )
        else:
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            usages.append(out.usage)
            reasons.append(out.choices[0].finish_reason)
    wait_drained(server)
    after = metrics(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    assert delta("kvlab:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvlab:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert delta("kvlab:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert (
        delta("kvlab:prefix_cache_hits_total")
        == sum(u.prompt_tokens_details.cached_tokens for u in usages)
        > 0
    )
    for reason in ("stop", "length"):
        assert delta(f'kvlab:request_success_total{{finished_reason="{reason}"}}') == reasons.count(
            reason
        )
    assert delta("kvlab:time_to_first_token_seconds_count") == len(usages)
    assert after["kvlab:num_requests_running"] == 0


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"prompt": "hi", ', 400, None),  # malformed JSON
        (b"[1, 2]", 400, None),  # not an object
        (b'{"max_tokens": 4}', 400, "prompt"),  # missing
        (b'{"prompt": 5}', 400, "prompt"),  # wrong type
        (b'{"prompt": "hi", "max_tokens": "4"}', 400, "max_tokens"),  # strict: no coercion
        (b'{"prompt": "hi", "temperature": true}', 400, "temperature"),
        (b'{"prompt": ""}', 400, "prompt"),  # empty
        (b'{"prompt": [1, 2, 99999]}', 400, "prompt"),  # outside the vocabulary
        (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 100000000}', 400, "max_tokens"),  # beyond the context
        (
            json.dumps({"prompt": [5] * 1100}).encode(),
            400,
            "prompt",
        ),  # longer than the model's 1024 positions
        (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
        (
            b'{"prompt": "hi", "n": 17}',
            400,
            "n",
        ),  # over the cap (protocol.MAX_N): refused, not clipped
        (b'{"prompt": "hi", "frobnicate": 1}', 400, "frobnicate"),
        (b'{"prompt": "hi", "cache_salt": ""}', 400, "cache_salt"),
        (b'{"prompt": "hi", "temperature": NaN}', 400, None),
        (
            b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            400,
            None,
        ),  # nested past the parser's recursion limit
        (
            b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
            400,
            None,
        ),  # past the int-digit limit
        (b'{"prompt": "\\ud800 hi"}', 400, None),  # a lone surrogate: text no tokenizer can encode
        (b'{"prompt": "hi", "cache_salt": "\\udfff"}', 400, None),
        (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, None),  # over the 1 MiB body limit
    ],
)
def test_bad_input_gets_an_openai_error_and_hurts_nobody(server, body, status, param):
    r = httpx.post(server + "/v1/completions", content=body, timeout=60,
                   headers={"Authorization": "Bearer key-a", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    ok = client(server).completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_chat_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_unknown_or_missing_key_is_refused(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "key-z").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    assert httpx.post(server + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(server + "/v1/models").status_code == 401
    assert [m.id for m in client(server).models.list()] == [MODEL]


def _raw_request(base: str, body: dict, key: str = "key-a") -> socket.socket:
    """Send a POST /v1/completions on a raw socket and leave the answer unread (close it to
    disconnect)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + key.encode()
        + b"\r\nContent-Length: "
        + str(len(data)).encode()
        + b"\r\n\r\n"
        + data
    )
    return sock


LONG = {"prompt": "hello", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}


def wait_in_flight(base: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while debug(base)["server_in_flight"] < n:
        assert time.monotonic() < deadline, "the requests never arrived"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_answer_aborts_and_frees_blocks(server, stream):
    before = metrics(server).get('kvlab:request_success_total{finished_reason="abort"}', 0)
    sock = _raw_request(server, {**LONG, "stream": stream})
    if stream:
        head = b""
        while b"data: " not in head:  # the stream has started: the request holds blocks now
            head += sock.recv(4096)
        assert b" 200 " in head.split(b"\r\n")[0]
    deadline = time.monotonic() + 60
    while debug(server)["blocks_in_use"] == 0:  # admitted and generating
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()  # gone with ~900 tokens still to generate
    rep = wait_drained(server)
    assert rep["leaked_blocks"] == 0 and rep["blocks_in_use"] == 0 and rep["invariants_ok"], rep
    assert rep["orphan_requests"] == 0
    assert metrics(server)['kvlab:request_success_total{finished_reason="abort"}'] == before + 1


def test_full_queue_answers_503_with_retry_after_and_keeps_serving(server):
    # the batch and the wait queue, full
    socks = [_raw_request(server, LONG) for _ in range(8 + MAX_WAITING)]
    try:
        wait_in_flight(server, 8 + MAX_WAITING)
        r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer key-b"}, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "server_error"
    finally:
        for sock in socks:  # running and still-waiting requests alike go away
            sock.close()
    rep = wait_drained(server)
    assert rep["leaked_blocks"] == 0 and rep["blocks_in_use"] == 0 and rep["invariants_ok"], rep
    out = client(server).completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_health_and_models(server):
    assert httpx.get(server + "/health").status_code == 200
    # with API keys, /metrics needs one (issue 53)
    assert httpx.get(server + "/metrics").status_code == 401
    assert (
        "kvlab:prefix_cache_hits_total"
        in httpx.get(server + "/metrics", headers={"Authorization": "Bearer key-a"}).text
    )
    r = httpx.get(server + "/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_engine_loop_failure_fails_requests_and_health(bundled):
    from starlette.testclient import TestClient

    model, tok = bundled
    engine = Engine(model, tok, **ENGINE_KW)

    def broken_step():
        raise RuntimeError("step exploded")
    engine.step = broken_step
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "step exploded" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"


class _CharTokenizer:
    """Token i is the i-th character of ``alphabet``; id 0 is a special token (dropped)."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids if i)


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it():
    from kvlab.serve.text import TextStream

    tok = _CharTokenizer("_abcXY\ufffd")
    ts = TextStream(tok, ["XY"])
    pieces = [ts.push([i]) for i in (1, 4, 2, 4, 5, 3)]
    assert pieces == ["a", "", "Xb", "", "", ""]  # X waits until the next token shows it is no stop
    assert ts.stopped and ts.text == "aXb" and ts.num_tokens_at_stop == 5
    plain = TextStream(tok)  # an incomplete UTF-8 character (U+FFFD) waits for the next token
    assert [plain.push([i]) for i in (1, 0, 6)] == ["a", "", ""] and plain.push(
        [3], final=True
    ) == "\ufffdc"


def test_api_key_table_refuses_bad_files_and_unknown_keys(tmp_path):
    from kvlab.serve.tenancy import AuthError, KeyTable, load_api_keys

    bad = tmp_path / "keys.json"
    for text in ("{not json", "[]", "{}", '{"k": 5}', '{" k": "t"}'):
        bad.write_text(text)
        with pytest.raises(ValueError):
            load_api_keys(bad)
    assert load_api_keys(None, env={}) == {}
    assert load_api_keys(None, env={"KVLAB_API_KEYS": '{"k1": "acme"}'}) == {"k1": "acme"}
    table = KeyTable(KEYS)
    assert (
        table.tenant_for("Bearer key-b") == "globex" and table.tenant_for("bearer key-a2") == "acme"
    )
    for header in (None, "", "Bearer", "Basic key-a", "Bearer key-a-not", "Bearer KEY-A"):
        with pytest.raises(AuthError):
            table.tenant_for(header)
    assert KeyTable({}).tenant_for(None) is None  # open server: the anonymous tenant


@pytest.mark.parametrize("cache", ["blocks", "radix"])
def test_debug_report_reads_any_cache_through_the_interface(bundled, cache):
    """``/debug/engine``'s report counts blocks through the cache interface, so a radix engine
    reports too."""
    from kvlab.serve.debug import engine_report

    model, tok = bundled
    engine = Engine(model, tok, num_blocks=32, block_size=4, cache=cache)
    seq_prompt = encode(tok, "你好，世界，口令是什么")
    engine.add_request(seq_prompt, SamplingParams(max_tokens=3), request_id="r")
    engine.step()
    busy = engine_report(engine)
    assert busy["invariants_ok"] and busy["blocks_in_use"] > 0 and busy["leaked_blocks"] == 0, busy
    # radix: pages
    assert busy["num_blocks"] == engine.block_manager.num_blocks and busy["live_requests"] == 1
    while engine.has_unfinished():
        engine.step()
    idle = engine_report(engine)
    assert (
        idle["blocks_in_use"] == 0 and idle["leaked_blocks"] == 0 and idle["live_requests"] == 0
    ), idle
