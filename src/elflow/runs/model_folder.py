"""A model folder: what `elflow push` uploads (and `push --dry-run` writes), and `elflow.load` reads back.

    model.safetensors    the EMA weights of the network     space.safetensors   a learned space's parameters
    config.json          {"format", "record" (the model's RunRecord), "train" (the training settings of its run
                         beside the record, as its run.json stores them; null where it had none), "step", "files":
                         the sha256 and size of each weight file}
    README.md            the model card (elflow.lifecycle.push)

Folders of the earlier layout (MODEL_FORMAT_1: config.json with the network config, recipe.json, space.json,
sampling.json) are read too: their files are merged into one document of version 1, which elflow.runs.migrate
makes today's. Only the weight files config.json lists are read, as regular files (never
through a link), each checked against its recorded hash and size.
"""

from __future__ import annotations

from pathlib import Path

from elflow.runs.checkpoint import listed_files, load_tensors
from elflow.runs.folder import MODEL_CONFIG
from elflow.util.errors import ELFError
from elflow.util.files import read_json

MODEL_FORMAT = "elflow-model-2"
MODEL_FORMAT_1 = "elflow-model-1"
MODEL_FORMATS = (MODEL_FORMAT, MODEL_FORMAT_1)
MODEL_JSON_1 = (MODEL_CONFIG, "recipe.json", "space.json", "sampling.json")
NETWORK_KEYS = ("model", "short_run")  # the network's entries of an earlier config.json


def model_json(folder: Path, name: str) -> dict:
    return read_json(folder / name, f"{folder} is a model folder")


def is_model_folder(path: Path) -> bool:
    """An elflow model folder (config.json of MODEL_FORMATS), not a released folder with a config.json."""
    f = Path(path) / MODEL_CONFIG
    if not f.is_file() or f.is_symlink():
        return False
    try:
        return read_json(f).get("format") in MODEL_FORMATS
    except ELFError:
        return False


# what each JSON file of the first layout holds
FIELDS_1 = {MODEL_CONFIG: ("format", "method", "model", "short_run", "params", "step", "files"),
            "recipe.json": ("recipe", "train"), "space.json": ("space", "space_id"),
            "sampling.json": ("length", "sampling")}
# the record's parts each first-layout file held (the rest: config.json), for an error that names the file
PARTS_1 = {"recipe.json": ("recipe",), "space.json": ("space",), "sampling.json": ("length", "task", "sampling")}


def read_model_folder_files(folder: Path) -> tuple[dict, dict, dict]:
    """(document, files, stored_in) of a model folder: config.json (with "record"), or an earlier folder's JSON
    files merged into one document of version 1 (elflow.runs.migrate reads either); files maps each weight file
    to its recorded {"sha256", "bytes"} (bytes None where an earlier folder recorded none); stored_in names the
    file each part of the record came from where it is not config.json (RunRecord.from_dict). A field that no
    file of its layout holds is refused, naming the file."""
    config = model_json(folder, MODEL_CONFIG)
    files = listed_files(config.get("files"), folder / MODEL_CONFIG, "model")
    if "model.safetensors" not in files:
        raise ELFError(f"{folder / MODEL_CONFIG}: corrupted (its \"files\" do not list model.safetensors)")
    if config.get("format") == MODEL_FORMAT:
        return config, files, {}
    recipe, space, sampling = (model_json(folder, n) for n in MODEL_JSON_1[1:])
    for name, doc in zip(MODEL_JSON_1, (config, recipe, space, sampling)):
        unknown = sorted(set(doc) - set(FIELDS_1[name]))
        if unknown:
            raise ELFError(f"{folder / name}: unknown fields {unknown} (a model folder of this layout holds "
                           f"{', '.join(FIELDS_1[name])} there); restore the file as elflow wrote it")
    if "space" not in space:
        raise ELFError(f"{folder / 'space.json'}: no space description")
    train = recipe.get("train", {})
    if isinstance(train, dict) and recipe.get("recipe", {}) != (train.get("recipe") or {}):  # written the same
        raise ELFError(f"{folder / 'recipe.json'}: its \"recipe\" differs from its train.recipe, which this layout "
                       "holds the same; restore the file as elflow wrote it")
    doc = {"method": config.get("method", "elf"), **{k: config[k] for k in NETWORK_KEYS if k in config},
           "params": config.get("params"), "step": config.get("step"), "train": train,
           "space": space["space"], "space_id": space.get("space_id"), "settings": sampling}
    return doc, files, {part: str(folder / name) for name, parts in PARTS_1.items() for part in parts}


def load_listed(folder: Path, files: dict, name: str, where: str) -> dict:
    """The tensors of the weight file `name` of a model folder, which config.json (`where`) must list: read as
    a regular file (never through a link), bounded by its recorded size, checked against its sha256."""
    if name not in files:
        raise ELFError(f"{where}: does not list {name}; an unlisted weight file is never read")
    return load_tensors(folder / name, files[name]["sha256"], files[name]["bytes"])
