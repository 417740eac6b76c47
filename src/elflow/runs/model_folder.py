"""A model folder: what `elflow push` uploads (and `push --dry-run` writes), and `elflow.load` reads back.

    model.safetensors    the EMA weights of the network     space.safetensors   a learned space's parameters
    config.json          format, method, the network's config (and short-run options), parameter counts,
                         step, the sha256 of the weight files
    recipe.json          the flow recipe and every training setting of the run
    space.json           the embedding space's description and id
    sampling.json        the model's layout (length, source length, task, distilled steps) and the sampler
                         settings it samples with when no flag is given
    README.md            the model card (elflow.runs.push)
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from elflow.runs.checkpoint import PLAIN_NAME, upgrade_state
from elflow.util.errors import ELFError
from elflow.util.files import sha256_file as _sha256

MODEL_FORMAT = "elflow-model-1"


MODEL_JSON = ("config.json", "recipe.json", "space.json", "sampling.json")


NETWORK_KEYS = ("model", "short_run")  # the entries of a method's `describe` that a state holds


def model_json(folder: Path, name: str) -> dict:
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


def model_folder_state(folder: Path) -> dict:
    """A model folder's JSON files as one state in the layout of a checkpoint's state.json."""
    config = model_json(folder, "config.json")
    recipe, space, sampling = (model_json(folder, n) for n in MODEL_JSON[1:])
    if "space" not in space:
        raise ELFError(f"{folder / 'space.json'}: no space description")
    return upgrade_state({"method": config.get("method", "elf"), **{k: config[k] for k in NETWORK_KEYS if k in config},
                          "params": config.get("params"), "step": config.get("step"), "train": recipe.get("train", {}),
                          "space": space["space"], "space_id": space.get("space_id"), "settings": sampling,
                          "files": config.get("files", {})})


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
