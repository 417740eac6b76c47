"""Small helpers shared by the tests: the reference vectors' folder, a tiny run's settings, a checkpoint's weights."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from elflow.train import TrainConfig
from elflow.utils import ELFError


REFERENCE = Path(__file__).resolve().parent / "reference"
MISSING_DATA = "missing data"  # the reason of a skip for absent files; ELFLOW_STRICT_SKIPS=1 turns it into a failure


EOS = 1


class CharSpace:
    """A stand-in space for layout tests: one token per character (ord + 10), EOS = 1, pad = EOS."""

    eos_id = pad_id = EOS
    tokenizer_id = "chars-v1"
    vocab_size = 0x110000 + 10  # every code point

    def __init__(self, max_length=None):
        self.max_length = max_length
        self.calls = 0

    def tokenize(self, texts, eos=True):
        self.calls += 1
        return [[ord(c) + 10 for c in t] + ([EOS] if eos else []) for t in texts]

    def check_length(self, length):
        if self.max_length is not None and length > self.max_length:
            raise ELFError(f"sequence length {length} is longer than the encoder accepts ({self.max_length})")


class SlowSpace(CharSpace):
    """CharSpace that takes `delay` seconds per tokenize call and appends a line to `log` for each call."""

    def __init__(self, delay: float, log):
        super().__init__()
        self.delay, self.log = delay, str(log)

    def tokenize(self, texts, eos=True):
        import os
        import time

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(self.delay)
        return super().tokenize(texts, eos)


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


def prepare_on_rank(rank: int, world: int, port: int, corpus: str, cache: str, log: str, out: str) -> None:
    """One rank of a Gloo group whose collectives time out after 2 s, reading a corpus whose preparation takes
    longer (SlowSpace); saves its training rows to `out`.<rank>."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from elflow.ingest import build_dataset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=2))
    try:
        train, _ = build_dataset(corpus, SlowSpace(4.0, log), 8, val_fraction=0.1, cache_dir=cache)
        torch.save(train.tokens, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
