"""kvlab.doctor's inputs are bounded (issue 53, N8-N9): a line past the per-line cap is a bad line
named by its number (never a tokenizer's allocation panic), and an input that is not a regular file
is named as what it is."""

import json
import os

import pytest

from kvlab.doctor import read_log
from kvlab.doctor.__main__ import main
from kvlab.doctor.logio import MAX_LINE_BYTES

GOOD = json.dumps({"token_ids": list(range(1, 40))})


def test_a_line_over_the_cap_is_named_by_its_number_and_skipped(tmp_path):
    """A valid JSON line of MAX_LINE_BYTES + 1 bytes: refused with its line number, the lines around
    it read."""
    big = json.dumps({"prompt": "a" * MAX_LINE_BYTES})
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join([GOOD, big, GOOD, ""]))
    records, bad = read_log(path)
    assert [r.line for r in records] == [1, 3]
    assert [b.line for b in bad] == [2]
    assert f"{len(big.encode()):,} bytes" in bad[0].error and f"{MAX_LINE_BYTES:,}" in bad[0].error
    assert len(bad[0].text) <= 80


def test_the_cap_applies_to_the_last_line_without_a_newline_and_to_lines_given_as_text(tmp_path):
    big = json.dumps({"prompt": "b" * MAX_LINE_BYTES})
    path = tmp_path / "log.jsonl"
    path.write_text(GOOD + "\n" + big)
    records, bad = read_log(path)
    assert [r.line for r in records] == [1] and [b.line for b in bad] == [2]
    records, bad = read_log([GOOD, big])
    assert [r.line for r in records] == [1] and [b.line for b in bad] == [2]


def test_the_cli_reports_the_long_line_and_replays_the_rest(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join([GOOD, json.dumps({"prompt": "c" * MAX_LINE_BYTES}), GOOD, ""]))
    assert main([str(path), "--block-size", "4"]) == 0
    assert "line 2" in capsys.readouterr().out


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("which", ["folder", "/dev/null", "/dev/zero", "fifo"])
def test_a_log_that_is_not_a_regular_file_is_named_as_what_it_is(tmp_path, capsys, fifo, which):
    path, kind = {
        "folder": (str(tmp_path), "a folder"),
        "/dev/null": ("/dev/null", "a character device"),
        "/dev/zero": ("/dev/zero", "a character device"),
        "fifo": (fifo, "a FIFO"),
    }[which]
    assert main([path]) == 2
    err = capsys.readouterr().err
    assert path in err and kind in err and "no such file" not in err
    log = tmp_path / "log.jsonl"
    log.write_text(GOOD + "\n")
    assert main([str(log), "--vllm-metrics", path]) == 2
    err = capsys.readouterr().err
    assert "--vllm-metrics" in err and kind in err and "no such file" not in err


@pytest.mark.parametrize("which", ["/dev/zero", "fifo"])
def test_a_kv_config_that_is_not_a_regular_file_is_refused_by_name(tmp_path, capsys, fifo, which):
    path = fifo if which == "fifo" else which
    log = tmp_path / "log.jsonl"
    log.write_text(GOOD + "\n")
    assert main([str(log), "--kv-gib", "1", "--kv-config", path, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert path in err and "not a regular file" in err and "\n" not in err


def test_a_huge_kv_config_is_refused_by_its_size(tmp_path, capsys):
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(256 << 20)  # sparse
    log = tmp_path / "log.jsonl"
    log.write_text(GOOD + "\n")
    assert main([str(log), "--kv-gib", "1", "--kv-config", str(big), "--quiet"]) == 2
    assert "bytes" in capsys.readouterr().err


def test_a_missing_log_is_still_no_such_file(tmp_path, capsys):
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
