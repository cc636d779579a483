"""`--help` a newcomer can act on: an example per subcommand (and per capture action), defaults
shown, help on every option of `up` and `capture`, and old option spellings still accepted."""

from __future__ import annotations

import argparse

import pytest

from gpulens.cli import EXAMPLES, SUBCOMMANDS, build_subparser

CAPTURE_ACTIONS = ("start", "status", "watch", "cancel", "list")


def _help(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())   # argparse wraps lines anywhere


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_subcommand_shows_an_example(name):
    parser, _ = build_subparser(name)
    text = _help(parser)
    assert "example" in text, name
    assert f"gpulens {name}" in text.split("example", 1)[1], name
    assert name in EXAMPLES or name in ("up", "capture")


def test_every_capture_action_has_its_own_example_and_every_option_says_what_it_is():
    parser, _ = build_subparser("capture")
    for action, sub in _actions(parser).items():
        text = _help(sub)
        assert f"gpulens capture {action}" in text.split("example", 1)[1], action
        for a in sub._actions:
            assert a.help and a.help.strip(), (action, a.option_strings or a.dest)
    start = _help(_actions(parser)["start"])
    assert "default 2000" in " ".join(start.split()) and "(default: http://" in start
    assert "(default: None)" not in start and "(default: False)" not in start


def test_every_up_option_has_help_and_shows_its_default():
    parser, _ = build_subparser("up")
    for a in parser._actions:
        assert a.help and a.help.strip(), a.option_strings
    text = _help(parser)
    for fragment in ("(default: .gpulens)", "(default: 9450)", "(default: 127.0.0.1:1778)", "(default: 5.0)"):
        assert fragment in text, fragment
    assert "(default: None)" not in text


@pytest.mark.parametrize("name,old,new", [
    ("up", ["--workdir", "w", "--exit-after", "5", "--incident-after", "7", "--status-interval", "2"],
           ["--work-dir", "w", "--exit-after-s", "5", "--incident-after-s", "7", "--status-interval-s", "2"]),
    ("gateway", ["--token-file", "t", "--coordinator-token-file", "c", "--route", "a/b=http://x:1"],
                ["--accepted-token-file", "t", "--coordinator-token-file", "c", "--route", "a/b=http://x:1"]),
    ("capture", ["start", "--job", "j", "--timeout-s", "3"], ["start", "--job", "j", "--wait-timeout-s", "3"]),
])
def test_old_spellings_are_aliases_of_the_new_names(name, old, new):
    parser, _ = build_subparser(name)
    assert vars(parser.parse_args(old)) == vars(parser.parse_args(new))
