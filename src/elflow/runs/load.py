"""The one loader: any model elflow can sample, from any format, without the training code. It goes one way:
find the model (`locate`) -> read its record and each weight file it uses, once (`read_model_parts`) -> build
the space the record describes -> build the network the record describes -> load the weights, checked.

    load(path_or_hub_id)            -> the network in eval mode with its EMA weights, `.record` and `.origin`
    load_for_sampling(path, ...)    -> (that network, its embedding space)
    read_record(path_or_hub_id)     -> its RunRecord alone; read_model / read_model_parts: the record and weights
    load_init_weights(path)         -> (record, weights, origin) a run starts from (--init-from, a teacher)
    convert_released(src, out)      -> an elflow run folder of a released checkpoint (`elflow convert`)

Formats: an elflow run folder (its newest good checkpoint), a checkpoint folder or a model folder (what
`elflow push` uploads), a released checkpoint_<step> file or a folder holding one, or a hub id of either.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from elflow.data.store import is_store
from elflow.methods import get_method, require
from elflow.runs.checkpoint import (
    check_tensors,
    is_elflow_checkpoint,
    is_elflow_folder,
    load_checkpoint,
    load_weights,
    newest_first,
    read_state,
    resolve_checkpoint,
    run_of,
    write_checkpoint,
)
from elflow.runs.folder import CHECKPOINTS, MODEL_CONFIG, MODEL_WEIGHTS, RUN_FILE, STATE_FILE, step_dir
from elflow.runs.migrate import document, released_record
from elflow.runs.model_folder import is_model_folder, load_listed, read_model_folder_files
from elflow.runs.record import RunRecord, is_current
from elflow.runs.released import (
    RELEASED_LENGTH,
    RELEASED_SPACE,
    find_released_file,
    infer_config,
    read_released_checkpoint,
    release_settings,
)
from elflow.runs.stored import checkpoint_state, write_run
from elflow.space import EmbeddingSpace, build_space, check_compatible, learned, with_encoder
from elflow.util.devices import check_device, default_device
from elflow.util.errors import ELFError, first_line
from elflow.util.files import folder_in_place, read_json
from elflow.util.hub import hub_offline, hub_reachable, hub_unavailable_reason
from elflow.util.jsonio import open_regular

# ----------------------------------------------------------------------------------------------------------
# where a model is: a path or hub id -> the folder or file that holds it, and its kind
#
#     checkpoint     an elflow checkpoint folder (a run folder resolves to its newest good checkpoint)
#     model-folder   a model folder, as `elflow push` uploads it
#     released       a released checkpoint_<step> file (a folder holding one resolves to the newest)
#
# A hub id (owner/name that is no local path) is downloaded first. Anything else is one line saying what the
# path is: missing, empty, a fifo or a device, a token store, a run without a checkpoint.
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
    if p.is_dir() and (p / CHECKPOINTS).is_dir() and not is_elflow_checkpoint(p):  # a run folder
        candidates = tuple(newest_first(p))
        if not candidates:
            raise ELFError(f"{p}: this run has no checkpoint yet")
        return Located("checkpoint", candidates[0], s, candidates)
    if is_model_folder(p):
        return Located("model-folder", p, s)
    if is_elflow_checkpoint(p) or is_elflow_folder(p):
        ckpt = resolve_checkpoint(p)
        return Located("checkpoint", ckpt, s, (ckpt,))
    if is_store(p):
        raise ELFError(f"{p} is a token store (made by `elflow prepare`: training data, for --data), not a run, a "
                       "checkpoint or a model; pass a run or checkpoint folder")
    return Located("released", find_released_file(p), s)


# ----------------------------------------------------------------------------------------------------------
# a model of any format: its record and its weights
@dataclass(frozen=True)
class Origin:
    """Where a loaded model's weights came from: the checkpoint folder, model folder or released file, its
    format (KINDS), its step (None where unknown), whether the weights are the EMA's, and the file that holds
    its record."""

    path: str
    format: str
    step: int | None = None
    ema: bool = True
    record_file: str | None = None  # the file its record was read from (None: a released model's weights)
    data_store: dict | None = None  # a checkpoint's: the token store it was trained on, as its state.json says


@dataclass(frozen=True)
class StoredModel:
    """What `read_model_parts` read of a model: its record, its weights (elflow-named; None when not asked
    for; {} where no EMA weights were stored and the EMA was asked for), a learned space's parameters ({} for
    any other space) and where they came from."""

    record: RunRecord
    weights: dict | None
    space: dict
    origin: Origin


def read_record(path_or_hub_id) -> RunRecord:
    """The record of a run folder (its newest good checkpoint's), a checkpoint folder, a model folder made by
    `push`, or a released checkpoint (a checkpoint_<step> file or its folder), or a hub id of one."""
    return read_model_parts(path_or_hub_id, weights=False).record


def read_model(path_or_hub_id, use_ema: bool = True, weights: bool = True, tries: int = 5):
    """(record, weights (elflow-named; None unless `weights`), origin) of any model `locate` finds. Where no EMA
    weights were stored and `use_ema` asks for them, the weights are {}."""
    m = read_model_parts(path_or_hub_id, use_ema, weights, tries)
    return m.record, m.weights, m.origin


def read_model_parts(path_or_hub_id, use_ema: bool = True, weights: bool = True, tries: int = 5) -> StoredModel:
    """The record, weights and learned space parameters of any model `locate` finds, each file read once. A
    run's newest checkpoint that cannot be read (or vanishes while it is read: `--keep` of a training that runs)
    gives way to the next newest, with a warning for a damaged one."""
    for attempt in range(tries):
        found = locate(path_or_hub_id)
        try:
            return _read_located(found, use_ema, weights)
        except ELFError:
            if found.kind != "checkpoint" or found.path.exists() or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _read_located(found, use_ema: bool, weights: bool) -> StoredModel:
    if found.kind == "model-folder":
        if not use_ema:
            raise ELFError(f"{found.path} is a model folder: it holds the EMA weights only")
        config, files, stored_in = read_model_folder_files(found.path)
        where = str(found.path / MODEL_CONFIG)
        record = RunRecord.from_dict(document(config, where)["record"], where, stored_in)
        sd = load_listed(found.path, files, MODEL_WEIGHTS, where) if weights else None
        return StoredModel(record, sd, {}, Origin(str(found.path), found.kind, config.get("step"), True, where))
    if found.kind == "checkpoint":
        return _read_checkpoint(found, use_ema, weights)
    which = "ema_params1" if use_ema else "params"
    sd = read_released_checkpoint(found.path, which=which)
    settings = {"length": RELEASED_LENGTH, **release_settings(found.path.parent, found.given)}
    record = released_record(infer_config(sd, max_length=settings["length"]), settings, RELEASED_SPACE)
    m = re.fullmatch(r"checkpoint_(\d+)", found.path.name)
    return StoredModel(record, sd if weights else None, {},
                       Origin(str(found.path), found.kind, int(m.group(1)) if m else None, use_ema))


def _read_checkpoint(found, use_ema: bool, weights: bool) -> StoredModel:
    """The first of a run's checkpoints (newest first) that reads whole: the run's record once, its state.json
    once, then each weight file it needs once (the EMA's, or the trained weights; model.safetensors for a
    learned space's parameters too); never optimizer.pt."""
    bad, described = [], None
    for ckpt in found.candidates or (found.path,):
        try:
            state = read_state(ckpt)
            if described is None and "record" not in state:
                described = run_record_of(ckpt)
            record = checkpoint_record(ckpt, state, described)
            origin = Origin(str(ckpt), found.kind, state.get("step"), use_ema, str(record_file(ckpt, state)),
                            state.get("data_store"))
            if not weights:
                return StoredModel(record, None, {}, origin)
            # a learned table's parameters: space.safetensors, or inside model.safetensors (the other layout)
            space_in_model = learned(record.space) and "space.safetensors" not in state["files"]
            parts = load_checkpoint(ckpt, with_optimizer=False, model=not use_ema or space_in_model, ema=use_ema,
                                    state=state)
        except ELFError as e:
            if len(found.candidates) < 2:
                raise
            if ckpt.exists():
                bad.append(str(e))
            continue
        for why in bad:
            print(f"warning: skipping a bad checkpoint: {why}", file=sys.stderr)
        return StoredModel(record, parts["ema" if use_ema else "model"], parts["space"], origin)
    raise ELFError(f"{found.given}: none of its checkpoints can be read ({'; '.join(bad) or 'all vanished'})")


def run_record_of(ckpt: Path) -> RunRecord:
    """The record of the run a checkpoint folder belongs to (RUN/checkpoints/step_N -> RUN/run.json's): a
    checkpoint's state.json names its model by the record's digest alone."""
    run = run_of(ckpt)
    if run is None:
        raise ELFError(f"{ckpt}: a checkpoint read without its run: the model it holds is described by its run's "
                       f"{RUN_FILE} (RUN/{RUN_FILE} beside RUN/{CHECKPOINTS}/{ckpt.name}), which is not there; load it "
                       f"from its run folder, or copy the run's {RUN_FILE} with it")
    where = str(run / RUN_FILE)
    doc = read_json(run / RUN_FILE)
    return RunRecord.from_dict((doc if is_current(doc) else document(doc, where)).get("record"), where)


def _run_record_if_readable(ckpt: Path) -> RunRecord | None:
    """The record of a checkpoint's run, or None where the checkpoint is read without its run or its run.json
    cannot be read (a checkpoint of an earlier elflow, which carries its own, is read all the same)."""
    if run_of(ckpt) is None:
        return None
    try:
        return run_record_of(ckpt)
    except ELFError:
        return None


def record_file(ckpt: Path, state: dict) -> Path:
    """The file that holds the record of a checkpoint's model: its run's run.json, or the state.json of a
    checkpoint of an earlier elflow, which carries its own."""
    return ckpt / STATE_FILE if state.get("record") is not None else ckpt.parent.parent / RUN_FILE


def checkpoint_record(ckpt: Path, state: dict, described: RunRecord | None = None) -> RunRecord:
    """The record of the model a checkpoint holds (`state`: its state.json as `read_state` gives it): the one a
    checkpoint of an earlier elflow carries (with its run's sampling defaults when its run describes the same
    model: every checkpoint of a run samples with the run's current defaults), else its run's (`described`, or
    read: `run_record_of`), which must be the one its weights were saved with (state.json's "model_sha256",
    `RunRecord.digest`)."""
    if state.get("record") is not None:  # its own, with the run's current sampling defaults where it is the run's
        own = RunRecord.from_dict(state["record"], str(record_file(ckpt, state)))
        run = described if described is not None else _run_record_if_readable(ckpt)
        return own.replace(sampling=run.sampling) if run is not None and run.digest() == own.digest() else own
    described = run_record_of(ckpt) if described is None else described
    if described.digest() != state["model_sha256"]:
        raise ELFError(f"{record_file(ckpt, state)} describes another model than its checkpoint {ckpt.name} holds "
                       "(not the model it was saved with: its record's digest differs from the checkpoint's "
                       "model_sha256); run.json was edited or replaced: restore it")
    return described


def check_load_args(path_or_hub_id, device, use_ema, max_length) -> str | None:
    """`load`'s arguments, checked before anything is read (ELFError naming the first that is wrong): a path or
    hub id (a non-empty str or path), a device (None, a str or a torch.device of this machine), use_ema a bool,
    max_length None or a whole number >= 1. Returns the device as a string (None: the default)."""
    if not isinstance(path_or_hub_id, (str, os.PathLike)) or not str(os.fspath(path_or_hub_id)).strip():
        raise ELFError(f"load: the model must be a path or a hub id (a non-empty str), got {path_or_hub_id!r}")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise ELFError(f"load: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
    if not isinstance(use_ema, bool):
        raise ELFError(f"load: use_ema must be True or False, got {use_ema!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ELFError(f"load: max_length must be None or a whole number >= 1, got {max_length!r}")
    return check_device(str(device) if device is not None else None, "device")


def load(path_or_hub_id: str | os.PathLike, device=None, use_ema: bool = True,
         max_length: int | None = None) -> torch.nn.Module:
    """The network of any model `read_model` reads, of any method, in eval mode with its EMA weights (unless
    use_ema=False); `net.record` is its RunRecord, `net.origin` where the weights came from. `max_length`
    widens its position table. Its arguments are checked first (`check_load_args`)."""
    device = check_load_args(path_or_hub_id, device, use_ema, max_length) or "cpu"
    return _network(path_or_hub_id, read_model_parts(path_or_hub_id, use_ema), device, use_ema, max_length)


def _network(path_or_hub_id, stored: StoredModel, device, use_ema: bool, max_length) -> torch.nn.Module:
    """The network a stored model's record describes, its weights loaded (checked), in eval mode on `device`."""
    if not stored.weights:
        raise ELFError(f"{path_or_hub_id} holds no {'EMA ' if use_ema else ''}weights"
                       + ("; pass --raw-weights to use the trained ones" if use_ema else ""))
    net = build_loaded(stored.record, stored.weights, stored.origin.path, max_length).to(device).eval()
    net.record, net.origin = stored.record, stored.origin
    return net


def build_loaded(record: RunRecord, weights: dict, where, max_length: int | None = None) -> torch.nn.Module:
    """The network `record` describes (its method's builder, its memory checked) holding `weights`, checked
    as every loader checks them (`load_weights`): built on the meta device, without initial weights, which
    the stored tensors replace. `max_length` widens its position table. The one builder of a stored model:
    sampling, evaluation and a distillation's teacher."""
    with torch.device("meta"):
        net = get_method(record.method).build_network(record, max_length)
    load_weights(net, weights, where)
    return net


def load_for_sampling(path_or_hub_id, device=None, space=None, use_ema: bool = True,
                      max_length: int | None = None):
    """(network, embedding space): `load`'s network and the space its record describes, checked against it.
    `space` overrides the stored one: a build_space spec, a folder or hub id of a T5 encoder (for the released
    checkpoints offline), or a ready space object; anything else is an ELFError, as are `load`'s bad arguments.
    One way: the record is read once, then the space is built, then the network, then each weight file it
    needs is read and checked once (a learned space's parameters come from the same read)."""
    if space is not None and not isinstance(space, (str, dict, EmbeddingSpace)):
        raise ELFError(f"load_for_sampling: space must be None (the stored one), a space spec (str or dict), an "
                       f"encoder folder or hub id, or an EmbeddingSpace; got {type(space).__name__} {space!r:.60}")
    device = torch.device(check_load_args(path_or_hub_id, device, use_ema, max_length) or default_device())
    stored = read_model_parts(path_or_hub_id, use_ema)
    record = stored.record
    method = get_method(record.method)
    if isinstance(space, str) and space:
        require(method, "encoder", "--encoder", path_or_hub_id)
    if isinstance(space, EmbeddingSpace):
        sp = space
    elif isinstance(space, dict):
        sp = build_space(space, device=device)
    elif isinstance(space, str) and space:
        sp = build_space(with_encoder(record.space.build_spec(), space), device=device)
    else:
        sp = build_space(record.space, device=device)
    if sp.trainable and stored.space:  # a learned table trained with the network
        sp.load_trainable_state_dict(stored.space)
    net = _network(path_or_hub_id, stored, device, use_ema, max_length)
    if record.space.id:
        check_compatible(record.space.id, sp)
    method.fits(sp, net)
    return net, sp


def load_init_weights(path, warn=None, need: str = "init-from") -> tuple[RunRecord, dict, Origin]:
    """(record, weights, origin) a run starts from (`--init-from`, a distillation's teacher): the EMA of an
    elflow run or checkpoint (or of a released checkpoint). Where no EMA was stored, the trained weights,
    with a warning. A model whose method lacks the feature `need` (elflow.methods.base.FEATURES) is refused."""
    record, sd, origin = read_model(path, use_ema=True)
    require(get_method(record.method), need, FEATURE_WHAT.get(need, need), path)
    if not sd:
        (warn or _warn)(f"warning: {path} holds no EMA weights; using its trained (raw) weights instead")
        record, sd, origin = read_model(path, use_ema=False)
    check_tensors(sd, origin.path)  # the same checks as for sampling, before a run starts from them
    return record, sd, origin


FEATURE_WHAT = {"init-from": "--init-from", "distill": "elflow distill"}


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr)


SHAPE_FREE = ("max_length",)  # network config fields that do not change the weights
# a flow-map student starts from an undistilled network's weights: its target time's embedding is new (and zero)


def check_init_compatible(path, record: RunRecord, net, space) -> None:
    """Refuse starting weights (`load_init_weights`) of another embedding space or another network (shape or
    short-run options) than `net`, in `space`."""
    stored = record.space.id
    if stored and stored != space.space_id:
        raise ELFError(f"{path} was trained in the embedding space {stored!r}, this run uses {space.space_id!r}; "
                       "pass the matching --space / --latent-std")
    config, options = get_method(record.method).network_of(net)
    a = {**record.network.to_dict(), **(record.options.to_dict() if options is not None else {})}
    b = {**config.to_dict(), **(options.to_dict() if options is not None else {})}
    free = SHAPE_FREE + (("target_time",) if b.get("target_time") and not a.get("target_time") else ())
    diff = [f"{k} {a[k]} vs {b.get(k)}" for k in a if k not in free and a[k] != b.get(k)]
    if diff:
        raise ELFError(f"{path} holds a network of another shape than this run's ({', '.join(diff)})")


def method_of(path) -> str:
    """The method of an elflow run, checkpoint or model folder, from its record; "elf" for any other format
    (a released checkpoint, a hub id), which is read only when the model is loaded."""
    p = Path(str(path)).expanduser()
    if is_model_folder(p) or is_elflow_folder(p):
        return read_record(p).method
    return "elf"


def convert_released(src: str | os.PathLike, out: str | os.PathLike, max_length: int | None = None) -> Path:
    """A released checkpoint -> an elflow run folder (OUT/run.json with its record, and OUT/checkpoints/step_N
    with its weights as safetensors) that samples, not resumes. The layout and sampling defaults of a released
    conditional or distilled model are kept. Returns the run folder."""
    out = Path(out)
    if os.path.lexists(out) and not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        raise ELFError(f"{out} exists and is not an empty folder; the converted model goes into a new folder: "
                       "choose another out")
    f = find_released_file(src)
    record, ema, origin = read_model(f, use_ema=True)
    if max_length:
        record = record.replace(network=record.network.replace(max_length=max_length),
                                length=min(record.length, max_length))
    try:
        params = read_released_checkpoint(f, which="params")
    except ELFError as e:
        raise ELFError(f"{f}: its trained weights cannot be read ({first_line(e)}); nothing was written") from None
    net = get_method("elf").build_network(record)
    load_weights(net, ema, f)  # refuses weights that fit no network
    return _write_converted(out, record, params, ema, origin.step or 0, f)


def _write_converted(out: Path, record: RunRecord, params: dict, ema: dict, step: int, source: Path) -> Path:
    """The run folder of a converted release, built under a temporary sibling name and renamed into place (an
    empty `out` is replaced), so that no half-written folder is ever read."""
    with folder_in_place(out) as tmp:
        write_checkpoint(tmp / CHECKPOINTS / step_dir(step), params, ema, None, checkpoint_state(record, step))
        write_run(tmp, record, None, files=(RUN_FILE, CHECKPOINTS), converted_from=str(source))
    return out
