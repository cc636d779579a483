"""The `gpulens` command line: every subcommand is listed, has --help, and bad options fail cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpulens.cli import SUBCOMMANDS, main

EXPECTED = ["up", "exporter", "agent", "coordinator", "gateway", "operator", "analyze", "capture", "hook-path", "version"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulens.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand():
    out = run("--help")
    assert out.returncode == 0
    for name in EXPECTED:
        assert f"\n  {name} " in out.stdout, name
    assert list(SUBCOMMANDS) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert f"gpulens {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", EXPECTED)
def test_unknown_option_is_a_one_line_error_with_exit_2(name):
    out = run(name, "--no-such-option")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"gpulens {name}: error:")


@pytest.mark.parametrize("name", ["exporter", "version", "hook-path"])
def test_unknown_option_is_named(name):
    # subcommands without required arguments report the unknown option itself
    out = run(name, "--no-such-option")
    assert out.returncode == 2 and "--no-such-option" in out.stderr


def test_unknown_command_exits_2():
    out = run("frobnicate")
    assert out.returncode == 2
    assert "unknown command 'frobnicate'" in out.stderr
    assert out.stderr.count("\n") == 1


def test_no_arguments_prints_help_and_exits_2():
    out = run()
    assert out.returncode == 2
    assert "COMMAND" in out.stdout


def test_hook_path_is_an_importable_sitecustomize_folder(tmp_path):
    out = run("hook-path")
    assert out.returncode == 0
    folder = out.stdout.strip()
    assert (tmp_path / "x").parent.exists()
    from pathlib import Path
    assert (Path(folder) / "sitecustomize.py").is_file()
    assert (Path(folder) / "_gpulens_hook.py").is_file()


def test_version():
    from gpulens import __version__
    out = run("version")
    assert out.returncode == 0 and out.stdout.strip() == f"gpulens {__version__}"


@pytest.mark.parametrize("text,ok", [("127.0.0.1:9452", ("127.0.0.1", 9452)), ("[::1]:80", ("::1", 80)),
                                     ("0.0.0.0:0", ("0.0.0.0", 0))])
def test_host_port_parses(text, ok):
    from gpulens.ground.argtypes import host_port
    assert host_port(text) == ok


@pytest.mark.parametrize("text", ["9452", ":9452", "host:", "host:http", "host:70000"])
def test_host_port_rejects_with_a_clear_message(text):
    from gpulens.ground.argtypes import host_port
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        host_port(text)
    out = run("coordinator", "--listen", text, "--job", "j", "--attempt", "0", "--namespace", "n",
              "--discovery", "local", "--agent-url", "http://x", "--archive-root", "file:///tmp/a",
              "--token-file", "/dev/null", "--agent-token-file", "/dev/null")
    assert out.returncode == 2 and "expected HOST:PORT" in out.stderr
