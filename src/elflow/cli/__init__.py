"""The `elflow` command line: one subcommand per job, one small module per subcommand in this package.

Each module exposes `add_arguments(parser)` and `run(args) -> int` and holds every argparse use of its
command; the work itself is the library's. Modules are imported only when their subcommand is built or run, so
`elflow --help` stays fast. Every error caused by input is one line, `elflow CMD: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import unicodedata
import warnings

import elflow  # the package itself, always loaded first: its version
from elflow.util.distributed import peer_lost
from elflow.util.errors import ELFError, check_seed
from elflow.util.files import disk_full, stdout_to_nowhere

# name -> (module, one-line help). Order is the order shown by `elflow --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("elflow.cli.quickstart",
                   "the offline default: fetch the corpus, train the demo model, sample and report"),
    "prepare": ("elflow.cli.prepare", "tokenize a corpus once into a memory-mapped token store (train --data STORE)"),
    "train": ("elflow.cli.train", "train an ELF model, or an AR / MDLM baseline (alone or under torchrun)"),
    "sample": ("elflow.cli.sample", "generate text from a run, a checkpoint or a released model"),
    "view": ("elflow.cli.view", "a sampling trajectory (sample --trajectory) as one self-contained HTML page"),
    "distill": ("elflow.cli.distill", "few-step students: progressive distillation (16 -> 8 -> 4 -> 2 -> 1), or "
                                     "one flow-map student for every step count (--objective flow-map)"),
    "eval": ("elflow.cli.eval", "generative perplexity and entropy, BLEU, ROUGE"),
    "train-judge": ("elflow.cli.train_judge", "train a small offline autoregressive judge"),
    "train-encoder": ("elflow.cli.train_encoder", "train a small T5 encoder from scratch by span corruption (a space)"),
    "sweep": ("elflow.cli.sweep", "sampler x steps x omega grid, judged and plotted (paper Figure 3)"),
    "claims": ("elflow.cli.claims", "re-test the paper's ablation findings at small scale, with seeds and a verdict"),
    "compare": ("elflow.cli.compare", "train ELF, an AR and an MDLM baseline for one budget and judge them alike"),
    "push": ("elflow.cli.push", "upload a trained model with a model card to the Hugging Face Hub (or --dry-run)"),
    "convert": ("elflow.cli.convert", "convert a released checkpoint to an elflow checkpoint folder"),
    "bench": ("elflow.cli.bench", "time forward / train / sample against the device's matmul peak"),
    "toy": ("elflow.cli.toy", "Figure 1: the 2-D toy with an exact denoiser"),
    "schedules": ("elflow.cli.schedules", "Figure 2: the training distributions and sampling grids"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default once: not when its help already says it, and not when there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other error of elflow: the command's error and
    where its flags are listed (the usage block is --help's)."""

    def error(self, message):
        what = "commands" if self.prog == "elflow" else "flags"
        self.exit(2, one_line(f"{self.prog}: error: {message} (`{self.prog} --help` lists the {what})") + "\n")


EMPTY_OK = {"prompt", "suffix", "message", "wandb"}  # "" means something here: no text; --wandb '' turns W&B off


def _refuse_empty_values(p: argparse.ArgumentParser, args) -> None:
    """An empty string is no path, space, device or name: `--out ""` (an unset shell variable, say) is refused
    here, for every command and argument at once, rather than read as the current folder."""
    for a in p._actions:
        if a.dest not in EMPTY_OK and getattr(args, a.dest, None) == "":
            name = a.option_strings[0] if a.option_strings else (a.metavar or a.dest).upper()
            rest = ", or leave the flag out" if a.option_strings else ""
            p.error(f"argument {name}: an empty value; give it one (a path, a name){rest}")


def _load(name: str):
    module_name, _ = COMMANDS[name]
    return importlib.import_module(module_name)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="elflow",
        description="ELF: text generation by flow matching in a frozen encoder's embedding space.",
    )
    parser.add_argument("--version", action="version", version=f"elflow {elflow.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = {}
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)
        parser.subcommands[name] = p
        if only is None or only == name:
            _load(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only import the module of the chosen subcommand (torch and friends are slow to import).
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only=chosen)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported with the usage of the subcommand they were given to
        parser.subcommands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 0
    _refuse_empty_values(parser.subcommands[args.command], args)
    module = _load(args.command)
    previous = _one_line_signals_and_warnings(args.command)
    try:
        check_seeds(args)
        check_wandb(args)
        return int(module.run(args) or 0)
    except Terminated as e:  # `outcome`: what the command's clean-up did with its output, where it says
        end_bars()
        outcome = getattr(e, "outcome", None) or "what it was writing was left as it was"
        say(args.command, f"stopped by SIGTERM ({outcome})")
        return 128 + signal.SIGTERM
    except ELFError as e:
        end_bars()
        say(args.command, f"error: {e}")
        return 2
    except BrokenPipeError:  # the reader of standard output went away (`| head`): nothing more to show
        end_bars()
        stdout_to_nowhere()
        return 0
    except OSError as e:  # a system failure outside elflow's checks: one line, not a traceback
        end_bars()
        where = f": {e.filename}" if e.filename else ""
        if disk_full(e):
            say(args.command, f"error: no space left on device{where}; free some space, then run the command again")
            return 2
        say(args.command, f"error: {e.strerror or e}{where}")
        return 1
    except KeyboardInterrupt as e:
        end_bars()
        outcome = getattr(e, "outcome", None)
        say(args.command, "interrupted" + (f" ({outcome})" if outcome else ""))
        return 130
    except RuntimeError as e:  # a collective whose peer process died (torchrun): one line
        if not peer_lost(e):
            raise
        end_bars()
        say(args.command, f"error: {peer_lost(e)}")
        return 2
    finally:
        _restore(previous)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}  # embeddings, overrides, isolates


def one_line(text) -> str:
    """`text` as one line that cannot move the terminal's cursor: a newline, carriage return or tab, any other
    control character (C0, DEL, C1), a Unicode line or paragraph separator and a bidirectional override are
    written as escapes (\\n, \\r, \\t, \\x1b, \\u2028, \\u202e). A path with such a character in its name
    stays one line in a message."""
    out = []
    for ch in str(text):
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch in _BIDI or unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def say(command: str, message: str) -> None:
    """The command's closing line on stderr, `elflow CMD: MESSAGE`, as one line (`one_line`)."""
    print(one_line(f"elflow {command}: {message}"), file=sys.stderr)


def check_seeds(args) -> None:
    """Every seed flag of every command (--seed, --seeds, --space-seed) in the range elflow's generators take."""
    for name, value in vars(args).items():
        if name in ("seed", "seeds") or name.endswith("_seed"):
            for v in value if isinstance(value, list) else [value]:
                if v is not None:
                    check_seed(v, "--" + name.replace("_", "-"))


def check_wandb(args) -> None:
    """An empty --wandb (of any command that takes it) is refused: it would log nothing and say nothing. On
    `train --resume` an empty --wandb is the switch that turns a run's W&B logging off, said in one line."""
    value = getattr(args, "wandb", None)
    if value is None or value.strip():
        return
    if value == "" and args.command == "train" and getattr(args, "resume", False):
        print("note: --wandb '': W&B logging is off for this run from here on", file=sys.stderr)
        return
    hint = "; on `train --resume`, --wandb '' turns a run's W&B logging off" if args.command == "train" else ""
    raise ELFError(f"--wandb {value!r} is empty: pass a W&B project name, or leave --wandb out for no W&B "
                   f"logging{hint}")


def _open_bars() -> list:
    """The progress bars (tqdm) still open in this process."""
    std = sys.modules.get("tqdm.std")
    return list(getattr(std.tqdm, "_instances", ())) if std is not None else []


def end_bars() -> None:
    """Close the open progress bars, so that a message printed next starts on a line of its own."""
    for bar in _open_bars():
        try:
            bar.close()
        except Exception:  # a bar whose stream is gone: nothing to end
            pass


class Terminated(BaseException):
    """SIGTERM, raised where the command is, so that its clean-up runs (temporary files go, a replaced run
    comes back) as after Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated()


_shown: set[str] = set()


def _one_line_warnings(message, category, filename, lineno, file=None, line=None):
    """A warning as one line, each text once per command (a check made in two places warns once)."""
    if str(message) not in _shown:
        _shown.add(str(message))
        bars = _open_bars()
        line = one_line(f"warning: {message}")
        if bars:  # above the bars, which are drawn again below it
            bars[0].write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)


def _one_line_signals_and_warnings(command: str):
    """SIGTERM becomes `Terminated`; a warning is one line, `warning: ...`. Returns what to restore."""
    previous = {"showwarning": warnings.showwarning}
    _shown.clear()
    warnings.showwarning = _one_line_warnings
    try:
        previous["sigterm"] = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: the default stays
        pass
    return previous


def _restore(previous: dict) -> None:
    warnings.showwarning = previous["showwarning"]
    if "sigterm" in previous:
        signal.signal(signal.SIGTERM, previous["sigterm"])

