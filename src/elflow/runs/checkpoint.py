"""Checkpoint folders and the run folders that hold them, as every reader sees them.

    run/checkpoints/step_0001000/
        model.safetensors      the trained weights            ema.safetensors   the EMA weights (sampling)
        space.safetensors      a learned space's parameters   optimizer.pt      optimiser and RNG states
        state.json             step, data position and store, the digest of the model's record (which is the run's
                               run.json's), and the sha256 of every other file (elflow.runs.stored writes it)
        state.sha256           the sha256 of state.json

A checkpoint is written under a temporary name and renamed, verified file by file when read, and never
unpickled (optimizer.pt loads with weights_only=True). The state.json of an earlier elflow is read as today's
by elflow.runs.migrate. A run that `--overwrite` set aside (RUN/.replaced-run) comes back before a reader looks.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from elflow.runs.folder import (
    CHECKPOINTS,
    DISTILL_MANIFEST,
    EMA_WEIGHTS,
    MODEL_WEIGHTS,
    OPTIMIZER_STATE,
    REPLACED,
    RUN_FILE,
    RUN_FILES,
    SPACE_WEIGHTS,
    STATE_FILE,
    STATE_HASH,
    STEP_DIR,
    step_dir,
)
from elflow.runs.migrate import document
from elflow.runs.record import is_current
from elflow.util.errors import ELFError, first_line
from elflow.util.files import FolderLock, NoSpace, atomic_write_text, disk_full, file_mode, folder_mode, signals_held
from elflow.util.files import sha256_file as _sha256
from elflow.util.jsonio import RECORD_BYTES, parse, read_limited

SPACE_PREFIX = "space."  # space parameters inside model.safetensors (the other layout)


# ----------------------------------------------------------------------------------------------------------
# a run replaced by --overwrite: its files wait in RUN/.replaced-run until the new run's first checkpoint


def set_aside(out: Path, names=RUN_FILES) -> None:
    """Move the files `names` of the folder (never other files) into OUT/.replaced-run."""
    aside = out / REPLACED
    aside.mkdir()
    for name in names:
        if os.path.lexists(out / name):
            os.rename(out / name, aside / name)


def restore_aside(out: Path, names=RUN_FILES) -> None:
    """Put the files set aside back: every one of `names` now in the folder was written by the command that
    was replacing them (the old ones were all set aside), so it goes."""
    aside = out / REPLACED
    for name in names:
        new = out / name
        if new.is_dir() and not new.is_symlink():
            shutil.rmtree(new)
        elif os.path.lexists(new):
            new.unlink()
        if os.path.lexists(aside / name):
            os.rename(aside / name, new)
    for left in aside.iterdir():  # set aside under a name no longer listed
        os.rename(left, out / left.name)
    aside.rmdir()


def holds_set_aside(out: Path) -> bool:
    """Whether OUT/.replaced-run is what elflow set aside (a folder holding a run's run.json or a distillation's
    distill.json), not a user's folder of that name."""
    aside = out / REPLACED
    return aside.is_dir() and any(os.path.lexists(aside / n) for n in (RUN_FILE, DISTILL_MANIFEST))


def recover_replaced(out: Path, done, names=RUN_FILES) -> str | None:
    """A replacement that was interrupted (the folder is held by the caller): with `done(out)` (the new run
    got as far as its first checkpoint) the files set aside go ("dropped"), else they come back
    ("restored"). None when nothing was set aside."""
    if not (out / REPLACED).is_dir():
        return None
    if not holds_set_aside(out):
        raise ELFError(f"{out / REPLACED}: a folder elflow did not set aside (it holds no {RUN_FILE} or "
                       f"{DISTILL_MANIFEST}), under the name "
                       "elflow keeps a replaced run in; nothing was changed: move it out of the run folder, then "
                       "run again")
    if done(out):
        shutil.rmtree(out / REPLACED)
        return "dropped"
    restore_aside(out, names)
    return "restored"


def bring_back_replaced(run_dir: Path, command: str = "elflow") -> None:
    """For a reader of a run folder: the run that an interrupted --overwrite set aside comes back first (under
    the folder's lock; refused while the replacing command still runs)."""
    if not (run_dir / REPLACED).is_dir() or list_checkpoints(run_dir):
        return
    with FolderLock(run_dir, f"{command} (restoring the run set aside)"):
        if recover_replaced(run_dir, lambda d: bool(list_checkpoints(d))) == "restored":
            print_warning(f"restored the run in {run_dir} that an interrupted --overwrite was replacing")




def write_checkpoint(folder: str | os.PathLike, model_sd: dict, ema_sd: dict, optimizer_state, state: dict,
                     space_sd: dict | None = None) -> Path:
    """Write one checkpoint folder atomically: built under a temporary sibling name, then renamed. A full disk
    (whichever writer meets it: safetensors, torch.save, json) is a `NoSpace` error naming the checkpoint;
    the previous checkpoints are untouched."""
    final = Path(folder)
    old = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    except OSError as e:
        if disk_full(e):
            raise NoSpace(final) from None
        raise
    try:
        os.chmod(tmp, folder_mode())
        contig = lambda sd: {k: v.detach().contiguous().cpu() for k, v in sd.items()}  # noqa: E731
        save_file(contig(model_sd), tmp / MODEL_WEIGHTS)
        save_file(contig(ema_sd), tmp / EMA_WEIGHTS)
        names = [MODEL_WEIGHTS, EMA_WEIGHTS]
        if space_sd:
            save_file(contig(space_sd), tmp / SPACE_WEIGHTS)
            names.append(SPACE_WEIGHTS)
        if optimizer_state is not None:
            with open(tmp / OPTIMIZER_STATE, "wb") as f, signals_held():  # (a Python file: its OSError is the
                torch.save(optimizer_state, f)  # cause torch reports; a signal comes once the zip is whole)
            names.append(OPTIMIZER_STATE)
        files = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in names}
        write_state(tmp, {**state, "files": files})
        for f in tmp.iterdir():
            os.chmod(f, file_mode())  # safetensors makes its files 0600; a checkpoint's files get the umask's mode
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # re-saving the same step (the final save of a resumed run): the old one goes last
            old = final.parent / f".tmp-{final.name}-replaced-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.rename(old, final)
        if isinstance(e, Exception) and disk_full(e):
            raise NoSpace(final, f"no space left on device while writing the checkpoint {final}; it was not "
                                 "written (the earlier checkpoints are intact)") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_state(ckpt: str | os.PathLike, state: dict) -> None:
    """state.json of a checkpoint folder and, beside it, its sha256 (state.sha256)."""
    ckpt = Path(ckpt)
    text = json.dumps(state, indent=2) + "\n"
    atomic_write_text(ckpt / STATE_FILE, text)
    atomic_write_text(ckpt / STATE_HASH, hashlib.sha256(text.encode()).hexdigest() + "\n")


def split_space_state(model_sd: dict) -> tuple[dict, dict]:
    """(network weights, space parameters) of a model state dict that holds both (prefixed names: the layout
    of earlier checkpoints, read here alone)."""
    net = {k: v for k, v in model_sd.items() if not k.startswith(SPACE_PREFIX)}
    space = {k[len(SPACE_PREFIX):]: v for k, v in model_sd.items() if k.startswith(SPACE_PREFIX)}
    return net, space


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of saves that were killed mid-way (`.tmp-step_*`); returns them."""
    root = Path(run_dir) / CHECKPOINTS
    stale = [p for p in root.glob(TEMPORARY + "*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def save_checkpoint(run_dir: str | os.PathLike, model_sd: dict, ema_sd: dict, optimizer_state, state: dict,
                    keep: int = 3, space_sd: dict | None = None) -> Path:
    """Write checkpoints/step_<step>/ atomically (the step of `state`, elflow.runs.stored.checkpoint_state),
    then keep the newest `keep` (0: keep all)."""
    final = write_checkpoint(Path(run_dir) / CHECKPOINTS / step_dir(state["step"]), model_sd, ema_sd,
                             optimizer_state, state, space_sd)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        other = foreign_in(old)
        if other is not None:  # --keep removes checkpoints of elflow's own files only
            print_warning(f"warning: {old} is kept, not pruned by --keep: it holds {other.name}, which elflow did not "
                          "write; move that file out to let the checkpoint go")
            continue
        shutil.rmtree(old, ignore_errors=True)
    return final


CHECKPOINT_FILES = (STATE_FILE, STATE_HASH, MODEL_WEIGHTS, EMA_WEIGHTS, SPACE_WEIGHTS, OPTIMIZER_STATE)
TEMPORARY = ".tmp-step_"  # the prefix of a save's folder before it is renamed into place


def foreign_in(ckpt: Path) -> Path | None:
    """The first entry of a checkpoint folder that elflow does not write there (CHECKPOINT_FILES are all it
    writes); None when there is none."""
    return next((f for f in sorted(ckpt.iterdir()) if f.name not in CHECKPOINT_FILES), None)


def foreign_in_checkpoints(run_dir: str | os.PathLike) -> Path | None:
    """The first path under a run's checkpoints/ that elflow did not write: anything but checkpoint folders
    (step_N, holding CHECKPOINT_FILES alone) and the temporary folders of saves; None when there is none."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir() or root.is_symlink():
        return None  # a checkpoints/ that is no folder is the run's own checks' to refuse
    for p in sorted(root.iterdir()):
        if p.is_symlink() or not p.is_dir():
            return p
        if p.name.startswith(TEMPORARY):
            continue
        found = foreign_in(p) if STEP_DIR.fullmatch(p.name) else p
        if found is not None:
            return found
    return None


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoint folders of a run, oldest first (temporary folders are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def run_of(ckpt: Path) -> Path | None:
    """The run folder a checkpoint folder belongs to (RUN for RUN/checkpoints/step_N, beside RUN/run.json); None
    for a checkpoint read without its run (a copied checkpoint, an earlier converted release)."""
    run = ckpt.parent.parent
    return run if ckpt.parent.name == CHECKPOINTS and os.path.lexists(run / RUN_FILE) else None


def is_elflow_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).exists() and (path / MODEL_WEIGHTS).exists()


ELFLOW_MARKS = (CHECKPOINTS, RUN_FILE, REPLACED, STATE_FILE, STATE_HASH,
                "model.safetensors", EMA_WEIGHTS)


def is_elflow_folder(path: Path) -> bool:
    """An elflow run or checkpoint folder, complete or not (anything else is read as the released format)."""
    return path.is_dir() and any((path / name).exists() for name in ELFLOW_MARKS)


PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
SHA256 = re.compile(r"[0-9a-f]{64}")  # a sha256 digest as state.json records it


STATE_BYTES = RECORD_BYTES  # state.json: a data position (and, of an earlier elflow, a record)


def read_state(ckpt: Path) -> dict:
    """A checkpoint's state.json, checked against state.sha256 (both read as regular files, bounded, never
    through a link), with "files" normalised to {name: {"sha256", "bytes"}} (bytes None where an earlier
    elflow recorded no size): plain file names of this folder. ELFError naming the file otherwise."""
    state_path = ckpt / STATE_FILE
    if not os.path.lexists(state_path):
        raise ELFError(f"{state_path}: missing; {ckpt} is not a complete checkpoint")
    hash_path = ckpt / STATE_HASH
    data = read_limited(state_path, STATE_BYTES, own=True)
    if os.path.lexists(hash_path):
        try:
            recorded = read_limited(hash_path, 200, own=True).decode("ascii").strip()
        except UnicodeDecodeError:
            raise ELFError(f"{hash_path}: corrupted (not a sha256 digest)") from None
        if hashlib.sha256(data).hexdigest() != recorded:
            raise ELFError(f"{state_path}: corrupted or edited (its sha256 does not match {hash_path})")
    # else a checkpoint saved without it (an earlier elflow): its names are still checked below
    try:
        state = parse(data, str(state_path))
    except ELFError as e:
        raise ELFError(f"{state_path}: corrupted or truncated ({str(e).split(': ', 1)[-1]})") from None
    if not isinstance(state, dict):
        found = {"list": "array", "str": "string", "NoneType": "null"}.get(type(state).__name__, "number")
        raise ELFError(f"{state_path}: corrupted (a JSON object was expected, found {found})")
    state["files"] = listed_files(state.get("files", {}), state_path, "checkpoint")
    step = state.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ELFError(f"{state_path}: corrupted (\"step\" must be an integer >= 0, got {step!r})")
    for key in ("model", "space", "train", "settings", "record"):
        if key in state and state[key] is not None and not isinstance(state[key], dict):
            raise ELFError(f"{state_path}: corrupted ({key!r} must be a JSON object, got "
                           f"{type(state[key]).__name__})")
    state = state if is_current(state) else document(state, str(state_path))  # an earlier layout becomes today's
    if "record" not in state and not (isinstance(state.get("model_sha256"), str)
                                      and SHA256.fullmatch(state["model_sha256"])):
        raise ELFError(f"{state_path}: corrupted (\"model_sha256\" must be the sha256 of the model's record)")
    return state


def listed_files(files, where, what: str) -> dict:
    """The files a state.json (or a model folder's config.json) lists, {name: {"sha256", "bytes"}}: plain names
    of the folder, each with a sha256 digest and, where recorded, a size."""
    if not isinstance(files, dict):
        raise ELFError(f"{where}: corrupted (\"files\" must map file names to their sha256)")
    out = {}
    for name, v in files.items():
        if not isinstance(name, str) or not PLAIN_NAME.fullmatch(name) or name in (".", ".."):
            raise ELFError(f"{where}: refused: its \"files\" name {name!r}, which is not a plain file name in the "
                           f"{what} folder (nothing outside it is read)")
        digest, size = (v, None) if isinstance(v, str) else (
            (v.get("sha256"), v.get("bytes")) if isinstance(v, dict) else (None, None))
        if not isinstance(digest, str) or not SHA256.fullmatch(digest) or size is not None and (
                isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ELFError(f"{where}: corrupted (\"files\" must map {name} to its sha256 and size)")
        out[name] = {"sha256": digest, "bytes": size}
    return out


WEIGHT_FILE_MAX = 1 << 40  # no weight file of an earlier elflow's checkpoint, which recorded no size, is larger


def _check_file(f: Path, entry: dict, contents: bool = True) -> None:
    """A listed file as it must be: a regular file (not a link), of the recorded size and, with `contents`, of
    the recorded sha256 (read whole)."""
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise ELFError(f"{f}: missing from the checkpoint") from None
    if not stat.S_ISREG(st.st_mode):
        raise ELFError(f"{f}: not a regular file (a link, a device or a folder); refused")
    if entry["bytes"] is not None and st.st_size != entry["bytes"]:
        raise ELFError(f"{f}: corrupted or truncated ({st.st_size:,} bytes, {entry['bytes']:,} recorded at save)")
    if contents and _sha256(f) != entry["sha256"]:
        raise ELFError(f"{f}: corrupted or truncated (its sha256 does not match the one recorded at save)")


def verify_checkpoint(ckpt: Path, need_optimizer: bool = True, contents: bool = True) -> dict:
    """state.json (`read_state`), with every listed file checked (regular, its size and, with `contents`, its
    sha256: every file read whole); ELFError naming the first bad file. Without `need_optimizer`, a missing
    optimizer.pt is allowed (sampling needs only the weights). Without `contents`, the reader that loads the
    files checks each one's sha256 on the bytes it reads (`load_checkpoint`), so that each is read once."""
    state = read_state(ckpt)
    for name, entry in state["files"].items():
        if name == OPTIMIZER_STATE and not need_optimizer and not os.path.lexists(ckpt / name):
            continue
        _check_file(ckpt / name, entry, contents)
    return state


def read_checked(path: Path, sha256: str, size: int | None) -> bytes:
    """The bytes of a file that a checkpoint or model folder lists: read once as a regular file (never through a
    link), bounded by its recorded size, checked against the recorded size and sha256."""
    data = read_limited(path, size if size is not None else WEIGHT_FILE_MAX, own=True)
    if size is not None and len(data) != size:
        raise ELFError(f"{path}: corrupted or truncated ({len(data):,} bytes, {size:,} recorded at save)")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ELFError(f"{path}: corrupted or truncated (its sha256 does not match the one recorded at save)")
    return data


def load_tensors(path: Path, sha256: str, size: int | None) -> dict:
    """The tensors of a safetensors file that a checkpoint or model folder lists (`read_checked`)."""
    data = read_checked(path, sha256, size)
    try:
        return load(data)
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise ELFError(f"{path}: weights cannot be read ({first_line(e)})") from None


def check_tensors(sd: dict, where) -> None:
    """Weights as they must be: floating-point tensors, every value finite; ELFError naming `where` and the
    first tensor that is not."""
    for k, w in sd.items():
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            raise ELFError(f"{where}: weight {k} holds {getattr(w, 'dtype', type(w).__name__)} values, not "
                           "floating-point weights; refused")
        if not all_finite(w):
            raise ELFError(f"{where}: weight {k} holds NaN or infinite values; the model cannot sample (a training "
                           "that diverged, or a damaged file)")


SUMMED = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
          torch.float64: torch.float64}


def all_finite(w: torch.Tensor) -> bool:
    """Whether every value of `w` is finite, in one read of it where it can: a NaN or an infinity makes the sum
    NaN or infinite, so a finite sum proves every value finite; a sum that overflows (or a dtype not summed)
    is decided value by value."""
    wide = SUMMED.get(w.dtype)
    if wide is not None and bool(torch.isfinite(w.sum(dtype=wide))):
        return True
    return bool(torch.isfinite(w).all())


def load_weights(net: torch.nn.Module, sd: dict, where) -> None:
    """Load `sd` into `net`, every tensor checked first: the names and shapes of the network, floating-point
    values, all finite. One ELFError naming `where` and the first tensor that is not. A network built on the
    meta device (no initial weights: elflow.runs.load) takes the tensors themselves, each in its parameter's
    dtype, and makes its other buffers again (a module's `reset_buffers`); then nothing of it may be left on
    the meta device."""
    expected = net.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise ELFError(f"{where}: the weights do not fit the network its record describes: missing {missing[:4]}, "
                       f"unexpected {unexpected[:4]}")
    for k, v in expected.items():
        w = sd[k]
        if tuple(w.shape) != tuple(v.shape):
            raise ELFError(f"{where}: weight {k} has shape {tuple(w.shape)}, the network's is {tuple(v.shape)}")
    check_tensors(sd, where)
    if not any(t.is_meta for t in (*net.parameters(), *net.buffers())):
        net.load_state_dict(sd)
        return
    net.load_state_dict({k: sd[k].to(v.dtype) for k, v in expected.items()}, assign=True)
    for module in net.modules():  # the buffers no weight file holds, made again (`reset_buffers`)
        if hasattr(module, "reset_buffers") and any(t.is_meta for t in module.buffers(recurse=False)):
            module.reset_buffers()
    empty = [k for k, t in (*net.named_parameters(), *net.named_buffers()) if t.is_meta]
    if empty:  # (a tensor no weight file holds, left unmade: a fault of the network's definition)
        raise RuntimeError(f"{type(net).__name__} built on the meta device leaves {empty[:4]} unmade after loading")


UNLISTED = (MODEL_WEIGHTS, EMA_WEIGHTS, SPACE_WEIGHTS, OPTIMIZER_STATE)


def load_checkpoint(ckpt: str | os.PathLike, with_optimizer: bool = True, map_location="cpu", *,
                    model: bool = True, ema: bool = True, state: dict | None = None) -> dict:
    """Read a checkpoint folder, only the files its state.json lists, each read once and checked (its size and
    sha256) on the bytes read: {"state", "model" (the network's weights; {} unless `model`), "space" (a learned
    space's parameters, either layout; {} where none were saved or not read), "ema" ({} where none was saved or
    not `ema`), "optimizer"}. `state`: its state.json, already read (`read_state`). A weight file that is
    present but not listed is refused. Sampling with the EMA weights reads neither model.safetensors (unless
    the space's parameters live there) nor optimizer.pt."""
    ckpt = Path(ckpt)
    state = read_state(ckpt) if state is None else state
    files = state["files"]
    stray = [n for n in UNLISTED if n not in files and os.path.lexists(ckpt / n)]
    if stray:
        raise ELFError(f"{ckpt / stray[0]}: not listed in {ckpt / 'state.json'}; an unlisted file is never read "
                       "(remove it, or restore the checkpoint as it was saved)")
    if "model.safetensors" not in files:
        raise ELFError(f"{ckpt / 'state.json'}: corrupted (its \"files\" do not list model.safetensors)")
    out = {"state": state, "path": ckpt, "model": {}, "space": {}, "ema": {}}

    def tensors(name):
        sd = load_tensors(ckpt / name, files[name]["sha256"], files[name]["bytes"])
        return {k: v.to(map_location) for k, v in sd.items()} if str(map_location) != "cpu" else sd

    if model:
        out["model"], out["space"] = split_space_state(tensors(MODEL_WEIGHTS))
    if "space.safetensors" in files:
        out["space"] = tensors(SPACE_WEIGHTS)
    if ema and "ema.safetensors" in files:
        out["ema"] = tensors(EMA_WEIGHTS)
    if with_optimizer:
        out["optimizer"] = read_optimizer_state(ckpt, files, map_location)
    return out


def read_optimizer_state(ckpt: Path, files: dict, map_location="cpu") -> dict:
    """optimizer.pt of a checkpoint whose state.json lists `files`: read once, checked on the bytes read (its
    size and sha256), loaded with weights_only=True."""
    if OPTIMIZER_STATE not in files:
        raise ELFError(f"{ckpt}: holds no optimiser state (a converted checkpoint?); it can sample, not resume")
    path = ckpt / OPTIMIZER_STATE
    data = read_checked(path, files[OPTIMIZER_STATE]["sha256"], files[OPTIMIZER_STATE]["bytes"])
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:
        raise ELFError(f"{path}: cannot be read with weights_only=True ({first_line(e)}); it is corrupted, or holds "
                       "Python objects, which elflow never unpickles") from None


def newest_first(run_dir: str | os.PathLike) -> list[Path]:
    """A run folder's checkpoints, the newest first (an interrupted --overwrite's set-aside run brought back
    first), none verified: a reader tries each in turn and takes the first that reads whole."""
    run_dir = Path(run_dir)
    if run_dir.is_dir() and (run_dir / REPLACED).is_dir():
        bring_back_replaced(run_dir)
    return list(reversed(list_checkpoints(run_dir)))


def print_warning(msg: str) -> None:
    print(msg, file=sys.stderr)


def newest_usable(run_dir: str | os.PathLike, need_optimizer: bool = True,
                  contents: bool = True) -> tuple[Path | None, dict | None, list[str]]:
    """(the newest checkpoint of a run that passes verification (`verify_checkpoint`, with `contents` or not),
    its state.json, why each newer one does not). A checkpoint removed while it was read (`--keep` of a training
    that runs) is passed over without a word."""
    bad = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            return ckpt, verify_checkpoint(ckpt, need_optimizer, contents), bad
        except ELFError as e:
            if ckpt.exists():
                bad.append(str(e))
    return None, None, bad


def latest_checkpoint(run_dir: str | os.PathLike, warn=print_warning, need_optimizer: bool = True) -> Path | None:
    """The newest checkpoint that passes verification; bad ones are reported (on stderr) and skipped."""
    ckpt, _, bad = newest_usable(run_dir, need_optimizer)
    for why in bad:
        warn(f"warning: skipping a bad checkpoint: {why}")
    return ckpt


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder (its newest good checkpoint) or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if is_elflow_checkpoint(path):
        return path
    if path.is_dir() and (path / REPLACED).is_dir():
        bring_back_replaced(path)
    if path.is_dir() and (path / CHECKPOINTS).is_dir():
        ckpt, _, bad = newest_usable(path, need_optimizer=False)
        if ckpt is None:
            if bad:
                raise ELFError(f"{path}: none of its checkpoints can be read ({'; '.join(bad)})")
            raise ELFError(f"{path}: this run has no checkpoint yet")
        for why in bad:
            print_warning(f"warning: skipping a bad checkpoint: {why}")
        return ckpt
    if path.is_dir() and (path / STATE_FILE).exists():
        return path  # a checkpoint folder missing its weights: its verification names what is missing
    if is_elflow_folder(path):
        raise ELFError(f"{path}: an incomplete elflow checkpoint folder (no state.json); it cannot be read")
    raise ELFError(f"{path}: neither an elflow run folder nor a checkpoint folder")
