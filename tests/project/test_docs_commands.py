"""A command the README or docs/ shows is a promise: every one of them is read here, and must parse with
elflow's own command line (the command exists, every flag exists, every choice and number is one it takes);
the ones that can run offline run, at tiny sizes where they train (tests marked slow)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from elflow.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # RUN, OUT, HUB_ID: a name the reader fills in


def shown_commands() -> list[tuple[str, int, str]]:
    """(file, line, command) of every `elflow ...` / `torchrun ... -m elflow.cli ...` line in a fenced block,
    continuation lines joined, comments dropped."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        fenced, i = False, 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                fenced = not fenced
                i += 1
                continue
            start = i
            text = line.strip()
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            i += 1
            if not (fenced or line.startswith("    ")):
                continue
            text = text.split("  #")[0].split(" # ")[0].strip()
            if text.startswith("elflow ") or (text.startswith("torchrun ") and "-m elflow.cli" in text):
                found.append((doc.name, start + 1, text))
    return found


def elflow_argv(text: str) -> list[str]:
    words = shlex.split(text)
    if words[0] == "torchrun":
        words = words[words.index("elflow.cli") + 1:]
    else:
        words = words[1:]
    return words


class Refused(Exception):
    pass


def parse(argv: list[str]):
    """argv read by elflow's parser, placeholders (RUN, N) standing for any value; Refused with the parser's
    message when it would not run."""
    parser = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else None)
    for p in [parser, *parser.subcommands.values()]:
        p.exit = lambda status=0, message=None: (_ for _ in ()).throw(Refused(message))
    sub = parser.subcommands.get(argv[0]) if argv else None
    typed = {opt: a for a in (sub._actions if sub else []) for opt in a.option_strings}
    filled, previous = [], None
    for w in argv:
        action = typed.get(previous)
        if PLACEHOLDER.match(w) and action is not None and action.type in (int, float):
            w = "1"
        filled.append(w)
        previous = w
    args, unknown = parser.parse_known_args(filled)
    if unknown:
        raise Refused(f"unrecognized arguments: {' '.join(unknown)}")
    return args


COMMAND_LINES = shown_commands()


def test_the_docs_show_commands():
    assert len(COMMAND_LINES) > 60 and {a for _, _, t in COMMAND_LINES for a in elflow_argv(t)[:1]} >= {
        "train", "sample", "eval", "distill", "prepare"}


@pytest.mark.parametrize("doc, line, text", COMMAND_LINES, ids=[f"{d}:{n}" for d, n, _ in COMMAND_LINES])
def test_every_shown_command_parses(doc, line, text):
    try:
        parse(elflow_argv(text))
    except Refused as e:
        pytest.fail(f"{doc}:{line}: `{text}` does not run: {e}")


def test_a_command_that_drifted_is_caught():
    for bad in ("elflow sample runs/demo --no-such-flag", "elflow samples runs/demo",
                "elflow sample runs/demo --sampler euler", "elflow toy --steps many"):
        with pytest.raises(Refused):
            parse(elflow_argv(bad))


def test_a_shown_trajectory_records_steps_the_sampler_takes():
    """`sample --trajectory STEP ...` as shown: every step within the sampling steps, --steps where given, else a
    text model's default step count (what runs/demo samples with)."""
    from elflow.generate import SamplingSettings

    past = []
    for doc, line, text in COMMAND_LINES:
        argv = elflow_argv(text)
        if argv[:1] == ["sample"]:
            args = parse(argv)
            steps = args.steps or SamplingSettings().steps
            if args.trajectory and max(args.trajectory) > steps:
                past.append(f"{doc}:{line}: `{text}` records step {max(args.trajectory)} of {steps}")
    assert not past, past
