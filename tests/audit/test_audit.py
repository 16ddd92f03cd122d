"""kvlab.audit: the procedure's logic on a simulated cache (no timing involved), the CLI's input
checks, and the audit and the dictionary attack against a live ``kvlab serve`` on the bundled model
over loopback."""

import json
import os
import random

import pytest

from kvlab.audit import (
    AuditConfig,
    Endpoint,
    Guess,
    Level,
    Timing,
    accuracy,
    chance_pvalue,
    make_template,
    miss_prompt,
    power,
    run_audit,
    run_dictionary_attack,
    samples_to_detect,
)
from kvlab.audit.__main__ import main as audit_main
from kvlab.audit.prompts import letters_for, prompt_pair

URL = "http://127.0.0.1:9/v1"


# ----------------------------------------------------------------------------- prompts and inputs
def test_prompt_pair_shares_exactly_the_prefix_fraction():
    rng = random.Random(0)
    v, a = prompt_pair(rng, 100, 0.9, head="S: ")
    assert v.startswith("S: ") and a.startswith("S: ")
    vl, al = v[3:].split(" "), a[3:].split(" ")
    assert len(vl) == len(al) == 100 and vl[:90] == al[:90] and vl[90:] != al[90:]
    assert prompt_pair(random.Random(1), 10, 1.0)[0] == prompt_pair(random.Random(1), 10, 1.0)[1]
    assert letters_for(600, 1.5) == 400
    miss = miss_prompt(rng, 5, head="a b c", head_in_miss=False)
    assert len(miss.split(" ")) == 8 and not miss.startswith("a b c ")


@pytest.mark.parametrize(
    "bad",
    [
        dict(prompt_tokens=0),
        dict(prefix_fraction=1.5),
        dict(victim_requests=0),
        dict(samples=1),
        dict(alpha=0.0),
        dict(alpha=1.0),
        dict(prompt_tokens=2.5),
    ],
)
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        AuditConfig(**bad)


def test_endpoint_checks_and_joins_urls():
    with pytest.raises(ValueError, match="http"):
        Endpoint("localhost:8000")
    with pytest.raises(ValueError, match="api_key"):
        Endpoint(URL, api_key="")
    assert Endpoint("http://h:1/v1/").url("/v1/completions") == "http://h:1/v1/completions"
    assert Endpoint("http://h:1").url("/v1/models") == "http://h:1/v1/models"
    assert (
        Endpoint(URL, "k").headers() == {"Authorization": "Bearer k"}
        and Endpoint(URL).headers() == {}
    )


# ----------------------------------------------------------------------------- the procedure on a
# simulated server
class SimulatedServer:
    """A block prefix cache per scope; a probe's 'TTFT' is 1 ms per uncached spaced letter plus
    fixed jitter."""

    def __init__(self, block: int = 4, scope=lambda ep: ep.cache_salt, seed: int = 0):
        self.block, self.scope, self.rng = block, scope, random.Random(seed)
        self.cached: dict[object, set[tuple[str, ...]]] = {}

    def __call__(self, ep: Endpoint, prompt: str) -> Timing:
        words = tuple(prompt.split(" "))
        blocks = self.cached.setdefault(self.scope(ep), set())
        hit = 0
        while hit + self.block <= len(words) - 1 and words[: hit + self.block] in blocks:
            hit += self.block
        for end in range(self.block, len(words) + 1, self.block):
            blocks.add(words[:end])
        return Timing(1e-3 * (len(words) - hit) + 1e-3 * self.rng.random(), len(words), hit)


def test_audit_detects_a_shared_simulated_cache_and_not_a_salted_one():
    sim = SimulatedServer()
    cfg = AuditConfig(prompt_tokens=64, samples=12, alpha=1e-3)
    shared = run_audit(
        Level("global", Endpoint(URL, model="m"), Endpoint(URL, model="m")), cfg, probe=sim
    )
    salted = run_audit(
        Level(
            "salted",
            Endpoint(URL, model="m", cache_salt="a"),
            Endpoint(URL, model="m", cache_salt="b"),
        ),
        cfg,
        probe=sim,
    )
    assert shared.detected and shared.pvalue < 1e-3 and shared.statistic == 1.0
    assert not salted.detected and salted.pvalue > 1e-3
    assert all(c >= 56 for c in shared.hit_cached) and all(
        c == 0 for c in salted.hit_cached + salted.miss_cached
    )
    assert len(shared.hit) == len(shared.miss) == 12 and shared.row()["detected"] is True


def test_the_cached_note_flags_a_detection_the_server_served_uncached():
    from kvlab.audit import AuditResult

    def result(p, hit_cached):
        return AuditResult("global", [0.01] * 3, [0.05] * 3, 1.0, p, 1e-3, hit_cached, [0] * 3)

    # hits served from the cache and detected: the report agrees
    agree = result(1e-5, [480, 496, 480]).cached_note()
    assert agree == "server-reported cached tokens (hit median) 480"
    # detected, yet every hit uncached: timing and report disagree, and the note says so
    assert "disagree" in result(1e-5, [0, 0, 0]).cached_note()
    # not detected and uncached: nothing to flag
    assert result(0.5, [0, 0, 0]).cached_note() == "server-reported cached tokens (hit median) 0"
    # a server that reports nothing: no note
    assert result(1e-5, [None] * 3).cached_note() == ""


def test_power_rises_with_samples_and_samples_to_detect():
    rng = random.Random(0)
    hit, miss = [rng.gauss(1.0, 1.0) for _ in range(40)], [rng.gauss(2.5, 1.0) for _ in range(40)]
    rows = power(hit, miss, [4, 40], alpha=1e-3, reps=50)
    assert rows[0]["power"] < 0.5 and rows[1]["power"] == 1.0
    res = run_audit(
        Level("x", Endpoint(URL, model="m"), Endpoint(URL, model="m")),
        AuditConfig(prompt_tokens=64, samples=12),
        probe=SimulatedServer(),
    )
    # the fewest samples for which an exact KS p-value can be < 1e-3
    assert samples_to_detect(res, reps=20) == 7
    with pytest.raises(ValueError, match="outside"):
        power(hit, miss, [41], alpha=0.01)


def test_dictionary_guess_is_the_fastest_and_chance_is_tested():
    g = Guess("B", ("A", "B", "C"), (0.03, 0.01, 0.02), (0, 8, 0))
    assert (
        g.guess == "B"
        and g.correct
        and accuracy([g, Guess("A", ("A", "B"), (0.2, 0.1), (0, 0))]) == 0.5
    )
    assert (
        chance_pvalue([g] * 10) < 1e-4
        and chance_pvalue([Guess("A", ("A", "B"), (0.2, 0.1), (0, 0))] * 10) == 1.0
    )


def test_dictionary_attack_on_a_simulated_cache():
    tpl = make_template(16, 16)
    v, a = Endpoint(URL, model="m"), Endpoint(URL, model="m")
    found = run_dictionary_attack(
        v, a, 4, 6, tpl, probe=SimulatedServer(block=4, scope=lambda ep: None)
    )
    blind = run_dictionary_attack(
        v, a.with_salt("attacker"), 4, 6, tpl, probe=SimulatedServer(block=4)
    )
    assert accuracy(found) == 1.0
    assert all(len(set(g.cached)) == 1 for g in blind)  # salted: every candidate served alike


# ----------------------------------------------------------------------------- the CLI's input
# checks
def test_cli_refuses_bad_input_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "out.json"
    out.write_text("keep")
    assert audit_main(["--base-url", URL, "--json", str(out)]) == 2
    assert out.read_text() == "keep" and "exists" in capsys.readouterr().err
    keys = tmp_path / "keys.txt"
    keys.write_text("")
    assert audit_main(["--base-url", URL, "--keys-file", str(keys)]) == 2
    assert "holds no key" in capsys.readouterr().err and keys.read_text() == ""
    assert audit_main(["--base-url", URL, "--keys", "a", "--keys-file", str(keys)]) == 2
    assert audit_main(["--base-url", "localhost", "--model", "m"]) == 2
    assert "http" in capsys.readouterr().err
    assert audit_main(["--base-url", URL, "--model", "m"]) == 2  # nobody listens on port 9
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------- a fake server (httpx.MockTransport)
GOOD_MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}


def _sse(*events) -> bytes:
    """A streamed completion's body: one ``data:`` line per event (JSON unless already text), then
    [DONE]."""
    return b"".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
        for e in (*events, "[DONE]")
    )


def _good_stream(prompt: str) -> bytes:
    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": 1,
             "prompt_tokens_details": {"cached_tokens": 0}}
    return _sse(
        {"choices": [{"index": 0, "text": "x", "finish_reason": None}]},
        {"choices": [], "usage": usage},
    )


class FakeServer:
    """An OpenAI-compatible server in a MockTransport: good answers unless ``models`` or ``stream``
    say otherwise."""

    def __init__(self, models=GOOD_MODELS, stream=None):
        self.models, self.stream, self.requests = models, stream, []

    def __call__(self, request):
        import httpx

        self.requests.append(request)
        if request.url.path.endswith("/models"):
            body = (
                self.models if isinstance(self.models, bytes) else json.dumps(self.models).encode()
            )
            return httpx.Response(200, content=body, headers={"content-type": "application/json"})
        prompt = json.loads(request.content)["prompt"]
        body = _good_stream(prompt) if self.stream is None else self.stream
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


@pytest.fixture
def fake(serve_with):
    """Every ``httpx.Client`` the audit opens talks to a ``FakeServer`` (set its
    ``models``/``stream`` to misbehave)."""
    return serve_with(FakeServer())


@pytest.mark.parametrize("models, field", [
    ([{"id": "m"}], "the body"),  # the list itself, not {"data": [...]}
    ({"object": "list"}, "data"),  # no data
    ({"data": [{"object": "model"}]}, "data.0.id"),  # no id
    ({"data": [{"id": 7}]}, "data.0.id"),  # an id that is not a string
    ({"data": "m"}, "data"),
    (b"<html>not json</html>", "not JSON"),
])
def test_models_of_the_wrong_shape_are_a_clear_error(fake, models, field):
    from kvlab.audit import AuditHTTPError, first_model

    fake.models = models
    with pytest.raises(AuditHTTPError, match="GET /v1/models answered") as e:
        first_model(Endpoint(URL, "k"))
    assert field in str(e.value)


@pytest.mark.parametrize(
    "events, field",
    [
        ([{"choices": [{"text": "x"}], "usage": "12"}], "usage"),  # usage a string
        (
            [{"choices": [{"text": "x"}], "usage": {"prompt_tokens": -3}}],
            "usage.prompt_tokens",
        ),  # negative
        (
            [{"choices": [{"text": "x"}], "usage": {"prompt_tokens": "12"}}],
            "usage.prompt_tokens",
        ),  # a digit string
        (
            [
                {
                    "choices": [],
                    "usage": {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": -1}},
                }
            ],
            "usage.prompt_tokens_details.cached_tokens",
        ),
        ([[{"choices": [{"text": "x"}]}]], "the body"),  # the chunk a list
        ([{"choices": "x"}], "choices"),
        ([{"choices": [5]}], "choices.0"),
    ],
)
def test_stream_chunks_of_the_wrong_shape_are_a_clear_error(fake, events, field):
    from kvlab.audit import AuditHTTPError, measure

    fake.stream = _sse(*events)
    with pytest.raises(
        AuditHTTPError, match="the stream of POST /v1/completions answered JSON of the wrong"
    ) as e:
        measure(Endpoint(URL, "k", "m"), "a b c")
    assert f"{field}:" in str(e.value)


def test_a_good_fake_server_is_read_and_an_error_event_is_reported(fake):
    from kvlab.audit import AuditHTTPError, first_model, measure

    assert first_model(Endpoint(URL, "k")) == "m"
    t = measure(Endpoint(URL, "k", "m"), "a b c")
    assert t.ttft > 0 and t.prompt_tokens == 3 and t.cached_tokens == 0
    fake.stream = _sse({"choices": [{"text": "x"}]}, {"choices": [], "usage": None})
    # no usage: nothing claimed
    assert measure(Endpoint(URL, "k", "m"), "a b").prompt_tokens is None
    fake.stream = _sse({"error": {"message": "boom", "type": "server_error"}})
    with pytest.raises(AuditHTTPError, match="boom"):
        measure(Endpoint(URL, "k", "m"), "a b")


@pytest.mark.parametrize("models, stream", [([{"id": "m"}], None), (GOOD_MODELS, _sse([1, 2]))])
def test_cli_reports_a_wrong_shape_without_a_traceback(fake, capsys, models, stream):
    fake.models, fake.stream = models, stream
    assert (
        audit_main(["--base-url", URL, "--keys", "k", "--samples", "2", "--prompt-tokens", "8"])
        == 2
    )
    assert "wrong shape" in capsys.readouterr().err


AUDIT = ["--base-url", URL, "--samples", "2", "--prompt-tokens", "8"]


def test_cli_writes_json_after_a_whole_audit_of_the_fake_server(fake, tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert audit_main([*AUDIT, "--keys", "k", "--json", str(out)]) == 0
    assert [r["sharing level"] for r in json.loads(out.read_text())["rows"]] == [
        "per-user (same key)"
    ]
    # the fake server reports 0 cached tokens: the line says what it reported
    assert "server-reported cached tokens (hit median) 0" in capsys.readouterr().out
    assert audit_main([*AUDIT, "--keys", "k", "--json", str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("where, overwrite, message", [
    ("missing/audit.json", False, "does not exist"),  # a folder that is not there
    ("missing/audit.json", True, "does not exist"),
    (".", True, "is a folder"),  # onto a folder
    (".", False, "is a folder"),
])
def test_cli_checks_the_json_target_before_measuring(
    fake, tmp_path, capsys, where, overwrite, message
):
    target = tmp_path / where
    rc = audit_main(
        [*AUDIT, "--keys", "k", "--json", str(target)] + (["--overwrite"] if overwrite else [])
    )
    assert rc == 2 and message in capsys.readouterr().err
    assert fake.requests == []  # refused before a single request: nothing measured, nothing lost


@pytest.mark.parametrize("link", [False, True])
def test_cli_never_writes_over_its_keys_file(fake, tmp_path, capsys, link):
    keys = tmp_path / "k.txt"
    keys.write_text("key-one\n")
    target = keys
    if link:  # another name of the same file
        target = tmp_path / "results.json"
        target.symlink_to(keys)
    rc = audit_main([*AUDIT, "--keys-file", str(keys), "--json", str(target), "--overwrite"])
    assert rc == 2 and "never writes over an input" in capsys.readouterr().err
    assert keys.read_text() == "key-one\n" and fake.requests == []


# ----------------------------------------------------------------------------- live: kvlab serve on
# the bundled model
KEYS = {"key-alice": "org-a", "key-alice-2": "org-a", "key-bob": "org-b"}
# robust on a busy machine
LIVE = AuditConfig(prompt_tokens=800, prefix_fraction=0.95, samples=30, alpha=1e-3, seed=0)
# NULL_TIMING: where nothing is shared, the tests check what the server reports (no cached token),
# not that the timing test stays quiet. On a quiet machine 16 audits of the tenant server's
# cross-org level (seeds 0-15) gave p-values from 0.24 to 0.96, but under CI's two test workers one
# gave p = 0.0009 with every probe uncached (the cause was not established; a simulated load of
# bursts did not raise the false-alarm rate): on a busy machine a null level can cross alpha.
# Detection is still asserted on timing: on the shared server (seeds 0-2, quiet machine) hits took
# 15-29 ms but for one outlier, misses 48-89 ms, p below 1e-14, with 704-768 tokens cached.


def _endpoints(server, model="kvlab-passphrase-qwen2"):
    return {k: Endpoint(server.base_url, k, model, name=k) for k in KEYS}


@pytest.fixture(scope="module")
def servers():
    """A shared and a tenant-isolated kvlab serve on the bundled model, started together."""
    from kvlab.audit.local import start_kvlab

    started = {mode: start_kvlab(None, mode, KEYS) for mode in ("shared", "tenant")}
    try:
        yield {mode: s.wait_ready() for mode, s in started.items()}
    finally:
        for s in started.values():
            s.close()


@pytest.fixture(scope="module")
def shared_server(servers):
    return servers["shared"]


@pytest.fixture(scope="module")
def ratio(shared_server):
    from kvlab.audit import calibrate

    return calibrate(_endpoints(shared_server)["key-alice"])


def test_audit_detects_global_sharing_and_not_per_user_salts(shared_server, ratio):
    ep = _endpoints(shared_server)
    cfg = AuditConfig(**{**vars(LIVE), "tokens_per_letter": ratio})
    shared = run_audit(Level("global", ep["key-alice"], ep["key-bob"]), cfg)
    salted = run_audit(
        Level("salted", ep["key-alice"].with_salt("alice"), ep["key-bob"].with_salt("bob")), cfg
    )
    assert shared.pvalue < cfg.alpha and shared.detected, shared.row()
    # what the server says agrees: the hits were served from the victim's blocks, the salted ones
    # never. Whether the timing test stays quiet on the salted level is not asserted (NULL_TIMING)
    assert min(shared.hit_cached) > 0.8 * shared.prompt_tokens and set(salted.hit_cached) == {0}
    assert 0 <= salted.pvalue <= 1


def test_dictionary_attack_finds_the_passphrase_unsalted_and_is_at_chance_salted(
    shared_server, ratio
):
    ep = _endpoints(shared_server)
    # the right guess gains ~400 cached tokens: clear of timing noise
    tpl = make_template(64, 400, ratio)
    found = run_dictionary_attack(
        ep["key-alice"], ep["key-bob"], 4, 10, tpl, tokens_per_letter=ratio, seed=1
    )
    blind = run_dictionary_attack(
        ep["key-alice"].with_salt("alice"),
        ep["key-bob"].with_salt("bob"),
        4,
        10,
        tpl,
        tokens_per_letter=ratio,
        seed=1,
    )
    assert chance_pvalue(found) < 0.01 and accuracy(found) > 0.25, [g.ttfts for g in found]
    # every candidate had the same cached tokens: nothing to learn (the blind attack's timing is
    # not asserted: NULL_TIMING)
    assert all(len(set(g.cached)) == 1 for g in blind)
    assert 0 <= chance_pvalue(blind) <= 1


def test_cli_on_the_live_server(shared_server, tmp_path, capsys):
    out = tmp_path / "audit.json"
    rc = audit_main(
        [
            "--base-url",
            shared_server.base_url,
            "--keys",
            "key-alice",
            "key-bob",
            "--levels",
            "global",
            "--samples",
            "10",
            "--prompt-tokens",
            "400",
            "--json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    # the decisions themselves are tested above, with more samples
    rows = json.loads(out.read_text())["rows"]
    assert [r["sharing level"] for r in rows] == ["per-user (same key)", "global"]
    assert all(
        r["samples"] == 10 and 0 <= r["p-value"] <= 1 and r["prompt tokens"] > 300 for r in rows
    )
    assert "sharing level" not in capsys.readouterr().err


def test_tenant_isolation_shares_within_an_org_only(servers, ratio):
    ep = _endpoints(servers["tenant"])
    cfg = AuditConfig(**{**vars(LIVE), "tokens_per_letter": ratio})
    org = run_audit(Level("per-org", ep["key-alice"], ep["key-alice-2"]), cfg)
    other = run_audit(Level("global", ep["key-alice"], ep["key-bob"]), cfg)
    assert org.pvalue < cfg.alpha and org.detected, org.row()
    assert min(org.hit_cached) > 0.8 * org.prompt_tokens, org.row()
    # across orgs nothing is shared: the server served every probe from scratch (NULL_TIMING)
    assert set(other.hit_cached) == {0} and 0 <= other.pvalue <= 1, other.row()


# ----------------------------------------------------------------------------- notebook 10's lesson
# module
def test_nb10_checkers_and_solutions():
    from kvlab.lessons import nb10_audit as L
    from kvlab.lessons import solutions as SOL

    assert (
        L.check_min_samples(SOL.ex10_1_min_samples(1e-3), 1e-3)
        and SOL.ex10_1_min_samples(1e-3) == 7
    )
    assert L.check_right_guess_gain(SOL.ex10_2_right_guess_gain(), 100, 5, 40, 32)
    assert L.check_right_guess_gain(SOL.ex10_2_right_guess_gain(block_size=64), 100, 5, 40, 64)
    for blank in (L.check_min_samples(None), L.check_right_guess_gain(None, 100, 5, 40, 32)):
        assert not blank and "no answer yet" in str(blank)
    wrong = L.check_right_guess_gain(45, 100, 5, 40, 32)
    assert not wrong and "32" not in str(wrong) and "7" not in str(L.check_min_samples(6))
    assert not L.check_min_samples("seven")


def test_nb10_record_round_trip_and_table_rows(tmp_path):
    from kvlab.built import nb10 as B

    assert B.load_record(tmp_path) is None
    B.save_record({"rows": [{"p-value": 0.5}], "model": "m"}, tmp_path)
    rec = B.load_record(tmp_path)
    assert (
        rec["rows"] == [{"p-value": 0.5}]
        and rec["recorded_at"]
        and rec["path"].endswith("audit_vllm.json")
    )
    rows = B.table_rows({m: URL for m in B.MODES}, "m", "System: a b\n")
    assert len(rows) == 9 and sum(r.expect for r in rows) == 5
    assert {r.attacker.cache_salt for r in rows if r.isolation == "per-user cache_salt"} == {
        "carol",
        "bob",
    }
    assert [r.expect for r in B.vllm_rows(URL, "m")] == [True, False]


def test_notebook_10_exercises_start_blank():
    from pathlib import Path

    nb = json.loads(
        (
            Path(__file__).resolve().parents[2] / "notebooks" / "10_is_this_endpoint_sharing.ipynb"
        ).read_text()
    )
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any("min_samples = None" in s for s in sources) and any(
        "right_guess_gain = None" in s for s in sources
    )


def test_a_server_that_dies_is_reported_with_its_log():
    import sys

    from kvlab.audit.local import ServerError, ServerProcess, free_port

    server = ServerProcess(
        [sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"],
        free_port(),
        timeout=60,
    )
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*boom: no model"):
        server.wait_ready()
    assert server.proc.poll() == 3 and not server.workdir.exists()


def _vllm_missing() -> str | None:
    from kvlab.lessons.nb06_vllm import vllm_found

    found, why = vllm_found()
    return None if found else why


@pytest.mark.skipif(
    os.environ.get("KVLAB_VLLM_SERVE_TESTS") != "1",
    reason="starts vllm serve (about 90 s): set KVLAB_VLLM_SERVE_TESTS=1; "
    "notebook 10's full run does it live",
)
@pytest.mark.skipif(_vllm_missing() is not None, reason=f"no vLLM venv: {_vllm_missing()}")
def test_vllm_serve_shares_without_cache_salt_and_not_with_per_user_salts(tmp_path):
    """The notebook's live vLLM path (start, audit, record), on the bundled model folder; about a
    minute of start-up."""
    from kvlab.audit.local import start_vllm
    from kvlab.built import nb10 as L
    from kvlab.engine.models import BUNDLED_MODEL

    server = start_vllm(BUNDLED_MODEL, max_model_len=1024)
    try:
        table, path = L.vllm_audit(server, LIVE, root=tmp_path)
    finally:
        server.close()
    shared, salted = table
    assert (
        shared["detected"]
        and shared["p-value"] < LIVE.alpha
        and shared["cached tokens (server, hit median)"] > 0
    ), shared
    assert (
        not salted["detected"]
        and salted["p-value"] > LIVE.alpha
        and salted["cached tokens (server, hit median)"] == 0
    ), salted
    assert L.load_record(tmp_path)["rows"] == json.loads(json.dumps(table)) and path.startswith(
        str(tmp_path)
    )
