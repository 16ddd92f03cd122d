"""kvlab.doctor on bad input: every bad line is named by its real line number and skipped, the input
is never written, --out is checked before the work, and the exit status says whether anything was
replayed.

Token-id logs (no tokenizer) and the CLI's ``main`` called in-process keep these fast."""

import json
import random

import pytest

from kvlab.doctor import core, diagnose, read_log, write_report
from kvlab.doctor.__main__ import main
from kvlab.doctor.outdir import MANIFEST, OutDirError

GOOD = json.dumps({"token_ids": list(range(1, 40))})


def write(path, lines: list[str | bytes]) -> str:
    """Lines joined with b"\\n" (str lines as UTF-8); the path as a str."""
    path.write_bytes(b"".join((x.encode() if isinstance(x, str) else x) + b"\n" for x in lines))
    return str(path)


def span_log(n: int = 40) -> list[str]:
    """A token-id log with a per-request span after a shared head: the doctor finds culprits and
    fixed logs."""
    rng = random.Random(5)
    head, rest = [rng.randrange(500) for _ in range(20)], [rng.randrange(500) for _ in range(120)]
    return [
        json.dumps({"token_ids": head + [600 + i, 700 + i % 50, 800] + rest, "user": f"u{i}"})
        for i in range(n)
    ]


def test_deeply_nested_line_is_named_and_skipped(tmp_path):
    path = write(
        tmp_path / "log.jsonl",
        [
            GOOD,
            "[" * 100_000 + "]" * 100_000,
            GOOD,
            '{"token_ids": ' + "[" * 70 + "1" + "]" * 70 + "}",
        ],
    )
    d = diagnose(path, block_sizes=(4,))
    assert d.requests == 2 and [b.line for b in d.bad] == [2, 4]
    assert all("nested deeper than 64" in b.error for b in d.bad)


def test_5000_digit_token_id_is_named_and_skipped(tmp_path):
    path = write(tmp_path / "log.jsonl", [GOOD, '{"token_ids": [' + "9" * 5000 + "]}", GOOD])
    d = diagnose(path, block_sizes=(4,))
    assert d.requests == 2 and [b.line for b in d.bad] == [2]
    assert "4300 digits" in d.bad[0].error and "set_int_max_str_digits" not in d.bad[0].error


def test_bytes_that_are_not_utf8_make_the_line_malformed_never_replaced(tmp_path):
    # two prompts that differ only in one byte: replaced by U+FFFD both, they would replay as one
    # shared prefix
    prompt = b'{"prompt": "The answer is %s and then a long text that the two requests share"}'
    path = write(tmp_path / "log.jsonl", [prompt % b"\xff", prompt % b"\xfe", GOOD])
    d = diagnose(path, block_sizes=(4,))
    assert d.requests == 1 and [b.line for b in d.bad] == [1, 2]
    assert "not UTF-8 text (byte 0xff at byte 27)" in d.bad[0].error and "0xfe" in d.bad[1].error


def test_a_stray_carriage_return_does_not_shift_line_numbers(tmp_path):
    # line 2 holds a \r before its last brace (JSON whitespace: one request, not two broken lines),
    # line 3 ends with \r\n (Windows), line 5 is bad
    path = write(
        tmp_path / "log.jsonl", [GOOD, GOOD[:-1] + "\r}", GOOD + "\r", GOOD, "not json", GOOD]
    )
    records, bad = read_log(path)
    assert [r.line for r in records] == [1, 2, 3, 4, 6] and [b.line for b in bad] == [5]


@pytest.mark.parametrize(
    "line, words",
    [
        (
            '{"prompt": "a \\ud800 b"}',
            "lone surrogate",
        ),  # the tokenizer and a UTF-8 writer both fail on it
        ('{"token_ids": [1, 2, 3], "timestamp": NaN}', "NaN is not JSON"),
        (
            '{"token_ids": [1, 2, 3], "user": {"id": 7}}',
            "'user' is dict",
        ),  # the culprit search hashes users
        ('{"token_ids": [1, 2, 3], "session": [7]}', "'session' is list"),
        (
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": "f"}]}',
            "tools[0].function is str",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": null}]}',
            "tools[0].function is NoneType",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
            "messages[0].content[0] is not a text part",
        ),
    ],
)
def test_values_the_analysis_cannot_use_are_bad_lines(tmp_path, line, words):
    path = write(tmp_path / "log.jsonl", [GOOD, line])
    records, bad = read_log(path)
    assert len(records) == 1 and [b.line for b in bad] == [2] and words in bad[0].error


def test_out_inside_a_previous_report_never_writes_the_input(tmp_path, capsys):
    log = write(tmp_path / "log.jsonl", span_log() + ["not json"])
    out = tmp_path / "report"
    assert main([log, "--block-size", "16", "--out", str(out), "--quiet"]) == 0
    fixed = out / "fixed" / "all_fixes.jsonl"
    before = fixed.read_bytes()
    fixed.write_bytes(before + b"not json either\n")  # a line the doctor would not write back
    before = fixed.read_bytes()
    assert main([str(fixed), "--block-size", "16", "--out", str(out), "--quiet"]) == 2
    assert "holds the input" in capsys.readouterr().err
    assert fixed.read_bytes() == before
    with pytest.raises(OutDirError, match="holds the input"):  # the API refuses it too
        write_report(diagnose(str(fixed), block_sizes=(16,)), out)
    assert fixed.read_bytes() == before


def test_out_leaves_no_stale_files_of_an_earlier_run(tmp_path, capsys):
    out = tmp_path / "report"
    assert (
        main(
            [
                write(tmp_path / "a.jsonl", span_log()),
                "--block-size",
                "16",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    first = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert any(f.startswith("fixed/01_") for f in first) and "divergence.png" in first
    (out / "notes.txt").write_text("mine")  # a file of the user's beside the report: left alone
    assert (
        main(
            [write(tmp_path / "b.jsonl", [GOOD]), "--block-size", "4", "--out", str(out), "--quiet"]
        )
        == 0
    )
    now = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert (
        not any(f.startswith("fixed/01_") for f in now)
        and (out / "notes.txt").read_text() == "mine"
    )
    listed = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(listed + [MANIFEST, "notes.txt"]) == now
    # a folder of other files (no manifest) is refused, before the analysis
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text("{}")
    assert main([write(tmp_path / "c.jsonl", [GOOD]), "--out", str(other)]) == 2
    assert "files the doctor did not write" in capsys.readouterr().err
    assert (other / "summary.json").read_text() == "{}"


def test_out_naming_a_file_fails_before_the_analysis(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(core, "diagnose", lambda *a, **k: pytest.fail("the analysis ran"))
    target = tmp_path / "taken.txt"
    target.write_text("keep")
    assert main([write(tmp_path / "log.jsonl", [GOOD]), "--out", str(target)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err and target.read_text() == "keep"


def test_a_missing_model_path_is_reported_as_a_missing_path(tmp_path, capsys):
    log = write(tmp_path / "log.jsonl", [GOOD])
    for model in (str(tmp_path / "no" / "such-model"), "./no-such-model"):
        assert main([log, "--model", model]) == 2
        err = capsys.readouterr().err
        assert f"--model {model}: no such folder" in err and "Repo id" not in err


@pytest.mark.parametrize("content", [b"", b"\n\n", bytes(range(256)) * 4, b"x\n{\"prompt\": 7}\n"],
                         ids=["empty", "blank", "binary", "all-malformed"])
def test_nothing_to_replay_exits_1(tmp_path, capsys, content):
    path = tmp_path / "log.jsonl"
    path.write_bytes(content)
    assert main([str(path), "--block-size", "4"]) == 1
    captured = capsys.readouterr()
    assert (
        "kvlab doctor: nothing to replay:" in captured.err and "nothing to replay" in captured.out
    )


def test_exit_codes_are_in_the_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "exit status:" in text and "1  nothing to replay" in text and "2  bad arguments" in text


def test_dicts_given_to_read_log_are_held_to_the_same_rules():
    deep: list = []
    for _ in range(100):
        deep = [deep]
    records, bad = read_log(
        [
            {"token_ids": [1, 2]},
            {"token_ids": [1], "x": deep},
            {"prompt": "a", "ts": float("nan")},
            {"prompt": "a\ud800"},
            {"prompt": "a", "when": object()},
        ]
    )
    assert len(records) == 1 and [b.line for b in bad] == [2, 3, 4, 5]
    assert (
        "nested deeper" in bad[0].error
        and "not JSON" in bad[1].error
        and "surrogate" in bad[2].error
    )


def test_a_report_of_an_earlier_kvlab_without_manifest_is_replaced(tmp_path):
    out = tmp_path / "report"
    (out / "fixed").mkdir(parents=True)
    (out / "summary.json").write_text(
        json.dumps({"source": "x", "model": "m", "malformed": [], "table": []})
    )
    (out / "fixed" / "01_volatile.jsonl").write_text(GOOD + "\n")
    assert (
        main(
            [
                write(tmp_path / "log.jsonl", [GOOD]),
                "--block-size",
                "4",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    assert not (out / "fixed" / "01_volatile.jsonl").exists() and (out / MANIFEST).exists()


# ----------------------------------------------------------------------------- sizes and configs
# (issue 37, D1-D2)
LIMITED = """
import json, resource, sys
# 1 GiB: a cache sized by --kv-gib 1e30 cannot hide
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from kvlab.doctor.__main__ import main
"""


def run_limited(code: str, tmp_path) -> dict:
    """Run ``code`` in a Python whose address space is capped at 1 GiB; its last stdout line, parsed
    as JSON."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    res = subprocess.run(
        [sys.executable, "-c", LIMITED + code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def kv_config(tmp_path, **fields) -> str:
    """A config.json (Qwen2.5-0.5B's KV shape unless ``fields`` change it); its path."""
    cfg = {
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_size": 896,
        **fields,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_a_huge_cache_is_refused_by_name_before_anything_is_allocated(tmp_path, capsys):
    log = write(tmp_path / "log.jsonl", span_log(20))
    cfg = kv_config(tmp_path)
    out = run_limited(f"""
rc = [main([{log!r}, "--kv-gib", "1e30", "--kv-config", {cfg!r}, "--quiet"]),
      main([{log!r}, "--capacity-blocks", str(10**12), "--quiet"])]
print(json.dumps(rc))
""", tmp_path)
    assert out == [2, 2]
    # in-process too (now that it is known not to allocate): the message names the option and the
    # limit
    for args, option in ((["--kv-gib", "1e30", "--kv-config", cfg], "--kv-gib 1e+30"),
                         (["--capacity-blocks", str(10**12)], "--capacity-blocks 1000000000000")):
        assert main([log, *args]) == 2
        err = capsys.readouterr().err
        assert option in err and f"{core.MAX_CAPACITY_BLOCKS:,} blocks" in err, err


def test_a_cache_larger_than_the_log_allocates_only_what_the_log_fills(tmp_path):
    out = run_limited(
        """
from kvlab.doctor import diagnose
from kvlab.doctor.core import MAX_CAPACITY_BLOCKS
from kvlab.doctor.replay import replay_tokens
import random
rng = random.Random(3)
head = [rng.randrange(500) for _ in range(40)]
log = [{"token_ids": head + [rng.randrange(500) for _ in range(30)]} for i in range(30)]
big = diagnose(log, block_sizes=(16, 32), capacity_blocks=MAX_CAPACITY_BLOCKS, sample=20)
row = big.row()
prompts = ["".join(chr(t + 1) for t in r["token_ids"]) for r in log]
both = [replay_tokens(prompts, 4, cap, concurrency=c).hit_tokens
        for cap in (None, 10**9) for c in (1, 2)]
print(json.dumps([row["unbounded_hit_tokens"], row["capacity_hit_tokens"], both]))
""",
        tmp_path,
    )
    unbounded, at_capacity, (free1, free2, big1, big2) = out
    assert unbounded == at_capacity > 0  # a cache the log cannot fill never evicts
    assert free1 == free2 == big1 == big2 > 0


@pytest.mark.parametrize("fields, named", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": "14"}, "num_attention_heads"),
    ({"num_attention_heads": True}, "num_attention_heads"),
    ({"num_hidden_layers": -2}, "num_hidden_layers"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 2.0}, "num_key_value_heads"),
    ({"hidden_size": None}, "hidden_size"),  # and no head_dim to stand in
    ({"hidden_size": 8}, "head dim of 0"),
    ({"head_dim": -64}, "head_dim"),
    ({"text_config": [1]}, "text_config"),
])
def test_kv_config_fields_are_validated_by_name(tmp_path, capsys, fields, named):
    log = write(tmp_path / "log.jsonl", span_log(10))
    assert (
        main([log, "--kv-gib", "1", "--kv-config", kv_config(tmp_path, **fields), "--quiet"]) == 2
    )
    err = capsys.readouterr().err
    assert named in err and "config.json" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "text, named", [("[1, 2]", "JSON object"), ("{not json", "not valid JSON")]
)
def test_a_kv_config_that_is_no_json_object_is_named(tmp_path, capsys, text, named):
    log = write(tmp_path / "log.jsonl", span_log(10))
    (tmp_path / "bad.json").write_text(text)
    assert main([log, "--kv-gib", "1", "--kv-config", str(tmp_path / "bad.json")]) == 2
    assert named in capsys.readouterr().err
    assert (
        main([log, "--kv-gib", "1", "--kv-config", kv_config(tmp_path), "--kv-dtype", "fp4"]) == 2
    )
    assert "--kv-dtype" in capsys.readouterr().err


def test_kv_bytes_of_the_shipped_configs_are_unchanged():
    from pathlib import Path

    for path in sorted(
        (Path(core.__file__).resolve().parents[2] / "data" / "configs").glob("*.json")
    ):
        config = json.loads(path.read_text())
        cfg = config.get("text_config") or config
        heads = cfg["num_attention_heads"]
        kv, hd = (
            cfg.get("num_key_value_heads") or heads,
            cfg.get("head_dim") or cfg["hidden_size"] // heads,
        )
        assert (
            core.kv_bytes_per_token_of(config, "bfloat16")
            == 2 * cfg["num_hidden_layers"] * kv * hd * 2
        ), path


@pytest.mark.parametrize(
    "message, words",
    [
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            },
            "messages[0].content[1] is not a text part",
        ),
        (
            {"role": "user", "content": 5},
            "messages[0].content is int, not a string or a list of text parts",
        ),
        ({"role": "wizard", "content": "hi"}, "messages[0].role 'wizard' is not one of"),
        ({"content": "hi"}, "messages[0] has no 'role'"),
        ("hi", "messages[0] is str, not an object"),
    ],
)
def test_chat_lines_are_read_through_the_servers_message_schema(tmp_path, message, words):
    # the doctor's reading of a logged message is the server's pydantic Message, widened to logs
    from pydantic import ValidationError

    from kvlab.serve.protocol import ChatRequest

    path = write(tmp_path / "log.jsonl", [GOOD, json.dumps({"messages": [message]})])
    records, bad = read_log(path)
    assert len(records) == 1 and [b.line for b in bad] == [2] and words in bad[0].error, bad
    with pytest.raises(ValidationError):  # what the doctor refuses, the server refuses too
        ChatRequest(messages=[message])


def test_a_log_keeps_what_real_traffic_holds_that_a_request_may_not():
    # tool turns, content null on a tool-calling assistant turn, text parts without "type", extra
    # keys
    line = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {
                "role": "tool",
                "content": [{"text": "4"}, {"type": "text", "text": "2"}],
                "tool_call_id": "c1",
            },
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "user": "u",
    }
    records, bad = read_log([line])
    assert not bad
    (rec,) = records
    assert [m["content"] for m in rec.messages] == ["S", "", "42"]
    assert (
        rec.messages[1]["tool_calls"] == [{"id": "c1"}] and rec.messages[2]["tool_call_id"] == "c1"
    )
    assert list(rec.messages[2]) == ["role", "content", "tool_call_id"]  # the log's key order
