"""The one loader: any model elflow can sample, from any format, without the training code.

    load(path_or_hub_id)            -> Loaded(net, space spec, recipe, settings), any method, EMA weights
    load_for_sampling(path, ...)    -> (Loaded, the embedding space built and checked against the network)
    read_weights / load_init_weights   the weights alone (--init-from, a distillation's teacher)

Formats: an elflow run folder (its newest good checkpoint), checkpoint folder or model folder (what `elflow
push` uploads), an authors' checkpoint_<step> file or a folder holding one, or a hub id of either. Stored
settings are read as they are stored (elflow.runs.checkpoint.upgrade_state reads earlier layouts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from elflow.data.store import is_store
from elflow.flow import recipe_for
from elflow.methods import get_method, require
from elflow.methods.elf import describe_network
from elflow.model import options_of
from elflow.runs.checkpoint import (
    is_elflow_checkpoint,
    is_elflow_folder,
    load_checkpoint,
    print_warning,
    read_state,
    resolve_checkpoint,
    trained_space_state,
    verify_checkpoint,
)
from elflow.runs.model_folder import is_model_folder, model_folder_state, model_json, read_model_folder
from elflow.runs.official import (
    AUTHORS_SPACE,
    authors_settings,
    find_official_file,
    infer_config,
    read_official_checkpoint,
)
from elflow.space import EmbeddingSpace, build_space, check_compatible, with_encoder
from elflow.util.devices import default_device
from elflow.util.errors import ELFError
from elflow.util.hub import hub_offline, hub_reachable, hub_unavailable_reason


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


@dataclass
class Loaded:
    """A network with what it needs to be used: its embedding space's spec, its recipe and its settings.

    settings: "length" (the trained sequence length), "source_length" (conditional models), "task",
    "sampling" (default sampler settings), "distilled_steps", plus where it came from ("format",
    "checkpoint", "space_id")."""

    net: torch.nn.Module
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
        method = model_json(p, "config.json").get("method", "elf")
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
            train = st.get("train") or {}
            recipe, space, distillation = dict(train.get("recipe") or {}), st["space"], train.get("distillation")
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            where = ckpt / ("config.json" if is_model_folder(p) else "state.json")
            raise ELFError(f"{where}: its settings cannot be read ({type(e).__name__}: {e})") from None
        settings = {"length": cfg.max_length, **st.get("settings", {}), "format": "elflow",
                    "checkpoint": str(ckpt), "space_id": st.get("space_id"), "method": method.name, **extra}
        if distillation:  # a distilled model: its step count (generate.settings_for gives its few-step defaults)
            settings.setdefault("distilled_steps", distillation["student_steps"])
    else:
        if is_store(p):
            raise ELFError(f"{p} is a token store (made by `elflow prepare`: training data, for --data), not a run, "
                           "a checkpoint or a model; pass a run or checkpoint folder")
        f = find_official_file(p)
        sd = read_official_checkpoint(f, which="ema_params1" if use_ema else "params")
        settings = {"length": 1024, **authors_settings(f.parent, s), "format": "official", "checkpoint": str(f)}
        cfg = infer_config(sd, max_length=settings["length"])
        recipe, space = recipe_for({}, bool(settings.get("source_length"))).to_dict(), dict(AUTHORS_SPACE)
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


def load_for_sampling(path_or_hub_id, device=None, space=None, use_ema: bool = True,
                      max_length: int | None = None):
    """(Loaded, embedding space). `space` overrides the stored one: a build_space spec, a folder or hub id of a
    T5 encoder (for the authors' checkpoints offline), or a ready space object."""
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
        sp = build_space(with_encoder(spec, space), device=device)
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
        (warn or print_warning)(f"warning: {path} holds no EMA weights; using its trained (raw) weights instead")
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
