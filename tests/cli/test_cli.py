"""The command line as a user meets it: every option explains itself, once; an unknown flag is one line."""

import argparse
import re

import pytest
from helpers import assert_one_error, cli

from elflow.cli import COMMANDS, build_parser, main


def _subparser(name):
    parser = build_parser(only=name)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help_and_states_its_default_once(name, capsys):
    sub = _subparser(name)
    bare = [a.option_strings[0] if a.option_strings else a.dest for a in sub._actions
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert bare == []
    for action in sub._actions:  # each help states its default at most once
        assert action.help, action.option_strings
        assert action.help.count("(default:") <= 1, action.option_strings
    assert "==SUPPRESS==" not in sub.format_help()
    with pytest.raises(SystemExit):
        main([name, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default[^)]*\)\s*\(default", text)  # a default never stated twice


def test_an_unknown_flag_is_one_line_naming_the_subcommands_help(capsys):
    """Exit 2 from the parser, one line, no traceback, naming the subcommand's --help (with its arguments, as
    `sample`, and without, as `toy`)."""
    with pytest.raises(SystemExit) as e:
        main(["sample", "RUN", "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == ("elflow sample: error: unrecognized arguments: --no-such-flag "
                           "(`elflow sample --help` lists the flags)")
    code, _, err = cli(capsys, ["toy", "--no-such-flag"])
    assert_one_error(code, err, "toy", "unrecognized arguments: --no-such-flag", "`elflow toy --help`")


def test_the_top_level_help_names_both_distillation_objectives(capsys):
    from elflow.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "progressive distillation" in out and "--objective flow-map" in out
