"""Small helpers shared by the tests: the reference vectors' folder, a tiny run's settings, a checkpoint's weights."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from elflow.train import TrainConfig


REFERENCE = Path(__file__).resolve().parent / "reference"
MISSING_DATA = "missing data"  # the reason of a skip for absent files; ELFLOW_STRICT_SKIPS=1 turns it into a failure


def reference_dir(*names: str) -> Path:
    """tests/reference, after checking that it holds `names` (the authors' reference vectors: README there).
    Usable at module level: a missing file skips the module with a reason that strict runs refuse."""
    missing = [n for n in names if not (REFERENCE / n).exists()]
    if missing:
        pytest.skip(f"{MISSING_DATA}: tests/reference lacks {', '.join(missing)}", allow_module_level=True)
    return REFERENCE


def tiny_config(t5_dir, corpus, **kw) -> TrainConfig:
    """A run of the tiny preset on the tiny corpus in the tiny T5's space: 6 steps, a checkpoint every 3."""
    base = dict(preset="tiny", data=str(corpus), space=f"t5:{t5_dir}", length=16, batch=4, steps=6, warmup=2,
                ema_decay=0.9, log_every=1, ckpt_every=3, keep=5, dtype="fp32", seed=1)
    return TrainConfig(**{**base, **kw})


def checkpoint_weights(run: Path, step: int):
    """(weights, EMA weights) of a run's checkpoint at `step`."""
    ck = Path(run) / "checkpoints" / f"step_{step:07d}"
    return load_file(ck / "model.safetensors"), load_file(ck / "ema.safetensors")


def run_alone_and_on_two_ranks(args: list[str], one: Path, two: Path) -> None:
    """`elflow ARGS --out ONE` in one process and `--out TWO` under torchrun with two Gloo ranks."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "elflow.cli", *args, "--out", str(one)], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "elflow.cli", *args, "--out", str(two)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
