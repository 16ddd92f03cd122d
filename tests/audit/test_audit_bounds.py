"""kvlab.audit's inputs are bounded (issue 53, N9-N11): key files, keys, and limits against the
server's context.

Every refusal is one line on stderr, exit 2, before a single request (a fake server in an
httpx.MockTransport counts them).
"""

import json
import os

import pytest

from kvlab.audit.__main__ import main as audit_main

URL = "http://127.0.0.1:9/v1"


class FakeServer:
    """``GET /v1/models`` (advertising ``max_model_len``) and a one-token stream for every
    completion."""

    def __init__(self, max_model_len=1024):
        self.max_model_len, self.requests = max_model_len, []

    def __call__(self, request):
        import httpx

        self.requests.append(request)
        if request.url.path.endswith("/models"):
            card = {"id": "m", "object": "model"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return httpx.Response(200, json={"object": "list", "data": [card]})
        usage = {
            "prompt_tokens": len(json.loads(request.content)["prompt"].split()),
            "completion_tokens": 1,
        }
        body = "".join(
            f"data: {json.dumps(e)}\n\n"
            for e in ({"choices": [{"text": "x"}]}, {"choices": [], "usage": usage})
        )
        return httpx.Response(200, content=(body + "data: [DONE]\n\n").encode(),
                              headers={"content-type": "text/event-stream"})


@pytest.fixture
def fake(serve_with):
    """Every ``httpx.Client`` the audit opens talks to a ``FakeServer``."""
    return serve_with(FakeServer())


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


# --- N9: a keys file that is not a regular file, or too big ---------------------------------------
def test_keys_file_that_is_not_a_regular_file_is_refused_by_name(fake, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, what in [
        ("/dev/zero", "character device"),
        (str(tmp_path), "folder"),
        (str(fifo), "FIFO"),
    ]:
        assert audit_main(["--base-url", URL, "--keys-file", path]) == 2
        err = _one_line(capsys)
        assert path in err and what in err
    assert fake.requests == []


def test_a_huge_keys_file_is_refused_by_its_size(fake, tmp_path, capsys):
    big = tmp_path / "keys.txt"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of zero bytes
    assert audit_main(["--base-url", URL, "--keys-file", str(big)]) == 2
    assert "bytes" in _one_line(capsys) and fake.requests == []


# --- N10: a key an HTTP header cannot carry; a BOM ------------------------------------------------
def test_a_non_ascii_key_is_one_line_naming_the_key(fake, tmp_path, capsys):
    assert audit_main(["--base-url", URL, "--keys", "good", "clé"]) == 2
    err = _one_line(capsys)
    assert "key 2" in err and "U+00E9" in err
    keys = tmp_path / "keys.txt"
    keys.write_text("good\nsecond\nk€y\n", encoding="utf-8")
    assert audit_main(["--base-url", URL, "--keys-file", str(keys)]) == 2
    err = _one_line(capsys)
    # named by place, the secret not echoed
    assert "line 3" in err and "U+20AC" in err and "k€y" not in err
    keys.write_bytes(b"\xff\xfe\x00")
    assert audit_main(["--base-url", URL, "--keys-file", str(keys)]) == 2
    assert "UTF-8" in _one_line(capsys)
    assert fake.requests == []


def test_a_keys_file_with_a_bom_reads_its_first_key(fake, tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"\xef\xbb\xbfkey-one\r\nkey-two\n")
    assert (
        audit_main(
            ["--base-url", URL, "--keys-file", str(keys), "--samples", "2", "--prompt-tokens", "8"]
        )
        == 0
    )
    auth = {r.headers.get("authorization") for r in fake.requests}
    assert auth == {"Bearer key-one", "Bearer key-two"}


# --- N11: limits against the advertised context, before any request that measures -----------------
@pytest.mark.parametrize("option, value, word", [
    ("--samples", 10**12, "--samples"),
    ("--victim-requests", 10**9, "--victim-requests"),
    ("--prompt-tokens", 10**9, "--prompt-tokens"),
])
def test_huge_counts_are_refused_before_measuring(fake, capsys, option, value, word):
    assert audit_main(["--base-url", URL, "--keys", "k", option, str(value)]) == 2
    assert word in _one_line(capsys)
    # at most the model list was read
    assert all(r.url.path.endswith("/models") for r in fake.requests)


def test_prompt_tokens_are_checked_against_max_model_len(fake, capsys):
    fake.max_model_len = 64
    assert audit_main(["--base-url", URL, "--keys", "k", "--prompt-tokens", "64"]) == 2
    err = _one_line(capsys)
    assert "max_model_len" in err and "64" in err
    assert all(r.url.path.endswith("/models") for r in fake.requests)
    fake.requests.clear()
    assert (
        audit_main(["--base-url", URL, "--keys", "k", "--prompt-tokens", "8", "--samples", "2"])
        == 0
    )
    assert len(fake.requests) > 1
