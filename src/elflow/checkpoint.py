"""elflow's checkpoints: a folder of plain data, written atomically, verified on load.

    run/checkpoints/step_0001000/
        model.safetensors      the trained weights (network, and a learned embedding table if any)
        ema.safetensors        the EMA weights (used for sampling)
        space.safetensors      the embedding space's trained parameters, if it has any (a learned table)
        optimizer.pt           optimiser state and RNG states (tensors and numbers: loads with weights_only=True)
        state.json             step, config (model, space, data, recipe, training), data position,
                               and the sha256 of every other file

The folder is written under a temporary name and renamed, so a kill during a save leaves the previous
checkpoint intact; the last K are kept. A file that does not match its recorded hash is refused by name.
Checkpoints written before space.safetensors existed hold those parameters in model.safetensors under
"space."-prefixed names; `split_space_state` reads both layouts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from elflow.utils import ELFError, atomic_write_json, sha256_file as _sha256

__all__ = ["write_checkpoint", "save_checkpoint", "load_checkpoint", "list_checkpoints", "latest_checkpoint", "resolve_checkpoint",
           "is_elflow_checkpoint", "split_space_state", "remove_stale_temporaries"]

STEP_DIR = re.compile(r"step_(\d+)")
SPACE_PREFIX = "space."  # the older layout: space parameters inside model.safetensors


def write_checkpoint(folder: str | os.PathLike, model_sd: dict, ema_sd: dict, optimizer_state, state: dict,
                     space_sd: dict | None = None) -> Path:
    """Write one checkpoint folder atomically: built under a temporary sibling name, then renamed."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    old = None
    try:
        contig = lambda sd: {k: v.detach().contiguous().cpu() for k, v in sd.items()}  # noqa: E731
        save_file(contig(model_sd), tmp / "model.safetensors")
        save_file(contig(ema_sd), tmp / "ema.safetensors")
        names = ["model.safetensors", "ema.safetensors"]
        if space_sd:
            save_file(contig(space_sd), tmp / "space.safetensors")
            names.append("space.safetensors")
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
            names.append("optimizer.pt")
        files = {name: _sha256(tmp / name) for name in names}
        atomic_write_json(tmp / "state.json", {**state, "files": files})
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # re-saving the same step (the final save of a resumed run): the old one goes last
            old = final.parent / f".tmp-{final.name}-replaced-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.rename(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def split_space_state(model_sd: dict) -> tuple[dict, dict]:
    """(network weights, space parameters) of a model state dict in the older layout (prefixed names)."""
    net = {k: v for k, v in model_sd.items() if not k.startswith(SPACE_PREFIX)}
    space = {k[len(SPACE_PREFIX):]: v for k, v in model_sd.items() if k.startswith(SPACE_PREFIX)}
    return net, space


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of saves that were killed mid-way (`.tmp-step_*`); returns them."""
    root = Path(run_dir) / "checkpoints"
    stale = [p for p in root.glob(".tmp-step_*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def save_checkpoint(run_dir: str | os.PathLike, step: int, model_sd: dict, ema_sd: dict, optimizer_state,
                    state: dict, keep: int = 3, space_sd: dict | None = None) -> Path:
    """Write checkpoints/step_<step>/ atomically, then keep the newest `keep` (0: keep all)."""
    final = write_checkpoint(Path(run_dir) / "checkpoints" / f"step_{step:07d}", model_sd, ema_sd,
                             optimizer_state, {**state, "step": step}, space_sd)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoint folders of a run, oldest first (temporary folders are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def is_elflow_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").exists() and (path / "model.safetensors").exists()


def verify_checkpoint(ckpt: Path, need_optimizer: bool = True) -> dict:
    """state.json, with every file's hash checked; ELFError naming the first bad file. Without
    `need_optimizer`, a missing optimizer.pt is allowed (sampling needs only the weights)."""
    state_path = ckpt / "state.json"
    try:
        state = json.loads(state_path.read_text())
    except FileNotFoundError:
        raise ELFError(f"{state_path}: missing; {ckpt} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ELFError(f"{state_path}: corrupted ({e})") from None
    for name, digest in state.get("files", {}).items():
        f = ckpt / name
        if not f.exists():
            if name == "optimizer.pt" and not need_optimizer:
                continue
            raise ELFError(f"{f}: missing from the checkpoint")
        if _sha256(f) != digest:
            raise ELFError(f"{f}: corrupted or truncated (its sha256 does not match the one recorded at save)")
    return state


def load_checkpoint(ckpt: str | os.PathLike, with_optimizer: bool = True, map_location="cpu") -> dict:
    """Read and verify a checkpoint folder: {"state", "model", "ema", "optimizer"}."""
    ckpt = Path(ckpt)
    state = verify_checkpoint(ckpt, need_optimizer=with_optimizer)
    out = {"state": state, "path": ckpt}
    try:
        out["model"] = load_file(ckpt / "model.safetensors", device=str(map_location))
        out["ema"] = load_file(ckpt / "ema.safetensors", device=str(map_location))
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise ELFError(f"{ckpt}: weights cannot be read ({e})") from None
    if with_optimizer:
        if not (ckpt / "optimizer.pt").exists():
            raise ELFError(f"{ckpt}: holds no optimiser state (a converted checkpoint?); it can sample, not resume")
        try:
            out["optimizer"] = torch.load(ckpt / "optimizer.pt", map_location=map_location, weights_only=True)
        except Exception as e:
            raise ELFError(f"{ckpt / 'optimizer.pt'}: cannot be read with weights_only=True ({e})") from None
    return out


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr)


def latest_checkpoint(run_dir: str | os.PathLike, verify: bool = True, warn=_warn,
                      need_optimizer: bool = True) -> Path | None:
    """The newest checkpoint that passes verification; bad ones are reported (on stderr) and skipped."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if not verify:
            return ckpt
        try:
            verify_checkpoint(ckpt, need_optimizer)
            return ckpt
        except ELFError as e:
            warn(f"warning: skipping a bad checkpoint: {e}")
    return None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder (its newest good checkpoint) or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if is_elflow_checkpoint(path):
        return path
    if path.is_dir() and (path / "checkpoints").is_dir():
        ckpt = latest_checkpoint(path, need_optimizer=False)
        if ckpt is None:
            raise ELFError(f"{path}: this run has no usable checkpoint yet")
        return ckpt
    raise ELFError(f"{path}: neither an elflow run folder nor a checkpoint folder")
