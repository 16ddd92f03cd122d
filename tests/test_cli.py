"""The ``kvlab`` command: subcommands dispatch to ``python -m kvlab.<name>``; missing ones say
why."""

import json

import pytest

import kvlab
from kvlab import cli


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"kvlab {kvlab.__version__} (")


def test_no_command_prints_the_commands(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert all(f"python -m kvlab.{name}" in out for name in ("serve", "doctor", "audit"))


def test_unknown_command_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bogus"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_doctor_runs_through_the_command(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(json.dumps({"token_ids": [1, 2, 3, 4] * 8 + [i]}) + "\n" for i in range(10))
    )
    assert cli.main(["doctor", str(log), "--block-size", "4", "--out", str(tmp_path / "out")]) == 0
    assert "10 requests replayed" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["requests"] == 10
    # the module's own exit status comes back
    assert cli.main(["doctor", str(tmp_path / "missing.jsonl")]) == 2


def test_a_command_whose_module_is_absent_says_so(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "serve", ("kvlab.no_such_module", "x", "serve"))
    assert cli.main(["serve", "--port", "1"]) == 2
    assert "kvlab.no_such_module is not part of this kvlab" in capsys.readouterr().err


def test_a_command_whose_extra_is_missing_names_the_extra(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "fake_serve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "serve", ("fake_serve", "x", "serve"))
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "'no_such_dependency_xyz'" in err and "pip install 'kvlab[serve]'" in err
