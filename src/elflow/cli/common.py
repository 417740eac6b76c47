"""Flags shared by several commands: the sampler's and W&B's."""

from __future__ import annotations

from elflow.flow import SAMPLERS
from elflow.generate import SamplingSettings
from elflow.runs.tracking import HELP_PROJECT


def add_sampling_arguments(p) -> None:
    """The sampler flags; unset ones take the model's own defaults (a conditional or distilled model's),
    else SamplingSettings'."""
    d = SamplingSettings()
    p.add_argument("--steps", type=int, default=None, help=f"sampling steps N (default {d.steps})")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help=f"ode: Euler; sde: the released SDE-style step; vc: variance-consistent re-noising "
                        f"(default {d.sampler})")
    p.add_argument("--gamma", type=float, default=None, help=f"SDE back-off scale (default {d.gamma})")
    p.add_argument("--omega", type=float, default=None, help=f"self-conditioning guidance scale (default {d.omega})")
    p.add_argument("--guidance", type=float, default=None,
                   help="source guidance of conditional models: v = v_u + g (v_c - v_u) (default 1; 2 for the "
                        "released conditional models)")
    p.add_argument("--grid", choices=["logit_normal", "uniform"], default=None,
                   help=f"time grid (default {d.grid})")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    p.add_argument("--batch", type=int, default=None, help=f"samples per batch (default {d.batch_size})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="autocast precision (default fp32)")
    p.add_argument("--temperature", type=float, default=None,
                   help="AR and MDLM baselines: divide the logits by this (default 1); --steps sets an MDLM's "
                        "reverse steps (default 64)")
    p.add_argument("--top-p", type=float, default=None, help="AR baselines: nucleus sampling mass (default 1)")


def add_arguments(p, name_note: str = "") -> None:
    """--wandb PROJECT and --wandb-run NAME in their own group of parser `p`."""
    g = p.add_argument_group("Weights & Biases")
    g.add_argument("--wandb", default=None, metavar="PROJECT", help=HELP_PROJECT)
    g.add_argument("--wandb-run", default=None, metavar="NAME",
                   help=f"the W&B run's display name{'; ' + name_note if name_note else ''} (default: the output "
                        "folder's name)")
