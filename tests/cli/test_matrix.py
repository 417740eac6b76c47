"""Every command against every class of bad input, generated from the commands themselves.

The cases are not written one by one: the numeric flags come from each command's own parser (a flag added
tomorrow is tried with every bad number at once), and every path, output and file class is tried on every
argument of its kind. The contract of a refusal, whatever the command and the input: exit 2, one error line
`elflow CMD: error: ...` and no traceback, nothing written or changed, no child process left, and no
work begun (each case runs under an alarm). A value from the bad lists that a command accepts must be
listed in ACCEPTED with the reason it is not bad there (seed 0 is a seed, --keep 0 keeps every checkpoint);
those are not run here (they start the command's work; their meaning is tested with the command). Every other
value is refused, before any model work, so the whole matrix is fast.

The same contract over the rest of what a command meets: the environment (torchrun's variables where no
torchrun started the process, an ELFLOW_CACHE or HF_HOME that cannot be one), its streams (standard output
closed, full or read by no one, standard input that never ends: a result is never lost in silence), a run whose
own files were replaced by what elflow never wrote (each file, each kind of replacement, each command that reads
it), distillation outputs holding another program's file at any depth (never deleted), and the Python API
(every argument of elflow.load, load_for_sampling, generate and integrate, of a wrong type or value: one
ELFError). Cases that are not bad input where they land are listed with the reason; known faults of modules
this file does not fix are strict xfails naming the function and what goes wrong.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import assert_not_an_integer, assert_one_error, drawn, make_fifo, reference_dir, tree_state

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


def _slot_id(case) -> str:
    return "-".join(str(v).replace(" ", "") for v in case)


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


@pytest.mark.parametrize("cmd, flag, value", drawn([c for c in NUMBER_CASES if not accepted(*c)],
                                                  lambda c: (c[0], c[2]), ids=str))  # each command, each bad value
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


@pytest.mark.parametrize("cmd, slot, extra, kind", drawn([(*slot, kind) for kind in sorted(BAD_INPUTS)
                                                          for slot in INPUT_SLOTS], lambda c: c[-1], _slot_id))
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


@pytest.mark.parametrize("cmd, slot, what, kind", drawn([(*slot, kind) for kind in sorted(BAD_OUTPUTS)
                                                          for slot in OUTPUT_SLOTS
                                                          if (slot[0], kind) != ("train", "the-run-itself")],
                                                         lambda c: c[-1], _slot_id))
def test_a_bad_output_path_is_refused(capsys, world, place, cmd, slot, what, kind):
    # (train --out RUN the-run-itself is left out: the run's own folder, `already holds a run`, tested with the runs)
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


@pytest.mark.parametrize("cmd, slot, extra, suffix, kind", drawn([(*slot, kind) for kind in sorted(BAD_FILES)
                                                                  for slot in JSON_SLOTS], lambda c: c[-1], _slot_id))
def test_a_bad_file_is_refused(capsys, world, place, cmd, slot, extra, suffix, kind):
    f = place / f"input{suffix}"
    f.write_bytes(BAD_FILES[kind])
    assert_refused(capsys, world, [cmd] + place_in(world.base(cmd), slot, f, extra))


# ----------------------------------------------------------------------------------------------------------
# the environment: torchrun's variables where no torchrun started the process, a cache that cannot be one


TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                      "GROUP_RANK", "TORCHELASTIC_RUN_ID")
RANK_0_OF_2 = dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _rank_0_of_2(**changes) -> dict:
    """What torchrun sets for rank 0 of two processes, with `changes` (None: the variable unset)."""
    return {k: v for k, v in {**RANK_0_OF_2, **changes}.items() if v is not None}


# class -> (the variables set, every other torchrun variable unset; the variable the line must name)
BAD_TORCHRUN = {
    "world-size-without-rank": ({"WORLD_SIZE": "2"}, "RANK"),
    "world-size-zero": ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    "world-size-a-word": ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
    "rank-a-word": (_rank_0_of_2(RANK="abc"), "RANK"),
    "rank-past-the-group": (_rank_0_of_2(RANK="2"), "RANK"),
    "local-rank-negative": (_rank_0_of_2(LOCAL_RANK="-1"), "LOCAL_RANK"),
    "no-master-addr": (_rank_0_of_2(MASTER_ADDR=None), "MASTER_ADDR"),
    "no-master-port": (_rank_0_of_2(MASTER_PORT=None), "MASTER_PORT"),
    "master-port-zero": (_rank_0_of_2(MASTER_PORT="0"), "MASTER_PORT"),
    "master-port-past-65535": (_rank_0_of_2(MASTER_PORT="70000"), "MASTER_PORT"),
}
# accepted: WORLD_SIZE unset, empty or 1 is one process, whatever else is set (util.distributed.torchrun_env)
ONE_PROCESS = {
    "rank-alone": {"RANK": "abc"},
    "local-rank-alone": {"LOCAL_RANK": "-1"},
    "master-alone": {"MASTER_ADDR": "", "MASTER_PORT": "http"},
    "world-size-one": {"WORLD_SIZE": "1", "RANK": "5", "LOCAL_RANK": "x"},
    "world-size-empty": {"WORLD_SIZE": "", "RANK": "1"},
}
# commands that never form a torchrun group: they run in one process whatever torchrun's variables hold
NO_GROUP = {
    "prepare": "tokenizes on one machine; a store is one folder",
    "view": "renders one page",
    "train-judge": "trains its small judge in one process",
    "train-encoder": "trains its small encoder in one process",
    "sweep": "samples and judges each cell in one process",
    "push": "uploads from one process",
    "convert": "converts one file",
    "bench": "times one device",
    "toy": "the 2-D toy runs on one CPU",
    "schedules": "draws one figure",
}


@pytest.fixture
def torchrun_unset(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("cmd, kind", drawn([(c, kind) for kind in sorted(BAD_TORCHRUN) for c in COMMANDS
                                             if c not in NO_GROUP], lambda c: c[-1], _slot_id))
def test_torchrun_variables_without_torchrun_are_refused(capsys, world, clean_out, torchrun_unset, cmd, kind):
    """Every command that forms a torchrun group (itself, or through the training it runs) reads torchrun's
    variables before any work: a partial or bad set is one line naming the variable, not a batch split by a
    WORLD_SIZE no group stands behind, nor a wait for ranks that never come."""
    env, named = BAD_TORCHRUN[kind]
    for k, v in env.items():
        torchrun_unset.setenv(k, v)
    assert_refused(capsys, world, [cmd] + world.base(cmd), named, "torchrun")


@pytest.mark.parametrize("kind", sorted(ONE_PROCESS))
def test_torchrun_variables_of_one_process_are_not_read(torchrun_unset, kind):
    """WORLD_SIZE unset, empty or 1 is one process, whatever the other variables hold: nothing of them is read,
    and `train` on a machine with a GPU trains on cuda:0, not on a LOCAL_RANK that no torchrun set."""
    import torch

    from elflow.cli.train import run_device
    from elflow.util.distributed import torchrun_env

    for k, v in ONE_PROCESS[kind].items():
        torchrun_unset.setenv(k, v)
    assert torchrun_env() is None
    torchrun_unset.setattr(torch.cuda, "is_available", lambda: True)
    assert run_device(None) == torch.device("cuda", 0)


def test_the_tables_of_the_environment_name_real_commands():
    assert set(NO_GROUP) < set(COMMANDS)
    assert set(CACHE_UNUSED) < set(CACHE_COMMANDS) and set(CACHE_COMMANDS) <= set(COMMANDS)


def without_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        del argv[i:i + 2]
    return argv


def _unwritable_folder(d: Path) -> Path:
    """A folder nothing can be written in: a read-only one; for root, who writes in any folder of an ordinary
    file system, /sys (sysfs takes no new files from anyone)."""
    if os.geteuid() == 0:
        return Path("/sys")
    folder = _folder(d / "read-only")
    folder.chmod(0o555)
    return folder


# class -> make(place) -> the value of ELFLOW_CACHE
BAD_CACHES = {
    "a-file": lambda d: _elsewhere(d, "file"),
    "a-fifo": lambda d: make_fifo(d / "pipe"),
    "a-device": lambda d: "/dev/null",
    "a-dangling-link": lambda d: _link(d / "dangling", d / "nothing-here"),
    "under-a-file": lambda d: _elsewhere(d, "file") / "cache",
    "an-unwritable-folder": _unwritable_folder,
    "under-an-unwritable-folder": lambda d: _unwritable_folder(d) / "cache",
}
# accepted: a cache folder whose parents are missing is made with them (util.files.writable_cache)
CACHE_ACCEPTED = {"missing-parents": "the cache folder is made with the parents it lacks"}
CACHE_COMMANDS = [c for c in COMMANDS
                  if "--cache-dir" in {s for a in build_parser(only=c).subcommands[c]._actions for s in a.option_strings}]
CACHE_UNUSED = {  # commands whose base command line keeps nothing in the cache
    "prepare": "its input is a file: the cache holds only the built-in corpus, which it does not read",
    "eval": "it judges a samples file with a judge folder, --no-heldout: nothing is cached",
    "train-encoder": "it trains on a file: the cache holds only the built-in corpus, which it does not read",
}


@pytest.mark.parametrize("cmd, kind", drawn([(c, kind) for kind in sorted(BAD_CACHES) for c in CACHE_COMMANDS
                                             if c not in CACHE_UNUSED], lambda c: c[-1], _slot_id))
def test_a_bad_elflow_cache_is_refused(capsys, world, place, monkeypatch, cmd, kind):
    """ELFLOW_CACHE (the cache of every command that takes --cache-dir, when the flag is left out) that names
    what cannot be a cache folder is one line naming it and both ways to choose another, before anything is
    downloaded or trained; the file or device it names is left as it is."""
    monkeypatch.setenv("ELFLOW_CACHE", str(BAD_CACHES[kind](place)))
    argv = [cmd] + without_flag(world.base(cmd), "--cache-dir")
    assert_refused(capsys, world, argv, "the cache folder", "--cache-dir or ELFLOW_CACHE")


def test_a_cache_folder_whose_parents_are_missing_is_made(capsys, world, place, monkeypatch):
    """The value CACHE_ACCEPTED holds, tried once: ELFLOW_CACHE under folders that do not exist yet is made
    with them, and the command runs."""
    assert set(CACHE_ACCEPTED).isdisjoint(BAD_CACHES)
    cache = place / "not" / "yet" / "cache"
    monkeypatch.setenv("ELFLOW_CACHE", str(cache))
    code, err = run_case(capsys, world, ["train"] + without_flag(world.base("train"), "--cache-dir"))
    assert code == 0, err
    assert (cache / "stores").is_dir()


def cli_process(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=None, close_stdout=False,
                timeout: int = LIMIT_S) -> tuple[int, str, bytes]:
    """(exit code, stderr, stdout) of `python -m elflow.cli ARGV` in a fresh process: its standard output and
    input as given (`close_stdout`: started with descriptor 1 closed, as `>&-` does), its environment this one's
    with `env` on top (None: unset), killed after `timeout` s."""
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "OMP_NUM_THREADS": "1"}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = str(v)
    r = subprocess.run([sys.executable, "-m", "elflow.cli", *map(str, argv)], stdout=stdout, stdin=stdin,
                       stderr=subprocess.PIPE, env=full, timeout=timeout,
                       preexec_fn=(lambda: os.close(1)) if close_stdout else None)
    return r.returncode, r.stderr.decode(errors="replace"), r.stdout or b""


HUB_ID = "embedded-language-flows/ELF-B-owt-torch"  # read offline (HF_HUB_OFFLINE): from the hub's cache only
BAD_HF_HOMES = {
    "a-file": lambda d: _elsewhere(d, "file"),
    "an-unwritable-folder": _unwritable_folder,
}


@pytest.mark.parametrize("kind", sorted(BAD_HF_HOMES))
def test_a_bad_hf_home_is_one_line_where_the_hub_is_read(world, tmp_path, kind):
    """HF_HOME (the hub's cache and token, read when a command is given a hub id) that is a file or a folder
    nothing can be written in: `sample HUB_ID` is one line naming the hub id, exit 2; the file is left as it is.
    (HF_HOME is read when huggingface_hub is imported: each case is a process of its own.)"""
    home = BAD_HF_HOMES[kind](tmp_path)
    before = tree_state(tmp_path)
    out = tmp_path / "s.jsonl"
    code, err, _ = cli_process(["sample", HUB_ID, "--num", "1", "--device", "cpu", "--out", out],
                               env={"HF_HOME": home, "HF_HUB_OFFLINE": "1"})
    assert_one_error(code, err, "sample", HUB_ID)
    assert tree_state(tmp_path) == before


# ----------------------------------------------------------------------------------------------------------
# streams: standard output closed, full, or read by no one; standard input that never ends


def _option_strings(cmd: str) -> set[str]:
    return {s for a in build_parser(only=cmd).subcommands[cmd]._actions for s in a.option_strings}


# (command, the flag that sends its result to standard output, the flag left out for it): every --json and
# --print-config of every command, and sample, which prints the texts it writes unless --quiet
PRINTERS = [(cmd, flag, None) for cmd in COMMANDS for flag in ("--json", "--print-config")
            if flag in _option_strings(cmd)] + [("sample", None, "--quiet")]
STREAM_ACCEPTED = {  # (command, stream class) -> why it is not lost output there
    ("sample", "closed"): "its texts are written to --out; with standard output closed they are not printed, as "
                          "with --quiet (util.files.print_result, closed_ok)",
}


def printing(world: World, cmd: str, flag, drop) -> list[str]:
    return [cmd] + [a for a in world.base(cmd) if a != drop] + ([flag] if flag else [])


def _full_stdout(d: Path):
    return open("/dev/full", "w")


def _gone_stdout(d: Path):
    r, w = os.pipe()
    os.close(r)  # the reader went away (a pipe into `head` that has ended)
    return os.fdopen(w, "w")


STDOUTS = {"closed": lambda d: None, "full": _full_stdout, "reader-gone": _gone_stdout}


@pytest.mark.parametrize("cmd, flag, drop, stream", [(*p, s) for p in PRINTERS for s in sorted(STDOUTS)
                                                     if (p[0], s) not in STREAM_ACCEPTED], ids=str)
def test_a_result_on_a_stdout_that_cannot_take_it_is_never_lost_in_silence(capsys, world, clean_out, monkeypatch,
                                                                           tmp_path, cmd, flag, drop, stream):
    """A command whose result goes to standard output: a closed one (sys.stdout None, as Python starts with
    descriptor 1 closed) is refused before any work; a full one (/dev/full) is one line saying the result
    was not printed, after what was written; a reader that went away (`| head`) ends the printing without a word,
    exit 0 by design (util.files.stdout_to_nowhere). Never a traceback, and nothing left to fail when the
    interpreter flushes standard output at exit."""
    argv = printing(world, cmd, flag, drop)
    out = STDOUTS[stream](tmp_path)
    if stream == "closed":
        monkeypatch.setattr(sys, "stdout", None)
        assert_refused(capsys, world, argv, "standard output", "closed")
        return
    monkeypatch.setattr(sys, "stdout", out)
    try:
        code, err = run_case(capsys, world, argv)
        out.flush()  # what the interpreter does at exit: it must find nothing it cannot write
    finally:
        out.close()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if stream == "reader-gone":
        assert code == 0 and "error" not in err, err
    else:
        errors = [x for x in err.splitlines() if "error" in x.lower()]
        assert_one_error(code, "\n".join(errors), cmd, "standard output cannot be written", "not printed")


def test_every_stream_exception_is_a_printing_command():
    for cmd, stream in STREAM_ACCEPTED:
        assert cmd in {c for c, _, _ in PRINTERS} and stream in STDOUTS


def _stdin_that_never_ends(d: Path) -> int:
    """A fifo opened for reading and writing: a read of it waits forever (its one writer is the reader)."""
    return os.open(make_fifo(d / "stdin"), os.O_RDWR)


# (standard output, standard input) of a real process: each stdout class once, with each stdin class
PROCESS_STREAMS = [("closed", "fifo"), ("full", "/dev/null"), ("reader-gone", "fifo")]


@pytest.mark.parametrize("stream, stdin", PROCESS_STREAMS)
def test_a_process_with_its_streams_redirected_ends_with_the_truth(tmp_path, stream, stdin):
    """`train --print-config` started as a process of its own, standard output closed, full or read by no one,
    standard input /dev/null or a fifo that never ends: it ends within the limit (nothing reads standard
    input), with one line where the result was lost (exit 2) and nothing but exit 0 where the reader went away;
    never a traceback, never Python's `Exception ignored` when it flushes standard output at exit."""
    fds = []
    stdin_fd = _stdin_that_never_ends(tmp_path) if stdin == "fifo" else os.open(os.devnull, os.O_RDONLY)
    fds.append(stdin_fd)
    out = {"closed": None, "full": open("/dev/full", "wb"), "reader-gone": None}[stream]
    if stream == "reader-gone":
        r, w = os.pipe()
        os.close(r)
        fds.append(w)
        out = w
    try:
        code, err, _ = cli_process(["train", "--preset", "tiny", "--print-config"], stdout=out, stdin=stdin_fd,
                                   close_stdout=stream == "closed")
    finally:
        for fd in fds:
            os.close(fd)
        if stream == "full":
            out.close()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if stream == "reader-gone":
        assert code == 0 and err == "", err
    else:
        assert_one_error(code, err, "train", "standard output")


def test_sample_with_stdout_closed_writes_its_samples_whole(capsys, world, monkeypatch, tmp_path):
    """The case STREAM_ACCEPTED holds: with standard output closed, `sample` writes its samples file whole,
    prints nothing, says on standard error what it wrote, exit 0."""
    out = tmp_path / "s.jsonl"
    monkeypatch.setattr(sys, "stdout", None)
    code, err = run_case(capsys, world, ["sample", world.run, "--num", "2", "--steps", "1", "--device", "cpu",
                                         "--out", out])
    assert code == 0 and "Traceback" not in err and f"wrote 2 samples to {out}" in err, err
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in records if "index" in r] == [0, 1], records


# ----------------------------------------------------------------------------------------------------------
# a run's own files, edited: each replaced by what elflow never wrote, read by each command that reads runs


CKPT = "checkpoints/step_0000002"  # the world's run has one checkpoint
RUN_FILES_EDITED = {"run.json": "run.json", "state.json": f"{CKPT}/state.json",
                    "state.sha256": f"{CKPT}/state.sha256", "optimizer.pt": f"{CKPT}/optimizer.pt",
                    "model.safetensors": f"{CKPT}/model.safetensors", "ema.safetensors": f"{CKPT}/ema.safetensors",
                    "metrics.jsonl": "metrics.jsonl", "lock": ".lock"}


def _as_link_outside(p: Path, outside: Path, data: bytes) -> None:
    target = outside / f"copy-of-{p.name}"
    target.write_bytes(data)  # the same bytes, outside the run: only the link is wrong
    p.symlink_to(target)


EDITS = {  # class -> edit(path, a folder outside the run, the file's bytes), the path already removed
    "link-outside": _as_link_outside,
    "link-to-dev-zero": lambda p, outside, data: p.symlink_to("/dev/zero"),
    "fifo": lambda p, outside, data: make_fifo(p),
    "folder": lambda p, outside, data: p.mkdir(),
    "empty": lambda p, outside, data: p.write_bytes(b""),
    "truncated": lambda p, outside, data: p.write_bytes(data[:len(data) // 2]),
}
LOCK_BYTES = b'{"pid": 1, "host": "elsewhere", "command": "elflow train"}\n'  # the lock a run holds while written


def run_readers(run: Path, out: Path, cache: Path, judge: Path) -> dict[str, list]:
    """Each command that reads a run, on `run`, writing under `out`."""
    return {
        "sample": ["sample", run, "--num", "1", "--steps", "1", "--device", "cpu", "--quiet", "--out",
                   out / "s.jsonl"],
        "resume": ["train", "--resume", "--out", run, "--steps", "3", "--cache-dir", cache, "--quiet"],
        "distill": ["distill", run, "--out", out / "d", "--student-steps", "1", "--teacher-steps", "2",
                    "--steps-per-round", "1", "--batch", "2", "--dtype", "fp32", "--cache-dir", cache, "--quiet"],
        "eval": ["eval", "--checkpoint", run, "--judge", judge, "--device", "cpu", "--no-heldout", "--num", "2",
                 "--steps", "1", "--cache-dir", cache, "--out", out / "e"],
        "push": ["push", run, "me/model", "--dry-run", "--samples", "1", "--device", "cpu", "--out", out / "p"],
    }


READERS = ("sample", "resume", "distill", "eval", "push")
SAMPLING = ("sample", "eval")
NOT_READ = {  # (file, command) -> why the command does not read that file (the case is not run)
    **{("run.json", c): "sampling reads the newest checkpoint, whose state.json holds the model's record; "
                        "run.json holds the training settings" for c in SAMPLING},
    **{("optimizer.pt", c): "the optimiser's state is read by a resume, and checked whole by push, only"
       for c in ("sample", "eval", "distill")},
    **{("model.safetensors", c): "sampling and teaching read the EMA weights" for c in ("sample", "eval", "distill")},
    **{("metrics.jsonl", c): "the training log is read by a resume and by push only"
       for c in ("sample", "eval", "distill")},
    **{("lock", c): "a command that reads a run takes no lock on it; one that writes it does"
       for c in ("sample", "eval", "distill", "push")},
}
EDIT_ACCEPTED = {  # (file, class, command) -> why the edit is not bad input there
    **{("metrics.jsonl", k, c): "a log cut short (as by a crash mid-write) is read up to its last whole line"
       for k in ("empty", "truncated") for c in ("resume", "push")},
}
EDIT_XFAIL = {  # (file, class, command) -> what goes wrong
}


EDIT_CASES = [pytest.param(f, k, c, marks=[pytest.mark.xfail(strict=True, reason=EDIT_XFAIL[f, k, c])]
                           if (f, k, c) in EDIT_XFAIL else [])
              for f in RUN_FILES_EDITED for k in EDITS for c in READERS
              if (f, c) not in NOT_READ and (f, k, c) not in EDIT_ACCEPTED]


@pytest.fixture
def edited_run(world, tmp_path):
    """A copy of the world's run in a case folder of its own, with a folder `outside` beside it."""
    run = tmp_path / "run"
    shutil.copytree(world.run, run)
    (tmp_path / "outside").mkdir()
    (tmp_path / "out").mkdir()
    return run


@pytest.mark.parametrize("name, kind, cmd", EDIT_CASES, ids=str)
def test_a_run_file_that_elflow_did_not_write_is_refused_by_every_reader(capsys, world, edited_run, name, kind, cmd):
    """A run's own file (its record, a checkpoint's files, its log, its lock) replaced by a link (to a copy
    outside, to /dev/zero), a fifo, a folder, an empty or a truncated file: every command that reads it refuses
    in one line naming it, before any work, under the alarm (a fifo is never opened to wait on, a device never
    read); nothing in the run or outside it changes."""
    case = edited_run.parent
    path = edited_run / RUN_FILES_EDITED[name]
    data = path.read_bytes() if path.is_file() else LOCK_BYTES
    if os.path.lexists(path):
        path.unlink()
    EDITS[kind](path, case / "outside", data)
    argv = run_readers(edited_run, case / "out", world.cache, world.judge)[cmd]
    before, kids = tree_state(case), set(children())
    code, err = run_case(capsys, world, argv)
    errors = [x for x in err.splitlines() if "error" in x.lower()]
    command = "train" if cmd == "resume" else cmd
    assert_one_error(code, "\n".join(errors), command, path.name)
    assert tree_state(case) == before
    assert set(children()) <= kids


def test_every_run_file_exception_is_a_real_case():
    cases = {(f, k, c) for f in RUN_FILES_EDITED for k in EDITS for c in READERS}
    assert {(f, c) for f, c in NOT_READ} <= {(f, c) for f, _, c in cases}
    assert set(EDIT_ACCEPTED) <= cases and set(EDIT_XFAIL) <= cases


# ----------------------------------------------------------------------------------------------------------
# nested run folders: a progressive distillation's rounds and a flow-map student, holding another's file


class Distilled:
    """A progressive distillation of two rounds (OUT/2-step, OUT/1-step) and a flow-map student, distilled
    from the world's run once, with copies to put each back in place (at the same path: a distillation's
    records name its folders) after a case."""

    def __init__(self, world: World, root: Path):
        self.world = world
        self.argv = {
            "pd": ["distill", world.run, "--student-steps", "2,1", "--teacher-steps", "2", "--steps-per-round", "1",
                   "--batch", "2", "--dtype", "fp32", "--cache-dir", world.cache, "--quiet"],
            "flow-map": ["distill", world.run, "--objective", "flow-map", "--steps", "1", "--student-steps", "2",
                         "--batch", "2", "--dtype", "fp32", "--cache-dir", world.cache, "--quiet"],
        }
        self.out = {kind: root / kind for kind in self.argv}
        self.kept = {kind: root / f"{kind}.kept" for kind in self.argv}
        for kind, argv in self.argv.items():
            assert main([str(a) for a in argv + ["--out", self.out[kind]]]) == 0
            shutil.copytree(self.out[kind], self.kept[kind], symlinks=True)

    def put_back(self, kind: str) -> Path:
        shutil.rmtree(self.out[kind], ignore_errors=True)
        shutil.copytree(self.kept[kind], self.out[kind], symlinks=True)
        return self.out[kind]


@pytest.fixture(scope="module")
def distilled(world, tmp_path_factory):
    return Distilled(world, tmp_path_factory.mktemp("distilled"))


FOREIGN_AT = {  # output -> where another program's file is put, from the top down
    "pd": ["", "2-step", "1-step/checkpoints/step_0000001"],
    "flow-map": ["", "checkpoints", "checkpoints/step_0000001"],
}
RESUMING = {"pd": [], "flow-map": ["--steps", "3", "--keep", "1"]}  # a flow-map resume that prunes its checkpoints
def _nested_case(kind, where, flag):
    return pytest.param(kind, where, flag, id=f"{kind}-{where or 'top'}-{flag[2:]}")


@pytest.mark.parametrize("kind, where, flag", [_nested_case(k, w, f) for k, places in FOREIGN_AT.items()
                                               for w in places for f in ("--overwrite", "--resume")])
def test_a_file_of_another_inside_nested_run_folders_is_never_deleted(capsys, world, distilled, kind, where, flag):
    """`distill --overwrite` on an output holding a file it did not write, at any depth (the output's top, a
    round's folder, its checkpoints): refused in one line naming that file, nothing changed. `--resume` writes
    only what the run writes (new checkpoints, its log) and prunes only its own checkpoints: the file is never
    deleted (kept where it is, or the resume refused in one line naming it)."""
    out = distilled.put_back(kind)
    foreign = out / where / "notes.txt"
    foreign.write_text("mine")
    argv = distilled.argv[kind] + ["--out", out, flag] + (RESUMING[kind] if flag == "--resume" else [])
    before = tree_state(out)
    code, err = run_case(capsys, world, argv)
    assert "Traceback" not in err, err
    if flag == "--overwrite" or code != 0:
        errors = [x for x in err.splitlines() if "error" in x.lower()]
        assert_one_error(code, "\n".join(errors), "distill", str(foreign.parent), "notes.txt")
        assert tree_state(out) == before
    assert foreign.is_file() and foreign.read_text() == "mine", f"{foreign} was deleted"


# ----------------------------------------------------------------------------------------------------------
# the Python API: every argument of the public entries, of a wrong type or value


API_BAD = {  # class -> a value no argument of these entries takes (unless API_ACCEPTED says why it does)
    "object": object(),
    "text": "nonsense",
    "negative": -1,
    "nan": float("nan"),
    "huge": 10**12,
    "list": [1, 2],
    "empty-tuple": (),
    "meta-tensor": "meta-tensor",  # made in the test: torch is imported by then
}


def _api_entries():
    import elflow
    from elflow.generate import generate
    from elflow.runs.load import load_for_sampling
    from elflow.sampler import integrate

    return {"elflow.load": elflow.load, "load_for_sampling": load_for_sampling, "generate": generate,
            "integrate": integrate}


API_PARAMS = [(entry, p) for entry, fn in _api_entries().items() for p in inspect.signature(fn).parameters]
FLAG = "a flag: any value is read by its truth value, as Python reads one"
API_ACCEPTED = {  # (entry, argument) or (entry, argument, class) -> why the value is not bad there (not run)
    ("generate", "progress"): FLAG,
    ("generate", "drop_source"): FLAG,
    ("generate", "source_length"): "read with sources only (none here)",
    ("generate", "source_slot"): "read with sources only (none here)",
    ("generate", "prompt", "text"): "a text is a prompt",
    ("generate", "suffix", "text"): "a text is a suffix",
    ("generate", "part", "list"): "[1, 2] is rank 1 of 2 ranks, as (1, 2)",
    ("generate", "trajectory", "empty-tuple"): "no step recorded",
}
API_XFAIL: dict = {}  # (entry, argument) -> what goes wrong: a raw Python error instead of an ELFError
API_XFAIL_VALUES: dict = {}  # (entry, argument, class) -> what goes wrong


def _api_case(entry, param, kind):
    reason = API_XFAIL.get((entry, param)) or API_XFAIL_VALUES.get((entry, param, kind))
    return pytest.param(entry, param, kind, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [],
                        id=f"{entry}-{param}-{kind}")


@pytest.fixture(scope="module")
def api(world):
    """entry -> (the function, arguments of a good call): the world's run, loaded once."""
    import torch

    from elflow.flow import time_grid
    from elflow.generate import SamplingSettings
    from elflow.runs.load import load_for_sampling

    net, space = load_for_sampling(str(world.run), device="cpu")
    entries = _api_entries()
    good = {
        "elflow.load": dict(path_or_hub_id=str(world.run), device="cpu"),
        "load_for_sampling": dict(path_or_hub_id=str(world.run), device="cpu"),
        "generate": dict(net=net, space=space, num=1, settings=SamplingSettings(steps=1), progress=False),
        "integrate": dict(net=net, z0=torch.randn(1, 4, net.config.dim), grid=time_grid(2), sampler="sde"),
    }
    return {e: (entries[e], good[e]) for e in entries}, net, space


@pytest.mark.parametrize("entry, param, kind", [
    _api_case(e, p, k) for e, p in API_PARAMS for k in API_BAD
    if (e, p) not in API_ACCEPTED and (e, p, k) not in API_ACCEPTED])
def test_a_bad_argument_of_the_python_api_is_one_elferror(api, entry, param, kind):
    """elflow.load, load_for_sampling, generate and integrate, each argument (read from their signatures: one
    added later is tried too) given a value of a wrong type or range: an ELFError of one line, never a raw
    Python or torch error from deep inside."""
    import torch

    from elflow.util.errors import ELFError

    fn, good = api[0][entry]
    value = torch.zeros(2, device="meta") if kind == "meta-tensor" else API_BAD[kind]
    with pytest.raises(ELFError) as e:
        with alarm(LIMIT_S):
            fn(**{**good, param: value})
    assert "\n" not in str(e.value).strip(), str(e.value)


def test_every_api_exception_is_a_real_argument():
    params = set(API_PARAMS)
    for key in [*API_ACCEPTED, *API_XFAIL, *API_XFAIL_VALUES]:
        assert key[:2] in params and (len(key) == 2 or key[2] in API_BAD), key


NET_DTYPES = ("float16", "bfloat16", "float64")


@pytest.mark.parametrize("dtype", NET_DTYPES)
@pytest.mark.parametrize("entry", ["generate", "integrate"])
def test_a_network_in_another_dtype_is_one_elferror(api, entry, dtype):
    """A network whose weights were converted to another dtype (elflow samples fp32 weights, with autocast for
    bf16): one ELFError naming the dtype, never a matmul's dtype error."""
    import copy

    import torch

    from elflow.util.errors import ELFError

    (fn, good), net = api[0][entry], api[1]
    with pytest.raises(ELFError):
        fn(**{**good, "net": copy.deepcopy(net).to(getattr(torch, dtype))})


def _number():
    from hypothesis import strategies as st

    return st.one_of(st.integers(-3, 4), st.sampled_from([0, 10**12, -(10**12), True]), st.none(), st.text(max_size=2),
                     st.floats(allow_nan=True, allow_infinity=True))


def test_any_sampling_settings_sample_or_are_one_elferror(api):
    """SamplingSettings of any numbers (negative, zero, huge, NaN, inf, a bool, a text, None) for each knob:
    generate gives one record, or refuses with one ELFError line; never a raw error, never a hang."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from elflow.generate import SamplingSettings, generate
    from elflow.util.errors import ELFError

    _, net, space = api

    @settings(max_examples=30, deadline=None, database=None)
    @given(st.fixed_dictionaries({}, optional={k: _number() for k in ("steps", "gamma", "omega", "guidance", "seed",
                                                                         "batch_size")}))
    def check(knobs):
        try:
            with alarm(LIMIT_S):
                records = generate(net, space, 1, SamplingSettings(**knobs), progress=False)
        except ELFError as e:
            assert "\n" not in str(e).strip()
            return
        assert len(records) == 1 and isinstance(records[0]["text"], str)

    check()


def test_any_z0_and_grid_integrate_or_are_one_elferror(api):
    """integrate's z0 of any shape, dtype and values (NaN, inf, empty, integers, complex, meta) and any time grid
    (reversed, not monotone, out of [0, 1], NaN, one point, 2-D): a result of z0's shape with finite values, or
    one ELFError line."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from elflow.sampler import integrate
    from elflow.util.errors import ELFError

    _, net, _ = api
    dim = net.config.dim
    dtypes = st.sampled_from(["float32", "float16", "bfloat16", "float64", "int64", "bool", "complex64"])
    times = st.one_of(st.floats(-0.5, 1.5), st.sampled_from([float("nan"), float("inf"), -float("inf")]))

    @settings(max_examples=40, deadline=None, database=None)
    @given(batch=st.integers(0, 2), length=st.integers(0, 20), width=st.sampled_from([dim - 1, dim, dim + 1]),
           dtype=dtypes, fill=st.sampled_from([None, float("nan"), float("inf")]), meta=st.booleans(),
           grid=st.one_of(st.lists(times, max_size=5), st.lists(st.floats(0, 1), min_size=2, max_size=5).map(sorted)),
           flat=st.booleans())
    def check(batch, length, width, dtype, fill, meta, grid, flat):
        z0 = torch.randn(batch, length, width) if fill is None else torch.full((batch, length, width), fill)
        z0 = z0.to(getattr(torch, dtype)) if not meta else torch.empty(batch, length, width, device="meta")
        g = torch.tensor(grid, dtype=torch.float32)
        g = g[None] if not flat and g.numel() else g
        try:
            with alarm(LIMIT_S):
                z, x = integrate(net, z0, g, sampler="sde", generator=torch.Generator().manual_seed(0))
        except ELFError as e:
            assert "\n" not in str(e).strip()
            return
        assert z.shape == z0.shape and bool(torch.isfinite(z).all()) and bool(torch.isfinite(x).all())

    check()


def test_any_load_arguments_load_or_are_one_elferror(world):
    """elflow.load of the world's run with any device (a name, a number, meta, a GPU this machine lacks) and any
    max_length (zero, negative, huge, fractional, a bool, a text): the network, at least as long as asked, or one
    ELFError line."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import elflow
    from elflow.util.errors import ELFError

    devices = st.sampled_from([None, "cpu", "meta", "cuda:3", "tpu", "", 5, torch.device("meta"), torch.device("cpu")])
    lengths = st.one_of(st.none(), st.integers(-3, 40), st.sampled_from([10**12, 2.5, True, "16"]))

    @settings(max_examples=25, deadline=None, database=None)
    @given(device=devices, max_length=lengths)
    def check(device, max_length):
        try:
            with alarm(LIMIT_S):
                net = elflow.load(str(world.run), device=device, max_length=max_length)
        except ELFError as e:
            assert "\n" not in str(e).strip()
            return
        assert net.config.max_length >= (max_length or 0) and next(net.parameters()).device.type == "cpu"

    check()
