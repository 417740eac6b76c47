"""The one loader: any model elflow can sample, from any format, without the training code. It goes one way:
read the record (elflow.runs.record) -> build the network the record describes -> load the weights, checked
-> (for sampling) build the space the record describes and check it against the network.

    load(path_or_hub_id)            -> the network in eval mode with its EMA weights, `.record` and `.origin`
    load_for_sampling(path, ...)    -> (that network, its embedding space)
    load_init_weights(path)         -> (record, weights, origin) a run starts from (--init-from, a teacher)
    convert_released(src, out)      -> an elflow checkpoint folder of a released checkpoint (`elflow convert`)

Formats: an elflow run folder (its newest good checkpoint), a checkpoint folder or a model folder (what
`elflow push` uploads), a released checkpoint_<step> file or a folder holding one, or a hub id of either.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from elflow.methods import get_method, require
from elflow.runs.checkpoint import check_tensors, is_elflow_folder, load_weights, write_checkpoint
from elflow.runs.model_folder import is_model_folder
from elflow.runs.record import RunRecord
from elflow.runs.released import find_released_file, read_released_checkpoint
from elflow.runs.stored import Origin, StoredModel, checkpoint_state, read_model, read_model_parts, read_record
from elflow.space import EmbeddingSpace, build_space, check_compatible, with_encoder
from elflow.util.devices import check_device, default_device
from elflow.util.errors import ELFError, first_line


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
    net = get_method(stored.record.method).build_network(stored.record, max_length)
    load_weights(net, stored.weights, stored.origin.path)
    net = net.to(device).eval()
    net.record, net.origin = stored.record, stored.origin
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
    """A released checkpoint -> an elflow checkpoint folder (safetensors + its record) that samples, not
    resumes. The layout and sampling defaults of a released conditional or distilled model are kept."""
    f = find_released_file(src)
    record, ema, origin = read_model(f, use_ema=True)
    if max_length:
        record = record.replace(network=record.network.replace(max_length=max_length),
                                length=min(record.length, max_length))
    try:
        params = read_released_checkpoint(f, which="params")
    except ELFError as e:
        raise ELFError(f"{f}: its trained weights cannot be read ({first_line(e)})") from None
    net = get_method("elf").build_network(record)
    load_weights(net, ema, f)  # refuses weights that fit no network
    return write_checkpoint(out, params, ema, None, checkpoint_state(record, origin.step or 0, converted_from=str(f)))
