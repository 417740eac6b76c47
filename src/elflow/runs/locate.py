"""Where a model is: a path or hub id -> the folder or file that holds it, and its kind.

    checkpoint     an elflow checkpoint folder (a run folder resolves to its newest good checkpoint)
    model-folder   a model folder, as `elflow push` uploads it
    released       a released checkpoint_<step> file (a folder holding one resolves to the newest)

A hub id (owner/name that is no local path) is downloaded first. Anything else is one line saying what the
path is: missing, empty, a fifo or a device, a token store, a run without a checkpoint.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from elflow.data.store import is_store
from elflow.runs.checkpoint import CHECKPOINTS, is_elflow_checkpoint, is_elflow_folder, newest_first, resolve_checkpoint
from elflow.runs.model_folder import is_model_folder
from elflow.runs.released import find_released_file
from elflow.util.errors import ELFError
from elflow.util.hub import hub_offline, hub_reachable, hub_unavailable_reason
from elflow.util.jsonio import open_regular

KINDS = ("checkpoint", "model-folder", "released")


@dataclass(frozen=True)
class Located:
    kind: str  # one of KINDS
    path: Path  # the checkpoint folder (a run's newest), the model folder or the released file
    given: str  # the path or hub id as given
    # a run folder's checkpoints, newest first, none read yet: the reader takes the first that reads whole
    candidates: tuple[Path, ...] = ()


def is_hub_id(s: str) -> bool:
    """owner/name, not an existing local path."""
    return (s.count("/") == 1 and not s.startswith((".", "/", "~")) and not s.endswith("/")
            and not os.path.lexists(s))


def download(repo_id: str) -> Path:
    """A hub model's files (a snapshot of its checkpoints, weights and JSON files)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ELFError(f"{repo_id!r} is no local path, and fetching it as a Hugging Face Hub id needs "
                       "huggingface_hub: pip install huggingface_hub") from None
    if not hub_offline() and not hub_reachable():
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it cannot be "
                       f"fetched: {hub_unavailable_reason()}. Check the path.")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["checkpoint_*", "*.safetensors", "*.json", "*.yml",
                                                               "*.yaml", "*.md"]))
    except Exception as e:  # the hub client's own error types, in one line
        first = " ".join(str(e).split())
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it could not be "
                       f"fetched ({type(e).__name__}: {first[:300]}). Check the path, or, without a hub, download "
                       "the checkpoint_<step> file elsewhere and pass its path.") from None


def describe_path(p: Path) -> str | None:
    """What a path that exists but holds no model is, in words (None for a regular file or a folder)."""
    try:
        mode = os.stat(p).st_mode
    except OSError as e:
        if os.path.islink(p):
            return "a symbolic link that leads nowhere (dangling or a loop)"
        return f"unreadable ({e.strerror or e})"
    for test, kind in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def locate(path_or_hub_id) -> Located:
    """The model at a path or hub id (module docstring); one ELFError for anything else."""
    s = str(path_or_hub_id)
    if s == "":
        raise ELFError("the model path is empty; pass a run or checkpoint folder, a model folder, a released "
                       "checkpoint_<step> file or a hub id")
    p = Path(s).expanduser()
    if not os.path.lexists(p):
        if not is_hub_id(s):
            raise ELFError(f"{s}: no such file or folder (nor a hub id of the form owner/name)")
        p = download(s)
    what = describe_path(p)
    if what is not None:
        raise ELFError(f"{p} is {what}, not a model; pass a run or checkpoint folder, a model folder or a released "
                       "checkpoint_<step> file")
    if p.is_file():
        with open_regular(p) as f:  # never a fifo or a device
            head = f.read(4)
        if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or a pickle
            raise ELFError(f"{p}: not a checkpoint; pass an elflow run or checkpoint folder, or a released "
                           "checkpoint_<step> file")
        return Located("released", p, s)
    if is_model_folder(p):
        return Located("model-folder", p, s)
    if p.is_dir() and (p / CHECKPOINTS).is_dir() and not is_elflow_checkpoint(p):
        candidates = tuple(newest_first(p))
        if not candidates:
            raise ELFError(f"{p}: this run has no checkpoint yet")
        return Located("checkpoint", candidates[0], s, candidates)
    if is_elflow_checkpoint(p) or is_elflow_folder(p):
        ckpt = resolve_checkpoint(p)
        return Located("checkpoint", ckpt, s, (ckpt,))
    if is_store(p):
        raise ELFError(f"{p} is a token store (made by `elflow prepare`: training data, for --data), not a run, a "
                       "checkpoint or a model; pass a run or checkpoint folder")
    return Located("released", find_released_file(p), s)
