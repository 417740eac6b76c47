"""`elflow train`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from elflow.cli.train_flags import add_config_arguments, given_config, with_default
from elflow.config import RUN_DEFAULTS, TrainConfig, mutable_flags, resume_conflicts
from elflow.lifecycle.claim import absolute_paths, relocated, stored_config
from elflow.train import train
from elflow.util.devices import check_device
from elflow.util.distributed import on_rank0, process_group, torchrun_env
from elflow.util.errors import ELFError
from elflow.util.files import check_output, check_stdout_open, print_result


# ----------------------------------------------------------------------------------------------------------
# CLI: one flag per TrainConfig field, plus the flags that say where and how to run
def add_arguments(p) -> None:
    """The run settings' flags (runconfig), then where and how to run; every flag defaults to "not given"."""
    add_config_arguments(p)
    g = p.add_argument_group("where and how to run")
    S = argparse.SUPPRESS
    g.add_argument("--out", default=S, help=with_default("run folder", "runs/<preset>"))
    g.add_argument("--resume", action="store_true", default=S,
                   help="continue the run in --out from its last good checkpoint, with its stored settings; flags "
                        f"may change only {mutable_flags()}")
    g.add_argument("--overwrite", action="store_true", default=S,
                   help="replace the run in --out; the old run is kept until the new run's first checkpoint is "
                        "written, and other files in the folder are left alone")
    g.add_argument("--device", default=S, help=with_default("cpu or cuda; under torchrun each rank takes its GPU",
                                                            "cuda when available"))
    g.add_argument("--cache-dir", default=S, help=with_default("tokenization and download cache",
                                                               "$ELFLOW_CACHE or ~/.cache/elflow"))
    g.add_argument("--quiet", action="store_true", default=S, help="no progress bar, samples or resume notes")
    g.add_argument("--print-config", action="store_true", default=S,
                   help="print the resolved settings as JSON and exit without training")


def config_from_args(args) -> TrainConfig:
    """The run's settings: the stored ones on --resume (with the changes the command line may make), else the
    command line over the defaults (or over --defaults NAME); resolved and checked."""
    defaults = getattr(args, "defaults", None)
    given = given_config(args, RUN_DEFAULTS[defaults][0] if defaults in RUN_DEFAULTS else None)
    if getattr(args, "resume", False):
        if hasattr(args, "defaults"):
            raise ELFError("--defaults does not go with --resume: a resumed run keeps its stored settings")
        out = args.out if hasattr(args, "out") else f"runs/{given.get('preset', TrainConfig.preset)}"
        stored = relocated(stored_config(check_output(out, folder=True)), given)  # its paths read from here
        merged = {**stored.to_dict()}
        for k, v in given.items():
            merged[k] = {**(merged[k] or {}), **v} if isinstance(v, dict) else v
        cfg = absolute_paths(TrainConfig(**merged).resolved())
        diff = resume_conflicts(stored, cfg, run_device(getattr(args, "device", None)))
        if diff:
            raise ELFError(f"on --resume only {mutable_flags()} may change; "
                           f"the command line changes {'; '.join(diff)}. Drop those flags, or start a new run in "
                           "another --out")
    else:
        cfg = TrainConfig.named(defaults, **given).resolved()
    cfg.validate()
    return cfg.resolved(run_device(getattr(args, "device", None)))


def run_device(device: str | None):
    """The device this process trains on: --device, else its rank's GPU under torchrun (LOCAL_RANK, checked by
    torchrun_env; one process reads none of torchrun's variables), else the default."""
    device = check_device(device)
    if device is None and torch.cuda.is_available():
        group = torchrun_env()
        return torch.device("cuda", group[2] if group is not None else 0)
    return torch.device(device or "cpu")


def _group_timeout(args) -> float | None:
    """The process group's timeout for `elflow train`: --dist-timeout, else the stored run's on --resume (when
    this rank can read it), else the default."""
    if hasattr(args, "dist_timeout"):
        return args.dist_timeout
    if getattr(args, "resume", False):
        out = Path(getattr(args, "out", None) or f"runs/{getattr(args, 'preset', TrainConfig.preset)}")
        try:
            return float(stored_config(out).dist_timeout)
        except (ELFError, OSError, ValueError, KeyError, TypeError, OverflowError):
            pass
    return None


def run(args) -> int:
    if getattr(args, "print_config", False):
        check_stdout_open("--print-config")
    # first the group, so that rank 0 alone reads a stored run and every rank hears what it found
    with process_group(check_device(getattr(args, "device", None)), _group_timeout(args)) as (rank, world, _):
        cfg = on_rank0(lambda: config_from_args(args), rank, world)
        if getattr(args, "print_config", False):
            if rank == 0:
                print_result(json.dumps(cfg.to_dict(), indent=2))
            return 0
        out = args.out if hasattr(args, "out") else f"runs/{cfg.preset}"
        check_output(out, folder=True)  # an empty --out is an error, not the current folder
        command = "elflow train " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train"] else "elflow train"
        summary = train(cfg, out, resume=getattr(args, "resume", False), overwrite=getattr(args, "overwrite", False),
                        cache_dir=getattr(args, "cache_dir", None), quiet=getattr(args, "quiet", False),
                        device=getattr(args, "device", None), command=command)
    if summary.get("last") and rank == 0:
        print(f"done: step {summary['end_step']}, loss {summary['last']['loss']:.4f}; run folder {out}")
    return 0
