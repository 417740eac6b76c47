"""Flags shared by several commands: the sampler's and W&B's."""

from __future__ import annotations

from pathlib import Path

from elflow.flow import FEW_STEPS, GRIDS, SAMPLERS, SAMPLING_DEFAULTS, SAMPLING_RANGES
from elflow.generate import SamplingSettings
from elflow.methods.baseline import KNOB_RANGES, BaselineSampling
from elflow.methods.mdlm import MDLMSampling
from elflow.runs.tracking import HELP_PROJECT
from elflow.util.budget import check_count
from elflow.util.devices import AUTOCAST_DTYPES
from elflow.util.errors import ELFError


def _own(key: str, distilled: str | None = None) -> str:
    """'(default: the model's own: ...)': a sampling setting's default by the kind of model, as
    generate.SAMPLING_DEFAULTS states them."""
    text, cond = SAMPLING_DEFAULTS["text"][key], SAMPLING_DEFAULTS["conditional"][key]
    if distilled is None:
        few, more = SAMPLING_DEFAULTS["distilled"][key], SAMPLING_DEFAULTS["distilled-long"][key]
        distilled = f"{few} for distilled ones" + (f", {more} past {FEW_STEPS} steps" if more != few else "")
    return f"(default: the model's own: {text} for text models, {cond} for conditional ones, {distilled})"


def add_sampling_arguments(p) -> None:
    """The sampler flags; unset ones take the model's own defaults (a conditional or distilled model's),
    else SamplingSettings'. Their plain ranges are checked by `check_sampling_flags`."""
    d = SamplingSettings()
    p.add_argument("--steps", type=int, default=None,
                   help="sampling steps N " + _own("steps", "a distilled one's own step count")[:-1]
                        + f"; an MDLM's reverse steps: {MDLMSampling().steps})")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="ode: Euler; sde: the released SDE-style step; vc: variance-consistent re-noising "
                        + _own("sampler"))
    p.add_argument("--gamma", type=float, default=None, help="SDE back-off scale " + _own("gamma"))
    p.add_argument("--omega", type=float, default=None,
                   help="self-conditioning guidance scale " + _own("omega")[:-1]
                        + "; 1.0 for a network without self-conditioning)")
    p.add_argument("--guidance", type=float, default=None,
                   help="source guidance of conditional models: v = v_u + g (v_c - v_u) (default: the model's own: "
                        f"{SAMPLING_DEFAULTS['conditional']['guidance']} for conditional models)")
    p.add_argument("--grid", choices=GRIDS, default=None,
                   help=f"time grid (default {d.grid})")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"samples per batch (default {d.batch_size}; {BaselineSampling.batch_size} for AR and MDLM "
                        "baselines)")
    p.add_argument("--dtype", choices=AUTOCAST_DTYPES, default=None,
                   help=f"autocast precision (default {d.dtype})")
    p.add_argument("--temperature", type=float, default=None,
                   help="AR and MDLM baselines: divide the logits by this (default 1)")
    p.add_argument("--top-p", type=float, default=None, help="AR baselines: nucleus sampling mass (default 1)")


def check_sampling_flags(args) -> None:
    """The plain ranges of the sampler flags given (those of `add_sampling_arguments`), checked before any
    model is read: ELFError naming the flag."""
    check_scales(args, **{"batch" if k == "batch_size" else k: v for k, v in SAMPLING_RANGES.items()}, **KNOB_RANGES)


def check_counts(args, **bounds) -> None:
    """Each named integer flag that is set, in its range: bounds name=(limit, why) or (limit, why, low); one line
    naming the flag otherwise (elflow.util.budget.check_count). Lists (nargs="+") are checked value by value."""
    for name, (limit, why, *low) in bounds.items():
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None:
                check_count(v, f"--{name.replace('_', '-')}", limit, why, *low)


def check_scales(args, **ranges) -> None:
    """Each named flag (or list of them) that is set, within its range: ranges name=(check, what); one line
    naming the flag otherwise."""
    for name, (ok, what) in ranges.items():
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not ok(v):
                shown = f"{v:,}" if isinstance(v, int) else f"{v:g}"
                raise ELFError(f"--{name.replace('_', '-')} must be {what}, got {shown}")


def check_samples_out(out: str) -> None:
    """`sample --out` names the JSONL samples file: an .html name is refused, naming the --out that gives the
    page it was meant for."""
    if Path(out).suffix.lower() in (".html", ".htm"):
        page = Path(out).with_suffix(".jsonl").with_suffix(".trajectory.html")
        raise ELFError(f"--out {out} names the samples file, which is JSONL (one object per line), not a page; "
                       f"the page of --html goes beside it, to OUT.trajectory.html: pass --out "
                       f"{Path(out).with_suffix('.jsonl')} to get {page}")


def add_arguments(p, name_note: str = "") -> None:
    """--wandb PROJECT and --wandb-run NAME in their own group of parser `p`."""
    g = p.add_argument_group("Weights & Biases")
    g.add_argument("--wandb", default=None, metavar="PROJECT", help=HELP_PROJECT)
    g.add_argument("--wandb-run", default=None, metavar="NAME",
                   help=f"the W&B run's display name{'; ' + name_note if name_note else ''} (default: the output "
                        "folder's name)")
