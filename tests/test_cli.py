"""The command line as a user meets it: every option explains itself, once."""

import argparse
import re

import pytest

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
    with pytest.raises(SystemExit):
        main([name, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default[^)]*\)\s*\(default", text)  # a default never stated twice


def test_an_unknown_flag_is_one_line_naming_the_subcommands_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sample", "RUN", "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == ("elflow sample: error: unrecognized arguments: --no-such-flag "
                           "(`elflow sample --help` lists the flags)")
