"""Every command against every class of bad input, generated from the commands themselves.

The cases are not written one by one: the numeric flags come from each command's own parser (a flag added
tomorrow is tried with every bad number at once), and every path, output and file class is tried on every
argument of its kind. The contract of a refusal, whatever the command and the input: exit 2, one error line
`elflow CMD: error: ...` and no traceback, nothing written or changed, no child process left, and no
work begun (each case runs under an alarm). A value from the bad lists that a command accepts must be
listed in ACCEPTED with the reason it is not bad there (seed 0 is a seed, --keep 0 keeps every checkpoint);
those are not run here (they start the command's work; their meaning is tested with the command). Every other
value is refused, before any model work, so the whole matrix is fast.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import assert_not_an_integer, assert_one_error, make_fifo, reference_dir

from elflow.cli import COMMANDS, build_parser, main

LIMIT_S = int(os.environ.get("ELFLOW_MATRIX_LIMIT_S", "60"))  # a refusal comes before any work: far below this
INT_BAD = ("0", "-1", "1000000000000", "nan", "inf")
NOT_INTEGERS = ("nan", "inf")  # refused by the parser itself, for an int flag
FLOAT_BAD = ("0", "-1", "nan", "inf", "1e12")

# ----------------------------------------------------------------------------------------------------------
# what a command accepts, and why it is not bad input there (the rest of INT_BAD / FLOAT_BAD is refused)
BIG = "1000000000000"
BIG_F = "1e12"
SEED_FLAGS = ("--seed", "--seeds", "--space-seed", "--mauve-seed")  # seed 0 is a seed, for every command
DIVERGES = {BIG_F}  # a step this large diverges: the run stops at its first non-finite loss, with one line
ACCEPTED: dict[str, dict[str, set]] = {
    "train": {"--weight-decay": {"0"} | DIVERGES, "--lr": DIVERGES, "--grad-clip": {"0", BIG_F},  # 0: no clipping
              "--val-fraction": {"0"},  # no validation rows
              "--log-every": {BIG}, "--ckpt-every": {BIG}, "--sample-every": {"0", BIG},  # at the end only / never
              "--keep": {"0", BIG},  # 0 keeps every checkpoint
              "--sample-omega": {"0"}, "--omega-low": {"0"}, "--t-mean": {"0", "-1"},  # any mean of the logit
              "--time-scale": {BIG_F},  # any positive factor on t gives sinusoid features
              "--table-readout": {"0"}, "--decode-prob": {"0"}, "--self-cond-prob": {"0"},  # an option off
              "--decode-clean-prob": {"0"}, "--ema-decay": {"0"},  # the released value; no averaging
              "--warmup": {"0", BIG}, "--warmup-frac": {"0"}},  # none; longer than the run (said in a warning)
    "distill": {"--ema-decay": {"0"}, "--warmup-frac": {"0"}, "--log-every": {BIG}, "--ckpt-every": {BIG},
                "--keep": {"0", BIG}, "--lr": DIVERGES},
    "sample": {"--gamma": {"0"}, "--omega": {"0"}, "--guidance": {"0"},  # the ODE; no self-guidance (warned)
               "--batch": {BIG}},  # one batch of --num samples
    "eval": {"--gamma": {"0"}, "--omega": {"0"}, "--guidance": {"0"},
             "--batch-size": {BIG}, "--batch": {BIG}, "--max-length": {BIG}},  # capped by the texts, the context
    "sweep": {"--gamma": {"0"}, "--omega": {"0"}, "--batch-size": {BIG}, "--gen-batch-size": {BIG}},
    "toy": {"--gamma": {"0"}},
    "compare": {"--omega": {"0"}, "--lr": DIVERGES},
    "quickstart": {"--omega": {"0"}, "--lr": DIVERGES},
    "push": {"--samples": {"0"}},  # a card without samples
    "bench": {"--warmup": {"0"}},
    "prepare": {"--max-documents": {BIG}, "--source-length": {BIG}},  # no cap; sources kept whole
    "train-judge": {"--lr": DIVERGES, "--warmup": {"0", BIG}, "--val-every": {BIG}},  # only the last held out
    "train-encoder": {"--lr": DIVERGES},
}


def accepted(cmd: str, flag: str, value: str) -> bool:
    return (flag in SEED_FLAGS and value == "0") or value in ACCEPTED.get(cmd, {}).get(flag, set())


# ----------------------------------------------------------------------------------------------------------
# the world the commands run in: a tiny run, its inputs, its outputs


class World:
    def __init__(self, root: Path, t5: Path, judge: Path, corpus: Path):
        self.root, self.t5, self.judge, self.corpus = root, t5, judge, corpus
        self.cache = root / "cache"
        self.run = root / "run"
        self.out = root / "out"
        self.samples = root / "samples.jsonl"
        self.trajectory = root / "s.trajectory.json"
        self.released = reference_dir("checkpoint_7") / "checkpoint_7"

    def base(self, cmd: str) -> list[str]:
        """A command line that the command accepts, on tiny inputs, writing under self.out."""
        o, run, t5 = self.out, self.run, f"t5:{self.t5}"
        small = ["--cache-dir", self.cache]
        return [str(a) for a in {
            "quickstart": ["--out", o, "--steps", "1", "--batch", "2", "--length", "16", "--num", "1",
                           "--sample-steps", "1", "--space", t5, *small],
            "prepare": [self.corpus, "--space", t5, "--out", o, "--quiet", *small],
            "train": ["--preset", "tiny", "--data", self.corpus, "--space", t5, "--latent-std", "1", "--length",
                      "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--dtype", "fp32", "--quiet", "--out",
                      o, *small],
            "sample": [run, "--num", "1", "--steps", "1", "--device", "cpu", "--quiet", "--out", o / "s.jsonl"],
            "view": [self.trajectory, "--out", o / "page.html"],
            "distill": [run, "--out", o, "--student-steps", "1", "--teacher-steps", "2", "--steps-per-round",
                        "1", "--batch", "2", "--length", "16", "--dtype", "fp32", *small],
            "eval": [self.samples, "--judge", self.judge, "--device", "cpu", "--report", o / "report.json",
                     "--no-heldout", *small],
            "train-judge": ["--data", self.corpus, "--steps", "1", "--batch-size", "2", "--context", "16",
                            "--hidden", "16", "--depth", "1", "--heads", "1", "--device", "cpu", "--out", o, *small],
            "train-encoder": ["--data", self.corpus, "--steps", "1", "--vocab", "80", "--length", "16", "--hidden",
                              "16", "--depth", "1", "--heads", "1", "--batch", "2", "--device", "cpu", "--out", o,
                              *small],
            "sweep": [run, "--judge", self.judge, "--omega", "1", "--steps", "1", "--sampler", "ode", "--num", "2",
                      "--device", "cpu", "--out", o],
            "claims": ["--steps", "1", "--seeds", "1", "--num", "2", "--only", "decoder", "--data", self.corpus,
                       "--device", "cpu", "--out", o, *small],
            "compare": ["--steps", "1", "--num", "2", "--data", self.corpus, "--preset", "tiny", "--space", t5,
                        "--length", "16", "--batch", "2", "--judge", self.judge, "--device", "cpu", "--out", o,
                        *small],
            "push": [run, "me/model", "--dry-run", "--samples", "1", "--device", "cpu", "--out", o],
            "convert": [self.released, o, "--max-length", "16"],
            "bench": ["forward", "--preset", "tiny", "--batch", "1", "--length", "8", "--iters", "1", "--warmup",
                      "0", "--device", "cpu"],
            "toy": ["--num", "64", "--steps", "2", "--out", o / "toy.png"],
            "schedules": ["--samples", "64", "--out", o / "schedules.png"],
        }[cmd]]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_t5_dir, tiny_t5_judge_dir, tiny_corpus_file):
    root = tmp_path_factory.mktemp("matrix")
    w = World(root, tiny_t5_dir, tiny_t5_judge_dir, tiny_corpus_file)
    assert main(["train", "--preset", "tiny", "--data", str(w.corpus), "--space", f"t5:{w.t5}", "--latent-std", "1",
                 "--length", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--dtype", "fp32", "--quiet",
                 "--out", str(w.run), "--cache-dir", str(w.cache)]) == 0
    assert main(["sample", str(w.run), "--num", "2", "--steps", "2", "--device", "cpu", "--quiet", "--trajectory",
                 "--out", str(root / "s.jsonl")]) == 0
    w.samples.write_text("".join(json.dumps({"text": f"line {i} of a sample text"}) + "\n" for i in range(4)))
    return w


# ----------------------------------------------------------------------------------------------------------
# running one case


class RanPastTheLimit(Exception):
    pass


@contextmanager
def alarm(seconds: int):
    def fire(*_):
        raise RanPastTheLimit(f"still running after {seconds} s: the command began its work")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def entry_stamps(root: Path, skip: set[Path]) -> dict:
    """Every entry under root (links not followed) with what identifies its content: kind, size, mtime."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in skip]
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            seen[str(p)] = (stat.S_IFMT(st.st_mode), st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                            st.st_mtime_ns if stat.S_ISREG(st.st_mode) else 0)
    return seen


def children() -> list[int]:
    """The live child processes of this process."""
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def run_case(capsys, world: World, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of `elflow ARGV` in this process, under the alarm."""
    code = None
    try:
        with alarm(LIMIT_S):
            code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    _, err = capsys.readouterr()
    return code, err


def assert_refused(capsys, world: World, argv: list[str], *needles) -> str:
    """The contract of a refusal: exit 2, one error line naming the command (after any line saying what it
    was about to do), no traceback, nothing under the world changed (the cache aside), no child left."""
    before, kids = entry_stamps(world.root, {world.cache}), set(children())  # (earlier tests' pools may live on)
    code, err = run_case(capsys, world, argv)
    assert code == 2 and "Traceback" not in err, err
    errors = [x for x in err.splitlines() if "error" in x.lower()]  # what it said it was doing may come first
    line = assert_one_error(code, "\n".join(errors), argv[0], *needles)
    after = entry_stamps(world.root, {world.cache})
    assert after == before, (f"{' '.join(map(str, argv))} changed "
                             f"{sorted(set(after.items()) ^ set(before.items()))[:6]}")
    assert set(children()) <= kids, "a child process was left running"
    return line


# ----------------------------------------------------------------------------------------------------------
# numbers: every numeric flag of every command


def numeric_flags(cmd: str) -> list[tuple[str, str, str]]:
    """(flag, "int" | "float", how the parser's errors name it: its spellings joined by "/") of every option of
    `cmd` whose parser type is int or float."""
    p = build_parser(only=cmd).subcommands[cmd]
    return [(a.option_strings[0], a.type.__name__, "/".join(a.option_strings)) for a in p._actions
            if a.option_strings and a.type in (int, float)]


NUMBER_CASES = [(cmd, flag, value) for cmd in COMMANDS for flag, kind, _ in numeric_flags(cmd)
                for value in (INT_BAD if kind == "int" else FLOAT_BAD)]
INT_FLAGS = {(cmd, flag): spelled for cmd in COMMANDS for flag, kind, spelled in numeric_flags(cmd) if kind == "int"}


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` set (replacing the value it held)."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


@pytest.fixture
def clean_out(world):
    yield
    import shutil

    if world.out.is_dir() and not world.out.is_symlink():
        shutil.rmtree(world.out)
    elif os.path.lexists(world.out):
        world.out.unlink()


def names_of(flag: str) -> tuple[str, ...]:
    """How an error may name a flag: --sample-steps, sample-steps, sample_steps (a config field)."""
    return flag, flag[2:], flag[2:].replace("-", "_")


@pytest.mark.parametrize("cmd, flag, value", [c for c in NUMBER_CASES if not accepted(*c)], ids=str)
def test_a_bad_number_is_refused(capsys, world, clean_out, cmd, flag, value):
    line = assert_refused(capsys, world, [cmd] + with_flag(world.base(cmd), flag, value))
    # the flag is named, or the size check says what would not fit in memory
    assert any(n in line for n in names_of(flag)) or "needs" in line and "memory" in line, line
    if (cmd, flag) in INT_FLAGS and value in NOT_INTEGERS:  # the parser's line, and where the flags are listed
        assert_not_an_integer(2, line, cmd, INT_FLAGS[cmd, flag])


def test_every_accepted_value_is_a_real_flag_value():
    """ACCEPTED names only flags the commands have and values tried: a renamed flag cannot hide a case."""
    tried = {(cmd, flag, value) for cmd, flag, value in NUMBER_CASES}
    for cmd, flags in ACCEPTED.items():
        for flag, values in flags.items():
            for value in values:
                assert (cmd, flag, value) in tried, (cmd, flag, value)


# ----------------------------------------------------------------------------------------------------------
# paths: every input that names a file, a folder or a model, and every output


def _link(p: Path, to) -> Path:
    p.symlink_to(to)
    return p


def _folder(p: Path) -> Path:
    p.mkdir()
    return p


def _loop(p: Path) -> Path:
    p.symlink_to(p.name)
    return p


# class -> make(place, world) -> the path to pass; each made in a fresh folder `place` inside the world
BAD_INPUTS = {
    "missing": lambda d, w: d / "nothing-here",
    "empty-name": lambda d, w: "",
    "fifo": lambda d, w: make_fifo(d / "pipe"),
    "device": lambda d, w: "/dev/zero",
    "empty-folder": lambda d, w: _folder(d / "empty"),
    "dangling-link": lambda d, w: _link(d / "dangling", d / "nothing-here"),
    "link-loop": lambda d, w: _loop(d / "loop"),
    "newline-name": lambda d, w: d / "two\nlines",
}

# (command, where the input goes: an index into the base command line or a flag, flags it needs)
INPUT_SLOTS = [
    ("prepare", 0, []), ("train", "--data", []), ("train", "--init-from", []), ("sample", 0, []),
    ("sample", "--source", []), ("view", 0, []), ("distill", 0, []), ("distill", "--data", []), ("eval", 0, []),
    ("eval", "--references", ["--mauve"]), ("train-judge", "--data", []), ("train-encoder", "--data", []),
    ("sweep", 0, []), ("claims", "--data", []), ("compare", "--data", []), ("push", 0, []), ("convert", 0, []),
]


def place_in(argv: list[str], slot, value, extra) -> list[str]:
    """The base command line with `value` at `slot` (an index or a flag) and `extra` flags added."""
    argv = list(argv)
    if isinstance(slot, int):
        argv[slot] = str(value)
    else:
        argv = with_flag(argv, slot, str(value))
    return argv + list(extra)


@pytest.fixture
def place(world, clean_out):
    """A fresh folder for the bad paths of one case; gone after it."""
    import shutil

    d = world.root / "bad"
    d.mkdir()
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
@pytest.mark.parametrize("cmd, slot, extra", INPUT_SLOTS, ids=lambda v: str(v).replace(" ", ""))
def test_a_bad_input_path_is_refused(capsys, world, place, cmd, slot, extra, kind):
    value = BAD_INPUTS[kind](place, world)
    assert_refused(capsys, world, [cmd] + place_in(world.base(cmd), slot, value, extra))


# outputs: (command, slot, "file" or "folder")
OUTPUT_SLOTS = [
    ("quickstart", "--out", "folder"), ("prepare", "--out", "folder"), ("train", "--out", "folder"),
    ("sample", "--out", "file"), ("view", "--out", "file"), ("distill", "--out", "folder"),
    ("eval", "--report", "file"), ("train-judge", "--out", "folder"), ("train-encoder", "--out", "folder"),
    ("sweep", "--out", "folder"), ("claims", "--out", "folder"), ("compare", "--out", "folder"),
    ("push", "--out", "folder"), ("convert", 1, "folder"), ("toy", "--out", "file"), ("schedules", "--out", "file"),
]


def _elsewhere(d: Path, kind: str) -> Path:
    """Something outside that a link may lead to: a folder, or a file, of the user's."""
    target = d / ("theirs" if kind == "folder" else "theirs.txt")
    if kind == "folder":
        target.mkdir()
        (target / "keep.txt").write_text("keep")
    else:
        target.write_text("keep")
    return target


BAD_OUTPUTS = {
    "fifo": lambda d, w, kind: make_fifo(d / "pipe"),
    "device": lambda d, w, kind: "/dev/null",
    "link": lambda d, w, kind: _link(d / "link", _elsewhere(d, kind)),
    "dangling-link": lambda d, w, kind: _link(d / "dangling", d / "nothing-here"),
    "empty-name": lambda d, w, kind: "",
    "inside-a-run": lambda d, w, kind: w.run / ("new-folder" if kind == "folder" else "new.out"),
    "the-run-itself": lambda d, w, kind: w.run,
    "under-a-file": lambda d, w, kind: _elsewhere(d, "file") / "x",
    "wrong-kind": lambda d, w, kind: (_elsewhere(d, "file") if kind == "folder" else _folder(d / "a-folder")),
}


@pytest.mark.parametrize("kind", sorted(BAD_OUTPUTS))
@pytest.mark.parametrize("cmd, slot, what", OUTPUT_SLOTS, ids=lambda v: str(v).replace(" ", ""))
def test_a_bad_output_path_is_refused(capsys, world, place, cmd, slot, what, kind):
    if (cmd, kind) == ("train", "the-run-itself"):
        pytest.skip("train --out RUN is the run's own folder: `already holds a run`, tested with the runs")
    value = BAD_OUTPUTS[kind](place, world, what)
    assert_refused(capsys, world, [cmd] + place_in(world.base(cmd), slot, value, []))


def test_a_run_folder_holding_files_of_another_program_is_never_replaced(capsys, world, place):
    """train / distill --overwrite replace only what the run wrote: a folder holding anything else is refused
    (the user's file, or what eval wrote into the run's folder), with or without --overwrite."""
    import shutil

    for cmd in ("train", "distill"):
        folder = place / cmd
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
        for extra in ([], ["--overwrite"]):
            assert_refused(capsys, world, [cmd] + with_flag(world.base(cmd), "--out", str(folder)) + extra,
                           "holds notes.txt", "did not write")
    run = place / "run"
    shutil.copytree(world.run, run)
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text("{}")
    assert_refused(capsys, world, ["train"] + with_flag(world.base("train"), "--out", str(run)) + ["--overwrite"],
                   "holds eval", "--overwrite replaces only what the run wrote")


# ----------------------------------------------------------------------------------------------------------
# files: every JSON or JSONL input, and every stored record, with bad contents


def _nested(depth: int = 100_000) -> str:
    return '{"text": ' + "[" * depth + "]" * depth + "}"


BAD_FILES = {  # class -> the bytes of the file
    "empty": b"",
    "binary": bytes(range(256)) * 4,
    "bad-utf8": b'{"text": "\xff\xfe caf\xe9"}\n',
    "nested": (_nested() + "\n").encode(),
    "huge-integer": ('{"text": 1' + "0" * 5000 + "}\n").encode(),
    "wrong-type": b'{"text": 5, "source": [1], "steps": {"a": 1}}\n',
    "not-an-object": b"[1, 2, 3]\n",
    "nan": b'{"text": NaN}\n',
}

JSON_SLOTS = [  # (command, slot, flags it needs, the file's suffix)
    ("eval", 0, [], ".jsonl"), ("eval", "--references", ["--mauve"], ".jsonl"), ("sample", "--source", [], ".jsonl"),
    ("prepare", 0, [], ".jsonl"), ("view", 0, [], ".json"), ("train", "--data", [], ".jsonl"),
    ("distill", "--data", [], ".jsonl"), ("train-judge", "--data", [], ".jsonl"),
    ("train-encoder", "--data", [], ".jsonl"), ("claims", "--data", [], ".jsonl"),
    ("compare", "--data", [], ".jsonl"), ("sweep", "--references", ["--mauve"], ".jsonl"),
]


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
@pytest.mark.parametrize("cmd, slot, extra, suffix", JSON_SLOTS, ids=lambda v: str(v).replace(" ", ""))
def test_a_bad_file_is_refused(capsys, world, place, cmd, slot, extra, suffix, kind):
    f = place / f"input{suffix}"
    f.write_bytes(BAD_FILES[kind])
    assert_refused(capsys, world, [cmd] + place_in(world.base(cmd), slot, f, extra))
