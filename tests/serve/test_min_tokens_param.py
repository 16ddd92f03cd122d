"""A ``min_tokens`` above the request's ``max_tokens`` is refused with OpenAI's ``param`` naming it.

The engine's ``SamplingParams`` refuses ``min_tokens > max_tokens`` as a check across two fields;
its ``RequestError`` then names no field when ``min_tokens`` alone would pass (at most the default
``max_tokens`` of 16), and the server answered ``"param": null``. Every other sampling-parameter
error names its parameter, so this one must too.
"""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from kvlab.engine import Engine  # noqa: E402
from kvlab.serve import ServeConfig, create_app  # noqa: E402

MODEL = "kvlab-passphrase-qwen2"


@pytest.fixture(scope="module")
def client(bundled):
    model, tok = bundled
    engine = Engine(model, tok, num_blocks=64, block_size=16, max_num_seqs=4)
    with TestClient(create_app(engine, ServeConfig(model_name=MODEL))) as c:
        yield c


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", dict(prompt="Hello", max_tokens=4, min_tokens=8)),
        ("/v1/completions", dict(prompt="Hello", max_tokens=4, min_tokens=16)),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2, min_tokens=3),
        ),
    ],
)
def test_min_tokens_over_max_tokens_names_min_tokens(client, path, body):
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "min_tokens", err
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value", err
    # the engine's message, unchanged
    assert err["message"] == (
        f"min_tokens must be an int in [0, max_tokens], got {body['min_tokens']}"
    ), err


def test_min_tokens_within_max_tokens_is_served(client):
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "min_tokens": 4},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
