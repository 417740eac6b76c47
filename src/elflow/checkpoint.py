"""elflow's checkpoints: a folder of plain data, written atomically, verified on load.

    run/checkpoints/step_0001000/
        model.safetensors      the trained weights (network, and a learned embedding table if any)
        ema.safetensors        the EMA weights (used for sampling)
        space.safetensors      the embedding space's trained parameters, if it has any (a learned table)
        optimizer.pt           optimiser state and RNG states (tensors and numbers: loads with weights_only=True)
        state.json             step, config (model, space, data, recipe, training), data position,
                               and the sha256 of every other file ("files": plain names in this folder)
        state.sha256           the sha256 of state.json itself

The folder is written under a temporary name and renamed, so a kill during a save leaves the previous
checkpoint intact; the last K are kept. A file that does not match its recorded hash is refused by name; so is a
"files" entry that is not a plain name of a regular file in the folder (nothing outside it is ever read).
A checkpoint may instead hold those parameters in model.safetensors under "space."-prefixed names;
`split_space_state` reads both layouts.

Every method's checkpoint (`elflow train --method elf|ar|mdlm`) has this layout; state.json names the method
("method"; a checkpoint without it is ELF's) and holds its network's config as "model" (and an ELF network's
short-run options as "short_run"). `load` / `load_for_sampling` build any method's network through the
method (`Loaded.method` says which); `read_weights`, which also feeds --init-from and distillation, refuses
by default every model but an ELF network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

from elflow.encoders import stored_spec
from elflow.generate import SAMPLING_DEFAULTS, distilled_defaults
from elflow.methods import get_method, require
from elflow.runconfig import TrainConfig
from elflow.model import ELF, ELFConfig
from elflow.official import infer_config, official_to_elflow, preset_name
from elflow.shortrun import describe_network, network_from_state_dict, options_of
from elflow.tracking import ID_FILE
from elflow.utils import (ELFError, FolderLock, NoSpace, atomic_write_text, default_device,
                          disk_full, file_mode, first_line, folder_mode, read_json, sha256_file as _sha256)

__all__ = ["write_checkpoint", "save_checkpoint", "load_checkpoint", "list_checkpoints", "latest_checkpoint", "resolve_checkpoint",
           "is_elflow_checkpoint", "split_space_state", "remove_stale_temporaries", "method_of", "read_weights",
           "load", "load_for_sampling", "load_init_weights", "check_init_compatible", "read_state", "write_state",
           "newest_usable", "RUN_FILES", "REPLACED", "set_aside", "restore_aside", "recover_replaced",
           "bring_back_replaced", "STATE_HASH", "MODEL_FORMAT", "is_model_folder", "model_folder_files",
           "write_model_folder", "read_model_folder", "stored_training"]

STEP_DIR = re.compile(r"step_(\d+)")
SPACE_PREFIX = "space."  # space parameters inside model.safetensors (the other layout)
STATE_HASH = "state.sha256"  # beside state.json: its sha256
REPLACED = ".replaced-run"  # a run's files that --overwrite set aside, kept until the new run's first checkpoint


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
        save_file(contig(model_sd), tmp / "model.safetensors")
        save_file(contig(ema_sd), tmp / "ema.safetensors")
        names = ["model.safetensors", "ema.safetensors"]
        if space_sd:
            save_file(contig(space_sd), tmp / "space.safetensors")
            names.append("space.safetensors")
        if optimizer_state is not None:
            with open(tmp / "optimizer.pt", "wb") as f:  # a Python file: its OSError is the cause torch reports
                torch.save(optimizer_state, f)
            names.append("optimizer.pt")
        files = {name: _sha256(tmp / name) for name in names}
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
    atomic_write_text(ckpt / "state.json", text)
    atomic_write_text(ckpt / STATE_HASH, hashlib.sha256(text.encode()).hexdigest() + "\n")


def split_space_state(model_sd: dict) -> tuple[dict, dict]:
    """(network weights, space parameters) of a model state dict that holds both (prefixed names)."""
    net = {k: v for k, v in model_sd.items() if not k.startswith(SPACE_PREFIX)}
    space = {k[len(SPACE_PREFIX):]: v for k, v in model_sd.items() if k.startswith(SPACE_PREFIX)}
    return net, space


def trained_space_state(ckpt: str | os.PathLike) -> dict:
    """The embedding space's trained parameters stored in a checkpoint folder (either layout)."""
    ckpt = Path(ckpt)
    if (ckpt / "space.safetensors").exists():
        return load_file(ckpt / "space.safetensors")
    return split_space_state(load_file(ckpt / "model.safetensors"))[1]


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


ELFLOW_MARKS = ("checkpoints", "run.json", REPLACED, "state.json", STATE_HASH,
                "model.safetensors", "ema.safetensors")


def is_elflow_folder(path: Path) -> bool:
    """An elflow run or checkpoint folder, complete or not (anything else is read as the authors' format)."""
    return path.is_dir() and any((path / name).exists() for name in ELFLOW_MARKS)


PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def read_state(ckpt: Path) -> dict:
    """A checkpoint's state.json, checked against state.sha256: a dict whose "files" maps plain file names of
    this folder to sha256 digests. ELFError naming the file otherwise."""
    state_path = ckpt / "state.json"
    if not state_path.is_file():
        raise ELFError(f"{state_path}: missing; {ckpt} is not a complete checkpoint")
    hash_path = ckpt / STATE_HASH
    try:
        recorded = hash_path.read_text().strip()
    except FileNotFoundError:
        recorded = None  # a checkpoint saved without it (an earlier elflow): its names are still checked below
    except (OSError, UnicodeDecodeError) as e:
        raise ELFError(f"{hash_path}: cannot be read ({e})") from None
    if recorded is not None and _sha256(state_path) != recorded:
        raise ELFError(f"{state_path}: corrupted or edited (its sha256 does not match {hash_path})")
    state = read_json(state_path)
    files = state.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ELFError(f"{state_path}: corrupted (\"files\" must map file names to sha256 digests)")
    bad = [k for k in files if not PLAIN_NAME.fullmatch(k) or k in (".", "..")]
    if bad:
        raise ELFError(f"{state_path}: refused: its \"files\" name {bad[0]!r}, which is not a plain file name in the "
                       "checkpoint folder (nothing outside it is read)")
    if not isinstance(state.get("step", 0), int) or state.get("step", 0) < 0:
        raise ELFError(f"{state_path}: corrupted (\"step\" must be an integer >= 0, got {state.get('step')!r})")
    for key in ("model", "space", "train", "settings"):
        if key in state and not isinstance(state[key], dict):
            raise ELFError(f"{state_path}: corrupted ({key!r} must be a JSON object, got "
                           f"{type(state[key]).__name__})")
    return state


def verify_checkpoint(ckpt: Path, need_optimizer: bool = True) -> dict:
    """state.json (`read_state`), with every file's hash checked; ELFError naming the first bad file. Without
    `need_optimizer`, a missing optimizer.pt is allowed (sampling needs only the weights)."""
    state = read_state(ckpt)
    for name, digest in state.get("files", {}).items():
        f = ckpt / name
        try:
            mode = os.lstat(f).st_mode
        except FileNotFoundError:
            if name == "optimizer.pt" and not need_optimizer:
                continue
            raise ELFError(f"{f}: missing from the checkpoint") from None
        if not stat.S_ISREG(mode):
            raise ELFError(f"{f}: not a regular file (a link, a device, a folder); refused")
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
        ema = ckpt / "ema.safetensors"  # a recorded file was checked above; an unrecorded one may be absent
        out["ema"] = load_file(ema, device=str(map_location)) if ema.exists() else {}
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise ELFError(f"{ckpt}: weights cannot be read ({first_line(e)})") from None
    if with_optimizer:
        if not (ckpt / "optimizer.pt").exists():
            raise ELFError(f"{ckpt}: holds no optimiser state (a converted checkpoint?); it can sample, not resume")
        try:
            out["optimizer"] = torch.load(ckpt / "optimizer.pt", map_location=map_location, weights_only=True)
        except Exception as e:
            raise ELFError(f"{ckpt / 'optimizer.pt'}: cannot be read with weights_only=True ({first_line(e)}); it is "
                           "corrupted, or holds Python objects, which elflow never unpickles") from None
    return out


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr)


def newest_usable(run_dir: str | os.PathLike, need_optimizer: bool = True) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint of a run that passes verification, why each newer one does not). A checkpoint
    removed while it was read (`--keep` of a training that runs) is passed over without a word."""
    bad = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(ckpt, need_optimizer)
            return ckpt, bad
        except ELFError as e:
            if ckpt.exists():
                bad.append(str(e))
    return None, bad


def latest_checkpoint(run_dir: str | os.PathLike, verify: bool = True, warn=_warn,
                      need_optimizer: bool = True) -> Path | None:
    """The newest checkpoint that passes verification; bad ones are reported (on stderr) and skipped."""
    if not verify:
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    ckpt, bad = newest_usable(run_dir, need_optimizer)
    for why in bad:
        warn(f"warning: skipping a bad checkpoint: {why}")
    return ckpt


# ----------------------------------------------------------------------------------------------------------
# a run replaced by --overwrite: its files wait in RUN/.replaced-run until the new run's first checkpoint


RUN_FILES = ("run.json", "metrics.jsonl", "loss.png", "checkpoints", "tb", "report.json", "samples.jsonl", "wandb",
             ID_FILE)


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


def recover_replaced(out: Path, done, names=RUN_FILES) -> str | None:
    """A replacement that was interrupted (the folder is held by the caller): with `done(out)` (the new run
    got as far as its first checkpoint) the files set aside go ("dropped"), else they come back
    ("restored"). None when nothing was set aside."""
    if not (out / REPLACED).is_dir():
        return None
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
            _warn(f"restored the run in {run_dir} that an interrupted --overwrite was replacing")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run folder (its newest good checkpoint) or a checkpoint folder -> the checkpoint folder."""
    path = Path(path)
    if is_elflow_checkpoint(path):
        return path
    if path.is_dir() and (path / REPLACED).is_dir():
        bring_back_replaced(path)
    if path.is_dir() and (path / "checkpoints").is_dir():
        ckpt, bad = newest_usable(path, need_optimizer=False)
        if ckpt is None:
            if bad:
                raise ELFError(f"{path}: none of its checkpoints can be read ({'; '.join(bad)})")
            raise ELFError(f"{path}: this run has no checkpoint yet")
        for why in bad:
            _warn(f"warning: skipping a bad checkpoint: {why}")
        return ckpt
    if path.is_dir() and (path / "state.json").exists():
        return path  # a checkpoint folder missing its weights: its verification names what is missing
    if is_elflow_folder(path):
        raise ELFError(f"{path}: an incomplete elflow checkpoint folder (no state.json); it cannot be read")
    raise ELFError(f"{path}: neither an elflow run folder nor a checkpoint folder")


# ----------------------------------------------------------------------------------------------------------
# the authors' released checkpoints: one torch.save file `checkpoint_<step>` holding a dict with "params" (the
# model state dict), "ema_params1" (the EMA weights, used for sampling), optimiser state and the step. Read
# with torch.load(weights_only=True), which refuses anything but tensors and plain containers.


def find_official_file(path: str | os.PathLike) -> Path:
    """A `checkpoint_<N>` file, or the one with the largest N in a folder."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = [(int(m.group(1)), p) for p in path.iterdir() if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
        if found:
            return max(found)[1]
        raise ELFError(f"{path}: no checkpoint_<step> file in this folder")
    raise ELFError(f"{path}: no such file or folder")


def read_official_checkpoint(path: str | os.PathLike, which: str = "ema_params1") -> dict[str, torch.Tensor]:
    """Their checkpoint file -> elflow-named state dict of `which` ("ema_params1" or "params")."""
    path = find_official_file(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for foreign objects, RuntimeError for truncated files
        raise ELFError(f"{path}: cannot be read as a tensors-only checkpoint ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}). It is truncated, corrupted, or holds arbitrary "
                       "Python objects, which elflow never unpickles.") from None
    if not isinstance(ckpt, dict) or "params" not in ckpt:
        keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ELFError(f"{path}: not an ELF checkpoint (expected a dict with 'params' and 'ema_params1', got {keys})")
    sd = ckpt.get(which) or ckpt["params"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ELFError(f"{path}: '{which}' is not a dict of tensors")
    return official_to_elflow(dict(sd))


def build_from_state_dict(sd: dict[str, torch.Tensor], max_length: int = 1024, heads: int | None = None,
                          config: ELFConfig | None = None, options=None) -> ELF:
    """An ELF network holding these (elflow-named) weights, its shape inferred unless `config` is given, with
    the short-run `options` (elflow.shortrun) if any."""
    return network_from_state_dict(sd, config, options, max_length=max_length, heads=heads)



# ----------------------------------------------------------------------------------------------------------
# a model folder: what `elflow push` uploads (and `push --dry-run` writes), and `elflow.load` reads back
#
#     model.safetensors    the EMA weights of the network
#     space.safetensors    the embedding space's trained parameters (a learned table), if any
#     config.json          format, method, the network's config (and short-run options), parameter counts, step,
#                          the sha256 of the weight files
#     recipe.json          the flow recipe and every training setting of the run (TrainConfig)
#     space.json           the embedding space's description and id
#     sampling.json        the model's layout (length, source length, task, distilled steps) and the sampler
#                          settings it samples with when no flag is given
#     README.md            the model card (elflow.hub)

MODEL_FORMAT = "elflow-model-1"
MODEL_JSON = ("config.json", "recipe.json", "space.json", "sampling.json")
NETWORK_KEYS = ("model", "short_run")  # the entries of a method's `describe` that a state holds


def _model_json(folder: Path, name: str) -> dict:
    path = folder / name
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise ELFError(f"{path}: missing; {folder} is not a complete elflow model folder") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ELFError(f"{path}: corrupted ({e})") from None
    if not isinstance(obj, dict):
        raise ELFError(f"{path}: expected a JSON object")
    return obj


def is_model_folder(path: Path) -> bool:
    """An elflow model folder (config.json of MODEL_FORMAT), not an authors' folder with its own config.json."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("format") == MODEL_FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError, OSError):
        return False


def model_folder_files(path: str | os.PathLike, sampling: dict | None = None) -> dict[str, object]:
    """The files of the model folder of an elflow run or checkpoint: {name: tensors (dict) or JSON object}.
    `sampling`: the sampler settings stored as its defaults (those it samples with from the run, if None)."""
    ckpt = resolve_checkpoint(path)
    blob = load_checkpoint(ckpt, with_optimizer=False)
    st = blob["state"]
    if not blob["ema"]:
        raise ELFError(f"{ckpt} holds no EMA weights; a model folder holds the EMA weights that sample")
    net_sd = {k: v for k, v in blob["ema"].items() if not k.startswith(SPACE_PREFIX)}
    space_sd = trained_space_state(ckpt)
    train = st.get("train", {})
    config = {"format": MODEL_FORMAT, "method": st.get("method", "elf"),
              **{k: st[k] for k in NETWORK_KEYS if k in st}, "params": st.get("params"), "step": st.get("step")}
    settings = {k: v for k, v in st.get("settings", {}).items() if k != "sampling"}
    if sampling is None:
        loaded = load(ckpt)
        sampling = get_method(loaded.method).settings(loaded).to_dict()
    defaults = {k: v for k, v in sampling.items() if k not in ("seed", "batch_size", "dtype", "method")}
    files = {"model.safetensors": net_sd, **({"space.safetensors": space_sd} if space_sd else {}),
             "config.json": config, "recipe.json": {"recipe": train.get("recipe", {}), "train": train},
             "space.json": {"space": st["space"], "space_id": st.get("space_id")},
             "sampling.json": {**settings, "sampling": defaults}}
    return files


def write_model_folder(files: dict[str, object], folder: str | os.PathLike) -> Path:
    """Write `model_folder_files` (and any text files given, such as README.md) into `folder`, the weights'
    sha256 recorded in config.json; each file atomically."""
    from elflow.utils import atomic_write, atomic_write_json, atomic_write_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            with atomic_write(folder / name) as f:
                f.write(save(content))
            digests[name] = _sha256(folder / name)
    for name, content in files.items():
        if name == "config.json":
            content = {**content, "files": digests}
        if isinstance(content, dict) and name.endswith(".json"):
            atomic_write_json(folder / name, content)
        elif isinstance(content, str):
            atomic_write_text(folder / name, content)
    return folder


def model_folder_state(folder: Path) -> dict:
    """A model folder's JSON files as one state in the layout of a checkpoint's state.json."""
    config = _model_json(folder, "config.json")
    recipe, space, sampling = (_model_json(folder, n) for n in MODEL_JSON[1:])
    if "space" not in space:
        raise ELFError(f"{folder / 'space.json'}: no space description")
    return {"method": config.get("method", "elf"), **{k: config[k] for k in NETWORK_KEYS if k in config},
            "params": config.get("params"), "step": config.get("step"), "train": recipe.get("train", {}),
            "space": space["space"], "space_id": space.get("space_id"), "settings": sampling,
            "files": config.get("files", {})}


def read_model_folder(folder: Path, use_ema: bool = True) -> tuple[dict, dict]:
    """(model_folder_state, the EMA weights) of a model folder, its weight files checked against their
    recorded sha256."""
    if not use_ema:
        raise ELFError(f"{folder} is a model folder: it holds the EMA weights only")
    state = model_folder_state(folder)
    files = state["files"]
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ELFError(f"{folder / 'config.json'}: corrupted (\"files\" must map file names to sha256 digests)")
    bad = [k for k in files if not PLAIN_NAME.fullmatch(k)]
    if bad:
        raise ELFError(f"{folder / 'config.json'}: refused: its \"files\" name {bad[0]!r}, which is not a plain file "
                       "name in the model folder (nothing outside it is read)")
    for name, digest in files.items():
        f = folder / name
        if not f.exists():
            raise ELFError(f"{f}: missing from the model folder")
        if _sha256(f) != digest:
            raise ELFError(f"{f}: corrupted or truncated (its sha256 does not match the one recorded in config.json)")
    try:
        sd = load_file(folder / "model.safetensors")
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise ELFError(f"{folder / 'model.safetensors'}: weights cannot be read ({e})") from None
    return state, sd


def stored_training(path: str | os.PathLike) -> dict | None:
    """The training settings (a TrainConfig dict) and space of an elflow run, checkpoint or model folder,
    {"train", "space", "settings"}; None for other formats (the authors' checkpoints, hub ids)."""
    p = Path(str(path)).expanduser()
    if is_model_folder(p):
        st = model_folder_state(p)
    elif is_elflow_checkpoint(p) or (p / "checkpoints").is_dir():
        st = verify_checkpoint(resolve_checkpoint(p), need_optimizer=False)
    else:
        return None
    return {"train": st.get("train", {}), "space": st.get("space"), "settings": st.get("settings", {})}


# ----------------------------------------------------------------------------------------------------------
# the one loader


AUTHORS_SPACE = {"kind": "t5", "name": "t5-small", "latent_std": 0.2}  # the released models' space

# the released conditional and distilled models: their layout and sampling defaults (known without flags)
RELEASES = {
    "ELF-B-de-en-torch": {"task": "wmt14-de-en", "length": 128, "source_length": 64,
                          "sampling": SAMPLING_DEFAULTS["conditional"]},
    "ELF-B-xsum-torch": {"task": "xsum", "length": 1088, "source_length": 1024,
                         "sampling": SAMPLING_DEFAULTS["conditional"]},
    "ELF-B-PD-owt-torch": {"distilled": True},
}


def is_hub_id(s: str) -> bool:
    """owner/name, not an existing local path."""
    return (s.count("/") == 1 and not s.startswith((".", "/", "~")) and not s.endswith("/")
            and not os.path.exists(s))


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ELFError(f"{repo_id!r} is no local path, and fetching it as a Hugging Face Hub id needs "
                       "huggingface_hub: pip install huggingface_hub") from None
    from elflow.utils import hub_offline, hub_reachable, hub_unavailable_reason

    if not hub_offline() and not hub_reachable():
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it cannot be "
                       f"fetched: {hub_unavailable_reason()}. Check the path.")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["checkpoint_*", "*.safetensors", "*.json", "*.yml",
                                                               "*.yaml", "*.md"]))
    except Exception as e:
        first = " ".join(str(e).split())
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it could not be "
                       f"fetched ({type(e).__name__}: {first[:300]}). Check the path, or, without a hub, download "
                       "the checkpoint_<step> file elsewhere and pass its path.") from None


def check_checkpoint_path(path) -> None:
    """Refuse, before anything is loaded, a path that is a file but no checkpoint (a text file, say)."""
    p = Path(str(path)).expanduser()
    if p.is_file():
        with open(p, "rb") as f:
            head = f.read(4)
        if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or a pickle
            raise ELFError(f"{p}: not a checkpoint; pass an elflow run or checkpoint folder, or an authors' "
                           "checkpoint_<step> file")


def _authors_settings(folder: Path, name: str) -> dict:
    """Layout and sampling defaults of an authors' checkpoint: its release's, then a config.json beside it
    (max_length, max_input_length)."""
    out = dict(next((v for k, v in RELEASES.items() if k in name), {}))
    f = folder / "config.json"
    if f.exists():
        try:
            cfg = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            cfg = {}
        if isinstance(cfg, dict):
            for key, ours in (("max_length", "length"), ("max_input_length", "source_length")):
                if isinstance(cfg.get(key), int):
                    out[ours] = cfg[key]
    return out


@dataclass
class Loaded:
    """A network with what it needs to be used: its embedding space's spec, its recipe and its settings.

    settings: "length" (the trained sequence length), "source_length" (conditional models), "task",
    "sampling" (default sampler settings), "distilled_steps", plus where it came from ("format",
    "checkpoint", "space_id")."""

    net: ELF
    space: dict
    recipe: dict
    settings: dict

    @property
    def conditional(self) -> bool:
        return bool(self.settings.get("source_length"))

    @property
    def method(self) -> str:
        """"elf", or the token-level baseline the network is ("ar", "mdlm")."""
        return self.settings.get("method", "elf")


def method_of(path: str | os.PathLike) -> str:
    """The method of an elflow run, checkpoint or model folder without reading its weights; "elf" for any other
    format (the authors' checkpoints, hub ids)."""
    p = Path(str(path)).expanduser()
    if is_model_folder(p):
        method = _model_json(p, "config.json").get("method", "elf")
        return method if isinstance(method, str) else "?"
    if is_elflow_folder(p):
        method = read_state(resolve_checkpoint(p)).get("method", "elf")
        return method if isinstance(method, str) else "?"
    return "elf"


def read_weights(path_or_hub_id: str | os.PathLike, use_ema: bool = True, max_length: int | None = None,
                 need: str | None = "init-from"):
    """Every format through one function: an elflow run folder (its newest good checkpoint), an elflow
    checkpoint folder, an authors' checkpoint_<step> file or a folder holding one, or a hub id.
    Returns (network config, state dict, space spec, recipe, settings); the state dict is empty when EMA
    weights were asked for and none were stored. `max_length` widens the position table. settings["method"]
    names the method; `need` (an elflow.methods feature, or None) refuses the models of methods without it:
    by default every model but an ELF network's, whose config is an ELFConfig (its short-run options, if any,
    in settings["short_run"])."""
    s = str(path_or_hub_id)
    p = Path(s).expanduser()
    check_checkpoint_path(p)
    if not p.exists():
        if not is_hub_id(s):
            raise ELFError(f"{s}: no such file or folder (nor a hub id of the form owner/name)")
        p = _download(s)
    if is_model_folder(p) or is_elflow_folder(p):
        if is_model_folder(p):
            ckpt, st, sd = p, *read_model_folder(p, use_ema)
        else:
            ckpt, blob = _load_newest(p)
            st, sd = blob["state"], blob["ema" if use_ema else "model"]
        method = get_method(st.get("method", "elf"))
        if need is not None:
            require(method, need, "this command", path_or_hub_id)
        try:
            cfg, extra = method.stored_config(st)
            train = TrainConfig.from_dict(st.get("train", {}))
            recipe, space = dict(train.recipe), stored_spec(st["space"])
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            where = ckpt / ("config.json" if is_model_folder(p) else "state.json")
            raise ELFError(f"{where}: its settings cannot be read ({type(e).__name__}: {e})") from None
        sd = {k: v for k, v in sd.items() if not k.startswith("space.")}
        settings = {"length": cfg.max_length, **st.get("settings", {}), "format": "elflow",
                    "checkpoint": str(ckpt), "space_id": st.get("space_id"), "method": method.name, **extra}
        if train.distillation:  # a distilled model: its step count and few-step defaults
            n = train.distillation["student_steps"]
            settings.setdefault("distilled_steps", n)
            settings["sampling"] = {**settings.get("sampling", {}), **distilled_defaults(n)}
    else:
        f = find_official_file(p)
        sd = read_official_checkpoint(f, which="ema_params1" if use_ema else "params")
        settings = {"length": 1024, **_authors_settings(f.parent, s), "format": "official", "checkpoint": str(f)}
        cfg = infer_config(sd, max_length=settings["length"])
        recipe, space = {}, dict(AUTHORS_SPACE)
        if settings.get("source_length"):
            recipe["decode_noise_scale"] = 1.0
    if max_length and max_length > cfg.max_length:
        cfg = cfg.replace(max_length=max_length)
    return cfg, sd, space, recipe, settings


def _load_newest(p: Path, tries: int = 5):
    """(checkpoint folder, its blob) of a run or checkpoint folder; a checkpoint that vanishes between the
    choice and the read (`--keep` of a training that runs) gives way to the next newest."""
    for attempt in range(tries):
        ckpt = resolve_checkpoint(p)
        try:
            return ckpt, load_checkpoint(ckpt, with_optimizer=False)
        except ELFError:
            if ckpt.exists() or attempt == tries - 1:
                raise


def load(path_or_hub_id: str | os.PathLike, device=None, use_ema: bool = True,
         max_length: int | None = None) -> Loaded:
    """The network of any checkpoint `read_weights` reads, of any method (`Loaded.method`), in eval mode
    with its EMA weights (unless use_ema=False), with its space spec, recipe and settings."""
    cfg, sd, space, recipe, settings = read_weights(path_or_hub_id, use_ema, max_length, need=None)
    if not sd:
        raise ELFError(f"{path_or_hub_id} holds no {'EMA ' if use_ema else ''}weights"
                       + ("; pass --raw-weights to use the trained ones" if use_ema else ""))
    try:
        net = get_method(settings.get("method", "elf")).load(cfg, sd, settings)
    except ELFError as e:
        raise ELFError(f"{path_or_hub_id}: {e}") from None
    net = net.to(device or "cpu").eval()
    return Loaded(net, space, recipe, settings)


def load_network(path: str | os.PathLike, device=None, use_ema: bool = True, max_length: int | None = None) -> ELF:
    """The network alone (see `load`)."""
    return load(path, device=device, use_ema=use_ema, max_length=max_length).net


def load_for_sampling(path_or_hub_id, device=None, space=None, use_ema: bool = True,
                      max_length: int | None = None):
    """(Loaded, embedding space). `space` overrides the stored one: a build_space spec, a folder or hub id of a
    T5 encoder (for the authors' checkpoints offline), or a ready space object."""
    from elflow.encoders import EmbeddingSpace, build_space, check_compatible

    device = torch.device(device or default_device())
    loaded = load(path_or_hub_id, device=device, use_ema=use_ema, max_length=max_length)
    method = get_method(loaded.method)
    spec = loaded.space
    if isinstance(space, str) and space:
        require(method, "encoder", "--encoder", path_or_hub_id)
    if isinstance(space, EmbeddingSpace):
        sp = space
    elif isinstance(space, dict):
        sp = build_space(space, device=device)
    elif isinstance(space, str) and space:
        kind = spec.get("kind") if spec.get("kind") in ("t5", "hf") else "t5"
        sp = build_space({**spec, "kind": kind, "name": space, "latent_std": spec.get("latent_std", 0.2)},
                         device=device)
    else:
        sp = build_space(spec, device=device)
    if sp.trainable and loaded.settings.get("format") == "elflow":  # a learned table trained with the network
        sp.load_trainable_state_dict(trained_space_state(loaded.settings["checkpoint"]))
    if loaded.settings.get("space_id"):
        check_compatible(loaded.settings["space_id"], sp)
    method.fits(sp, loaded.net)
    return loaded, sp


def load_init_weights(path, warn=None):
    """(ELFConfig, state dict, info) of the weights a run starts from (`--init-from`, a distillation's
    teacher): the EMA of an elflow run or checkpoint (or of an authors' checkpoint). Where no EMA was stored,
    the trained weights, with a warning."""
    cfg, sd, spec, recipe, info = read_weights(path, use_ema=True)
    if not sd:
        (warn or _warn)(f"warning: {path} holds no EMA weights; using its trained (raw) weights instead")
        cfg, sd, spec, recipe, info = read_weights(path, use_ema=False)
        info = {**info, "ema": False}
    return cfg, sd, {**info, "space": spec, "recipe": recipe}


SHAPE_FREE = ("max_length",)  # ELFConfig fields that do not change the weights


def check_init_compatible(path, init_cfg, info: dict, net, space) -> None:
    """Refuse starting weights (`load_init_weights`) of another embedding space or another network (shape or
    short-run options) than `net`, in `space`."""
    stored = info.get("space_id")
    if stored and stored != space.space_id:
        raise ELFError(f"{path} was trained in the embedding space {stored!r}, this run uses {space.space_id!r}; "
                       "pass the matching --space / --latent-std")
    shape, options = describe_network(net)
    a = {**init_cfg.to_dict(), **options_of(info.get("short_run")).to_dict()}
    b = {**shape, **options_of(options).to_dict()}
    diff = [f"{k} {a[k]} vs {b[k]}" for k in a if k not in SHAPE_FREE and a[k] != b.get(k)]
    if diff:
        raise ELFError(f"{path} holds a network of another shape than this run's ({', '.join(diff)})")


# ----------------------------------------------------------------------------------------------------------
# `elflow convert`


def convert(src: str | os.PathLike, out: str | os.PathLike, max_length: int | None = None) -> Path:
    """An authors' checkpoint -> an elflow checkpoint folder (safetensors + JSON) that samples, not resumes.
    The layout and sampling defaults of a released conditional or distilled model are kept."""
    f = find_official_file(src)
    ema = read_official_checkpoint(f, which="ema_params1")
    params = read_official_checkpoint(f, which="params")
    settings = _authors_settings(f.parent, str(src))
    cfg = infer_config(ema, max_length=max_length or settings.get("length", 1024))
    build_from_state_dict(ema, config=cfg)  # refuses weights that fit no network
    step = int(m.group(1)) if (m := re.fullmatch(r"checkpoint_(\d+)", f.name)) else 0
    state = {"format": "elflow-checkpoint-1", "step": step, "model": cfg.to_dict(), "space": dict(AUTHORS_SPACE),
             "train": {"preset": preset_name(cfg), "converted_from": str(f),
                       "recipe": {"decode_noise_scale": 1.0} if settings.get("source_length") else {}},
             "settings": settings, "data_position": None}
    return write_checkpoint(out, params, ema, None, state)


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="the authors' checkpoint_<step> file, or a folder holding one")
    p.add_argument("out", help="the elflow checkpoint folder to write")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest sequence the converted model samples (default: its release's, else 1024)")


def run(args) -> int:
    from elflow.utils import check_output

    out = check_output(args.out, folder=True)
    if out.is_dir() and any(out.iterdir()):
        raise ELFError(f"{out} exists and is not empty; the converted checkpoint goes into a new folder: choose "
                       "another out")
    out = convert(args.checkpoint, out, args.max_length)
    print(f"wrote {out}")
    return 0
