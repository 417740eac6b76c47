"""Small shared helpers: atomic file writes, devices, seeding, float64 categorical draws."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


__all__ = ["ELFError", "atomic_write", "atomic_write_text", "atomic_write_json", "check_output", "default_device",
           "sha256_file", "cache_root", "sample_categorical"]


class ELFError(Exception):
    """An error caused by the user's input: printed as one clear message, without a traceback."""


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Open a temporary file next to `path`; on success rename it over `path`, on error remove it.

    A reader never sees a half-written file, and a crash leaves the previous version intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def check_output(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse an output file that exists (unless `overwrite`) or cannot be written, before any work is done."""
    path = Path(path)
    if path.is_dir():
        raise ELFError(f"{path} is a folder; pass a file name for the output")
    if path.exists() and not overwrite:
        raise ELFError(f"{path} exists; pass --overwrite to replace it, or choose another output name")
    parent = path.parent
    for p in [parent, *parent.parents]:
        if p.exists():
            if not p.is_dir():
                raise ELFError(f"cannot write {path}: {p} is a file, not a folder")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ELFError(f"cannot write {path}: {p} is not writable (read-only file system or no permission)")
            break
    return path


def atomic_write_text(path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """elflow's cache folder: `cache_dir`, else $ELFLOW_CACHE, else ~/.cache/elflow."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ELFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "elflow"


def sample_categorical(weights, generator=None):
    """One draw per row of `weights` (..., V): non-negative, not necessarily normalised. Returns (...) ids.

    Inverse CDF in float64: u ~ U[0, 1) scaled by the row's total, the first index whose cumulative weight
    exceeds it. A zero-weight id is never drawn. Float64 matters: the float32 Gumbel-max trick
    (argmax of log p + Gumbel noise, with u in float32) truncates the Gumbel tail, so low-probability ids are
    drawn too rarely: samples lose entropy and their generative perplexity looks better than the model's.
    """
    import torch

    cdf = weights.to(torch.float64).cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), dtype=torch.float64, generator=generator, device=cdf.device)
    total = cdf[..., -1:].contiguous()
    ids = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last id of positive weight (u * total may round up)
    return torch.minimum(ids, last).squeeze(-1)
